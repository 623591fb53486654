"""The launcher's flag handling: our flags out, CPU defaults in, the user's own flags untouched."""

import json

import pytest

from sgl_memory import config, launch_server, models


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    d = tmp_path / "m"
    d.mkdir()
    cfg = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}
    (d / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(models, "resolve", lambda name: d)
    monkeypatch.setattr(launch_server, "_has_gpu", lambda: False)
    monkeypatch.setenv(config.CONFIG_ENV, "")  # so teardown restores whatever build_argv exports
    return d


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_cpu_defaults_and_our_backend(fake_model):
    argv, cfg = launch_server.build_argv([])
    assert flag_value(argv, "--model-path") == str(fake_model)
    assert flag_value(argv, "--radix-cache-backend") == "sgl_memory"
    assert flag_value(argv, "--device") == "cpu"
    assert flag_value(argv, "--attention-backend") == "sgl_memory_cpu"
    assert flag_value(argv, "--tool-call-parser") == "qwen25"  # the default model is a Qwen
    assert "--disable-overlap-schedule" in argv and "--skip-server-warmup" in argv and "--sleep-on-idle" in argv
    assert flag_value(argv, "--cuda-graph-backend-decode") == "disabled"
    tokens = int(flag_value(argv, "--max-total-tokens"))
    assert launch_server.KV_POOL_MIN_TOKENS <= tokens <= launch_server.KV_POOL_MAX_TOKENS
    assert cfg == config.MemoryConfig()


def test_kv_bytes_per_token_of_qwen_05b(fake_model):
    # 2 (K and V) x 24 layers x 2 KV heads x 64 head dim x 2 bytes
    assert launch_server.kv_bytes_per_token(fake_model) == 2 * 24 * 2 * 64 * 2


def test_user_flags_win(fake_model):
    argv, _ = launch_server.build_argv(
        ["--attention-backend=triton", "--max-total-tokens", "4096", "--radix-cache-backend", "other", "--port", "1234"]
    )
    assert "--attention-backend=triton" in argv and argv.count("--attention-backend") == 0
    assert flag_value(argv, "--max-total-tokens") == "4096" and argv.count("--max-total-tokens") == 1
    assert flag_value(argv, "--radix-cache-backend") == "other"
    assert flag_value(argv, "--port") == "1234"


def test_model_path_flag_is_ours_too(fake_model):
    argv, _ = launch_server.build_argv(["--model-path", "smollm2-135m-instruct"])
    assert argv.count("--model-path") == 1


def test_memory_config_is_exported_for_child_processes(fake_model, tmp_path, monkeypatch):
    p = tmp_path / "c.yaml"
    p.write_text("intent:\n  budget: 99\n")
    _, cfg = launch_server.build_argv(["--memory-config", str(p)])
    assert cfg.intent.budget == 99
    import os

    assert config.from_env() == cfg and os.environ[config.CONFIG_ENV] == str(p.resolve())
    assert "--memory-config" not in launch_server.build_argv(["--memory-config", str(p)])[0]


def test_unknown_config_key_is_refused(fake_model, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("intent:\n  budgte: 1\n")
    with pytest.raises(config.ConfigError, match="intent.budgte: unknown key"):
        launch_server.build_argv(["--memory-config", str(p)])
