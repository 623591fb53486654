"""The launcher's flag handling: our flags out, CPU defaults in, the user's own flags untouched."""

import dataclasses
import json

import pytest

from servers import TEST_MODEL
from sgl_memory import cpu_dtype, kv_pool, launch_server, models
from sgl_memory.core import config
from sgl_memory.intent.settings import IntentConfig
from sgl_memory.memart.settings import MemArtConfig
from sgl_memory.persist.settings import PersistConfig

# /proc/cpuinfo flags lines of the three kinds of CPU the project's machines have been
AMX_XEON = "fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8"
ZEN4_EPYC = "fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16"
AVX2_EPYC = "fpu sse2 fma avx avx2 bmi2"


def on_cpu(monkeypatch, capability: str, flags: str) -> None:
    monkeypatch.setattr(cpu_dtype, "cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda cpuinfo=None: set(flags.split()))


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    d = tmp_path / "m"
    d.mkdir()
    cfg = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}
    (d / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(models, "resolve", lambda name: d)
    monkeypatch.setattr(launch_server, "_has_gpu", lambda: False)
    monkeypatch.setenv(config.CONFIG_ENV, "")  # so teardown restores whatever build_argv exports
    monkeypatch.setenv(config.PLAIN_ENV, "")
    monkeypatch.setenv(cpu_dtype.CHOICE_ENV, "")
    monkeypatch.setenv(kv_pool.POOL_ENV, "")
    monkeypatch.delenv(cpu_dtype.ENV, raising=False)  # a suite run forced to one dtype sets it
    return d


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_cpu_defaults_and_our_backend(fake_model):
    argv, cfg = launch_server.build_argv([])
    assert flag_value(argv, "--model-path") == str(fake_model)
    assert flag_value(argv, "--radix-cache-backend") == "sgl_memory"
    assert flag_value(argv, "--device") == "cpu"
    assert flag_value(argv, "--attention-backend") == "sgl_memory_cpu"
    assert flag_value(argv, "--tool-call-parser") == "qwen"  # the default model is a Qwen
    assert "--disable-overlap-schedule" in argv and "--skip-server-warmup" in argv and "--sleep-on-idle" in argv
    assert flag_value(argv, "--cuda-graph-backend-decode") == "disabled"
    tokens = int(flag_value(argv, "--max-total-tokens"))
    per_token = 2 * 24 * 2 * 64 * (2 if flag_value(argv, "--dtype") == "bfloat16" else 4)
    assert kv_pool.MIN_TOKENS <= tokens <= kv_pool.MAX_DEFAULT_BYTES // per_token
    assert cfg == config.MemoryConfig()


def test_kv_bytes_per_token_of_qwen_05b(fake_model):
    # 2 (K and V) x 24 layers x 2 KV heads x 64 head dim x 2 bytes
    assert kv_pool.bytes_per_token(fake_model, "bfloat16") == 2 * 24 * 2 * 64 * 2
    assert kv_pool.bytes_per_token(fake_model, "auto") == 2 * 24 * 2 * 64 * 2  # SGLang's: the model's bf16
    assert kv_pool.bytes_per_token(fake_model, "fp8_e4m3") == 2 * 24 * 2 * 64
    # int8: a byte a value and a 2-byte scale per token and head
    assert kv_pool.bytes_per_token(fake_model, "int8") == 2 * 24 * 2 * (64 + 2)


@pytest.mark.parametrize("capability, flags, per_value", [("AVX512", AMX_XEON, 2), ("AVX2", AVX2_EPYC, 4)])
@pytest.mark.parametrize("form", [["--kv-cache-dtype", "int8"], ["--kv-cache-dtype=int8"]])
def test_an_int8_pool_is_ours_sized_with_its_scales_and_sglang_never_sees_the_value(
    fake_model, monkeypatch, capability, flags, per_value, form
):
    """SGLang's --kv-cache-dtype has no int8: the launcher takes it out of SGLang's argv (SGLang then
    holds the compute dtype, which the pool decodes to), sizes the pool at 66 bytes a head's row and
    announces int8 for the scheduler's pool-class hook. Tokens per byte: 1.94x bf16's, 3.88x float32's."""
    on_cpu(monkeypatch, capability, flags)
    argv, _ = launch_server.build_argv([*form, "--kv-pool-bytes", "1GiB"])
    assert not any(a.startswith("--kv-cache-dtype") for a in argv) and "int8" not in argv
    per_token = 2 * 24 * 2 * 66
    assert int(flag_value(argv, "--max-total-tokens")) == (1 << 30) // per_token
    pool = kv_pool.announced()
    assert (pool.kv_cache_dtype, pool.bytes_per_token) == ("int8", per_token)
    assert (1 << 30) // per_token >= 1.9 * (1 << 30) // (2 * 24 * 2 * 64 * 2)
    assert (1 << 30) // per_token >= 3.8 * (1 << 30) // (2 * 24 * 2 * 64 * 4)
    assert json.loads(launch_server.os.environ[cpu_dtype.CHOICE_ENV])["kv_cache_dtype"] == "int8"


@pytest.mark.parametrize("on_gpu, flags", [(True, []), (False, ["--attention-backend", "torch_native"])])
def test_an_int8_pool_without_our_cpu_backend_is_refused_before_start_up(
    fake_model, monkeypatch, capsys, on_gpu, flags
):
    monkeypatch.setattr(launch_server, "_has_gpu", lambda: on_gpu)
    with pytest.raises(SystemExit) as stop:
        launch_server.main(["--kv-cache-dtype", "int8", *flags])
    assert stop.value.code == 2
    assert "--kv-cache-dtype int8 is read by the CPU attention backend" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, size",
    [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5G", 1_500_000_000), ("3000000", 3_000_000), ("64 kb", 64_000)],
)
def test_pool_sizes_in_bytes(text, size):
    assert kv_pool.parse_bytes(text) == size


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0", "2 GiBs", ""])
def test_a_pool_size_that_names_no_bytes_is_refused(text):
    with pytest.raises(kv_pool.PoolSizeError, match="--kv-pool-bytes"):
        kv_pool.parse_bytes(text)


@pytest.mark.parametrize("capability, flags, per_value", [("AVX512", AMX_XEON, 2), ("AVX2", AVX2_EPYC, 4)])
def test_the_pools_bytes_hold_the_tokens_of_its_kv_dtype(fake_model, monkeypatch, capability, flags, per_value):
    """--kv-pool-bytes becomes SGLang's token count at the KV dtype the launcher picked; the choice
    is what /sgl_memory/info and the start-up log report."""
    on_cpu(monkeypatch, capability, flags)
    argv, _ = launch_server.build_argv(["--kv-pool-bytes", "1GiB"])
    per_token = 2 * 24 * 2 * 64 * per_value
    assert int(flag_value(argv, "--max-total-tokens")) == (1 << 30) // per_token
    assert "--kv-pool-bytes" not in argv  # ours, not SGLang's
    pool = kv_pool.announced()
    assert (pool.tokens, pool.bytes_per_token, pool.source) == ((1 << 30) // per_token, per_token, "--kv-pool-bytes")
    assert pool.bytes == pool.tokens * per_token <= 1 << 30
    assert f"{pool.tokens:,} tokens" in pool.log_line()


def test_the_users_token_count_wins_over_bytes(fake_model):
    argv, _ = launch_server.build_argv(["--kv-pool-bytes=1GiB", "--max-total-tokens", "4096"])
    assert flag_value(argv, "--max-total-tokens") == "4096" and argv.count("--max-total-tokens") == 1
    pool = kv_pool.announced()
    assert (pool.tokens, pool.source) == (4096, "--max-total-tokens")


def test_a_bad_pool_size_stops_start_up_with_a_message(fake_model, capsys):
    with pytest.raises(SystemExit) as stop:
        launch_server.main(["--kv-pool-bytes", "lots"])
    assert stop.value.code == 2
    assert "--kv-pool-bytes 'lots'" in capsys.readouterr().err


def test_the_default_pool_is_a_share_of_free_ram_within_its_bounds():
    per_token = 24_576
    assert kv_pool.default_bytes(per_token, available=8 << 30) == int((8 << 30) * kv_pool.RAM_FRACTION)
    assert kv_pool.default_bytes(per_token, available=64 << 30) == kv_pool.MAX_DEFAULT_BYTES  # a big machine
    assert kv_pool.default_bytes(per_token, available=1 << 20) == kv_pool.MIN_TOKENS * per_token  # a tiny one


def test_on_a_gpu_sglang_sizes_the_pool_unless_told_the_bytes(fake_model, monkeypatch):
    monkeypatch.setattr(launch_server, "_has_gpu", lambda: True)
    argv, _ = launch_server.build_argv([])
    assert "--max-total-tokens" not in argv and kv_pool.announced() is None
    argv, _ = launch_server.build_argv(["--kv-pool-bytes", "1GiB", "--kv-cache-dtype", "fp8_e4m3"])
    assert int(flag_value(argv, "--max-total-tokens")) == (1 << 30) // (2 * 24 * 2 * 64)  # one byte a value


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
    p.write_text(config.to_yaml(IntentConfig(budget=99)))
    _, cfg = launch_server.build_argv(["--memory-config", str(p)])
    assert cfg.of(IntentConfig).budget == 99
    import os

    assert config.from_env() == cfg and os.environ[config.CONFIG_ENV] == str(p.resolve())
    assert "--memory-config" not in launch_server.build_argv(["--memory-config", str(p)])[0]


def test_the_default_is_agent_ready_and_plain_turns_every_mechanism_off(fake_model):
    """No config: every section's defaults, persistence on (sessions stored, tiers by next use), the
    rest off. `--plain`: every section off, in the launcher and in SGLang's processes alike."""
    _, cfg = launch_server.build_argv([])
    assert [name for name, s in cfg.sections.items() if s.enabled] == ["persist"]
    assert cfg.of(PersistConfig).eviction == "hints" and config.from_env() == cfg
    _, plain = launch_server.build_argv(["--plain"])
    assert not any(s.enabled for s in plain.sections.values())
    assert config.from_env() == plain
    # the rest of each section is its default: only the switch differs
    assert plain.of(PersistConfig) == dataclasses.replace(cfg.of(PersistConfig), enabled=False)
    _, again = launch_server.build_argv([])  # a later launch in this process inherits no --plain
    assert config.from_env() == again == cfg


def test_plain_takes_no_memory_config(fake_model, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(config.to_yaml(IntentConfig(enabled=True)))
    with pytest.raises(launch_server.LaunchError, match="--plain"):
        launch_server.build_argv(["--plain", "--memory-config", str(p)])


def test_the_default_store_is_in_the_users_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert PersistConfig().store_dir() == tmp_path / "xdg" / "sgl-memory" / "sessions"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert PersistConfig().store_dir() == tmp_path / "home" / ".cache" / "sgl-memory" / "sessions"
    assert PersistConfig(dir="~/s").store_dir() == tmp_path / "home" / "s"


def test_a_process_keeps_the_config_it_started_with_when_the_file_changes(tmp_path, monkeypatch):
    """Every process reads the file once: rewritten while the server runs (another run's config in
    the same place), it changes nothing until a restart."""
    p = tmp_path / "c.yaml"
    p.write_text(config.to_yaml(MemArtConfig(enabled=True)))
    monkeypatch.setenv(config.CONFIG_ENV, str(p))
    assert config.from_env().of(MemArtConfig).enabled
    p.write_text(config.to_yaml(MemArtConfig(enabled=False)))
    assert config.from_env().of(MemArtConfig).enabled and not config.load(p).of(MemArtConfig).enabled


def test_unknown_config_key_is_refused(fake_model, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("intent:\n  budgte: 1\n")
    with pytest.raises(config.ConfigError, match="intent.budgte: unknown key"):
        launch_server.build_argv(["--memory-config", str(p)])


@pytest.mark.parametrize(
    "capability, flags, expected",
    [
        ("AVX512", AMX_XEON, "bfloat16"),  # the platform facts' Intel machine: AMX
        ("AVX512", ZEN4_EPYC, "bfloat16"),  # AVX512-BF16 without AMX
        ("AVX2", AVX2_EPYC, "float32"),  # the EPYC: no bf16 in hardware
        ("AVX2", ZEN4_EPYC, "float32"),  # bf16 flags, but torch limited to AVX2 kernels (ATEN_CPU_CAPABILITY)
        ("DEFAULT", "fpu sse2", "float32"),
    ],
)
def test_the_launcher_picks_the_dtype_the_cpu_multiplies_in_hardware(
    fake_model, monkeypatch, capability, flags, expected
):
    on_cpu(monkeypatch, capability, flags)
    argv, _ = launch_server.build_argv([])
    assert flag_value(argv, "--dtype") == expected and argv.count("--dtype") == 1
    choice = cpu_dtype.announced()  # what /sgl_memory/info and the start-up log report
    assert (choice.dtype, choice.kv_cache_dtype, choice.source, choice.cpu_capability) == (
        expected,
        expected,
        "auto",
        capability,
    )
    assert capability in choice.reason and ("hardware" in choice.reason) == (expected == "bfloat16")
    assert choice.bf16_flags == sorted(f for f in ("amx_bf16", "avx512_bf16") if f in flags.split())


def test_a_float32_pool_is_sized_at_four_bytes_a_value(fake_model, monkeypatch):
    """The KV pool's share of RAM holds half as many float32 tokens as bf16 ones."""
    monkeypatch.setattr(kv_pool, "MAX_DEFAULT_BYTES", 1 << 50)  # no cap: see the ratio itself
    monkeypatch.setattr(kv_pool, "MIN_TOKENS", 1)
    import psutil

    free = psutil.virtual_memory().available
    tokens = {}
    for capability, flags in (("AVX512", AMX_XEON), ("AVX2", AVX2_EPYC)):
        on_cpu(monkeypatch, capability, flags)
        argv, _ = launch_server.build_argv([])
        tokens[flag_value(argv, "--dtype")] = int(flag_value(argv, "--max-total-tokens"))
    per_token = {"bfloat16": 2 * 24 * 2 * 64 * 2, "float32": 2 * 24 * 2 * 64 * 4}
    for dtype, n in tokens.items():  # free memory moves a little between the two calls
        assert n == pytest.approx(free * kv_pool.RAM_FRACTION / per_token[dtype], rel=0.05)
    assert kv_pool.bytes_per_token(fake_model, "float32") == per_token["float32"]


def test_the_users_dtype_wins_and_is_reported_as_given(fake_model, monkeypatch):
    on_cpu(monkeypatch, "AVX2", AVX2_EPYC)
    argv, _ = launch_server.build_argv(["--dtype=bfloat16"])
    assert "--dtype=bfloat16" in argv and "--dtype" not in argv
    choice = cpu_dtype.announced()
    assert (choice.dtype, choice.source) == ("bfloat16", "--dtype")
    argv, _ = launch_server.build_argv(["--dtype", "float32", "--kv-cache-dtype", "bfloat16"])
    assert argv.count("--dtype") == 1
    choice = cpu_dtype.announced()
    assert (choice.dtype, choice.kv_cache_dtype) == ("float32", "bfloat16")
    assert kv_pool.announced().bytes_per_token == 2 * 24 * 2 * 64 * 2  # sized for the bf16 pool asked for


def test_the_environment_forces_a_dtype_and_a_bad_one_stops_start_up(fake_model, monkeypatch, capsys):
    on_cpu(monkeypatch, "AVX512", AMX_XEON)
    monkeypatch.setenv(cpu_dtype.ENV, "fp32")
    argv, _ = launch_server.build_argv([])
    assert flag_value(argv, "--dtype") == "float32" and cpu_dtype.announced().source == cpu_dtype.ENV
    monkeypatch.setenv(cpu_dtype.ENV, "auto")
    assert flag_value(launch_server.build_argv([])[0], "--dtype") == "bfloat16"
    monkeypatch.setenv(cpu_dtype.ENV, "float64")
    with pytest.raises(SystemExit) as stop:
        launch_server.main([])
    assert stop.value.code == 2
    assert "SGLMEMORY_DTYPE='float64': allowed values are auto, bf16, bfloat16" in capsys.readouterr().err


def test_a_gpu_server_leaves_the_dtype_to_sglang(fake_model, monkeypatch):
    monkeypatch.setattr(launch_server, "_has_gpu", lambda: True)
    monkeypatch.setenv(cpu_dtype.CHOICE_ENV, '{"stale": 1}')  # inherited from a CPU launcher
    argv, _ = launch_server.build_argv([])
    assert "--dtype" not in argv and cpu_dtype.announced() is None


def test_cpu_flags_are_read_from_cpuinfo():
    cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n"
    assert cpu_dtype.cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_dtype.cpu_flags("processor\t: 0\nFeatures\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}  # Arm
    assert cpu_dtype.cpu_flags("") == set()


def test_a_page_size_an_enabled_mechanism_cannot_serve_stops_the_launcher_before_start_up(tmp_path):
    """The launcher checks the page size SGLang resolved against the enabled mechanisms before it
    starts any process: exit status 2 and the mechanism's reason, no server."""
    import subprocess
    import sys

    (tmp_path / "intent.yaml").write_text(config.to_yaml(IntentConfig(enabled=True)))
    cmd = [
        sys.executable,
        "-m",
        "sgl_memory.launch_server",
        "--model",
        TEST_MODEL,
        "--memory-config",
        str(tmp_path / "intent.yaml"),
        "--page-size",
        "16",
        "--port",
        "1",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: intent needs page size 1 (got 16): it points single pruned positions" in done.stderr
    assert "Load weight" not in done.stderr  # nothing started


@pytest.mark.parametrize(
    "tp, cores, want",
    [
        (2, [0, 1], "0|1"),
        (2, list(range(8)), "0-3|4-7"),
        (2, [0, 1, 2, 5, 6, 7], "0-2|5-7"),
        (2, [0, 2, 4, 6, 7], "0,2|4,6"),
    ],
)
def test_tensor_parallel_ranks_get_an_equal_share_of_the_cores(fake_model, monkeypatch, tp, cores, want):
    """SGLang's CPU engine asks for one NUMA node per rank unless told which cores each rank takes."""
    monkeypatch.setenv(launch_server.THREADS_BIND_ENV, "")
    monkeypatch.setattr(launch_server.os, "sched_getaffinity", lambda pid: set(cores))
    launch_server.build_argv(["--tp-size", str(tp)])
    assert launch_server.os.environ[launch_server.THREADS_BIND_ENV] == want
    monkeypatch.setenv(launch_server.THREADS_BIND_ENV, "0-1|2-3")  # the user's own wins
    launch_server.build_argv(["--tp-size", str(tp)])
    assert launch_server.os.environ[launch_server.THREADS_BIND_ENV] == "0-1|2-3"


def test_more_ranks_than_cores_is_refused(fake_model, monkeypatch):
    monkeypatch.setenv(launch_server.THREADS_BIND_ENV, "")
    monkeypatch.setattr(launch_server.os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(launch_server.LaunchError, match="a CPU core per rank"):
        launch_server.build_argv(["--tp-size", "4"])
