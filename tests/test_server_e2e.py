"""End to end against the real SGLang server started through our launcher (SmolLM2-135M): the
suite's `plain` server (no memory config, the README's default way: persistence on), the float32 server's choice
of dtype on an AVX2-only CPU, and how every server the suite stopped went."""

from __future__ import annotations

import json

import pytest
import requests

import subprocess
import sys

from servers import SERVER_DTYPE, TEST_MODEL
from test_persist_server import session_file
from sgl_memory import models

pytestmark = pytest.mark.server

GREEDY = {"temperature": 0, "max_new_tokens": 12}


def test_backend_in_use_is_ours(plain_server):
    log = plain_server.log()
    assert "Tree cache initialized: source=registered('sgl_memory') impl=SglMemoryRadixCache" in log
    info = plain_server.get("/sgl_memory/info").json()
    assert info["radix_cache_backend"] == "sgl_memory"
    assert info["attention_backend"] == "sgl_memory_cpu"
    assert info["config"]["intent"]["enabled"] is False


def test_native_generate(plain_server):
    r = plain_server.post("/generate", {"text": "The capital of France is", "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["completion_tokens"] == 12
    assert "Paris" in out["text"]


def test_openai_chat(plain_server):
    r = plain_server.post(
        "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and "Paris" in msg["content"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def ask_weather_tool(plain_server) -> dict:
    r = plain_server.post(
        "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "What is the weather in Paris right now?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "max_tokens": 64,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert len(calls) >= 1 and calls[0]["function"]["name"] == "get_weather"
    return calls[0]


def test_tool_call_required_gives_tool_calls_with_json_arguments(plain_server):
    # The 135M model fills the arguments with a bare JSON value; the default model's test checks
    # that a capable model fills the schema (tests/test_default_model.py).
    call = ask_weather_tool(plain_server)
    json.loads(call["function"]["arguments"])


def test_same_long_prompt_twice_hits_the_radix_cache(plain_server):
    prompt = "Here is a list of facts about the solar system. " + " ".join(
        f"Fact {i}: planet number {i % 8} has {i * 7 % 13} moons." for i in range(60)
    )
    first = plain_server.post("/generate", {"text": prompt, "sampling_params": GREEDY}).json()
    second = plain_server.post("/generate", {"text": prompt, "sampling_params": GREEDY}).json()
    n = first["meta_info"]["prompt_tokens"]
    assert n > 500
    assert first["meta_info"]["cached_tokens"] < n // 2
    assert second["meta_info"]["cached_tokens"] >= n - 1  # all but the last token is reused
    assert second["text"] == first["text"]


def test_a_growing_chat_is_tokenized_as_the_template_does(plain_server):
    """A full-history client's turns: the server encodes earlier messages from its segment cache
    (engine/prompt_encode.py); the prompt ids are those of the chat template's own tokenization,
    including text that spells a special token and a tool result."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))
    messages = [{"role": "system", "content": "You are terse. <|im_start|> is a token; so is <|endoftext|>."}]
    for n in range(3):
        messages.append({"role": "user", "content": f"Step {n}: ünïcode, code `f(x) = {n}*x`\n\n  and trailing space "})
        r = plain_server.post(
            "/v1/chat/completions",
            {
                "model": "default",
                "messages": messages,
                "max_tokens": 1,
                "temperature": 0,
                "return_prompt_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert r.json()["choices"][0]["prompt_token_ids"] == expected
        messages.append({"role": "assistant", "content": f"Done {n}."})


def test_session_continues_from_previous_turn(plain_server):
    sid = plain_server.post("/open_session", {"capacity_of_str_len": 20000}).json()
    turn1 = plain_server.post(
        "/generate",
        {"text": "My name is Bob and I live in Lisbon. " * 8, "session_params": {"id": sid}, "sampling_params": GREEDY},
    ).json()
    turn2 = plain_server.post(
        "/generate",
        {
            "text": " What is my name?",
            "session_params": {"id": sid, "rid": turn1["meta_info"]["id"]},
            "sampling_params": GREEDY,
        },
    ).json()
    # turn 2's prompt is turn 1's prompt + answer + the new text, and reuses turn 1's KV
    assert (
        turn2["meta_info"]["prompt_tokens"]
        > turn1["meta_info"]["prompt_tokens"] + turn1["meta_info"]["completion_tokens"]
    )
    assert turn2["meta_info"]["cached_tokens"] >= turn1["meta_info"]["prompt_tokens"]
    assert plain_server.post("/close_session", {"session_id": sid}).status_code == 200


def test_top_level_session_id_is_accepted(plain_server):
    r = plain_server.post("/generate", {"text": "Hello", "session_id": "agent-7", "sampling_params": GREEDY})
    assert r.status_code == 200, r.text


def test_bad_request_is_a_4xx_and_server_keeps_serving(plain_server):
    r = plain_server.post("/v1/chat/completions", {"model": "default", "messages": "not a list"})
    assert 400 <= r.status_code < 500
    assert plain_server.post("/generate", {"text": "Hi", "sampling_params": GREEDY}).status_code == 200


def test_the_default_serves_agent_sessions_with_persistence(plain_server):
    """No memory config: the banner says session persistence is on by default and where its store
    is (the user's cache directory: the pool gives each server an XDG_CACHE_HOME of its own). A
    session named by the x-session-id header alone is stored there, and its next turn, after its KV
    left the pool, is restored from the warm tier and prefills only its new tokens."""
    banner = next(line for line in plain_server.log().splitlines() if "sgl-memory: serving" in line)
    store = plain_server.dir / "cache" / "sgl-memory" / "sessions"
    assert "mechanisms: persist (the default; --plain serves without);" in banner and banner.endswith(f"store {store}")

    def turn(messages):
        r = requests.post(
            plain_server.url + "/v1/chat/completions",
            headers={"x-session-id": "default-agent"},
            json={"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0},
            timeout=600,
        )
        assert r.status_code == 200, r.text
        return r.json()

    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "My locker code is 4417. " * 16 + "Say OK."},
    ]
    first = turn(messages)
    assert first["sgl_memory"]["text_match"] is None  # a new session, seen by persistence
    assert plain_server.post("/flush_cache?timeout=60", {}).status_code == 200  # its KV leaves the pool
    assert session_file(store, "default-agent").exists()  # the turn's file, written before the flush
    messages += [first["choices"][0]["message"], {"role": "user", "content": "What is my locker code?"}]
    second = turn(messages)
    restored, prompt = second["sgl_memory"]["restored_tokens"], first["usage"]["prompt_tokens"]
    assert (
        second["sgl_memory"]["text_match"] in ("exact", "extend") and second["sgl_memory"]["restored_from"] == "memory"
    )
    assert restored >= prompt and second["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt


def test_bad_memory_config_stops_startup_with_a_message(tmp_path):
    """The launcher refuses the config before SGLang starts: no server comes up, the message names the key."""
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("intent:\n  scorer: magic\n")
    run = subprocess.run(
        [sys.executable, "-m", "sgl_memory.launch_server", "--model", TEST_MODEL, "--memory-config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert "intent.scorer: 'magic' is not allowed; allowed values: memory" in run.stderr + run.stdout


def test_the_server_reports_the_dtype_it_runs_in(plain_server):
    """/sgl_memory/info and the start-up log name the launcher's choice, and SGLang runs in it."""
    info = plain_server.get("/sgl_memory/info").json()["dtype"]
    assert info["dtype"] == SERVER_DTYPE and info["kv_cache_dtype"] == SERVER_DTYPE and info["reason"]
    assert plain_server.get("/server_info").json()["dtype"] == SERVER_DTYPE
    assert (
        f"sgl-memory: compute dtype {SERVER_DTYPE}, KV cache {SERVER_DTYPE} ({info['source']}: " in plain_server.log()
    )


def test_the_server_reports_its_kv_pool_in_bytes_and_tokens(plain_server):
    """/sgl_memory/info and the start-up log say the pool the launcher asked for; SGLang's own count
    of its pool (/server_info) is those tokens, and a token costs what the model's config says at
    the server's dtype. The pool's servers pass --max-total-tokens, which wins over bytes."""
    pool = plain_server.get("/sgl_memory/info").json()["kv_pool"]
    assert pool["tokens"] == plain_server.get("/server_info").json()["max_total_num_tokens"]
    cfg = json.loads((models.model_dir(TEST_MODEL) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    value = {"bfloat16": 2, "float32": 4}[SERVER_DTYPE]
    assert pool["bytes_per_token"] == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * value
    assert (pool["bytes"], pool["kv_cache_dtype"], pool["source"]) == (
        pool["tokens"] * pool["bytes_per_token"],
        SERVER_DTYPE,
        "--max-total-tokens",
    )
    assert f"= {pool['tokens']:,} tokens at {SERVER_DTYPE}" in plain_server.log()


def test_a_cpu_without_bf16_hardware_serves_in_float32_by_itself(fp32_server):
    """An AVX2-only CPU, as torch and oneDNN see one when told to use no more (ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA: the suite's float32 server runs so, without --dtype). The reference for
    "computes in float32": transformers' forward of the same tokens in float32 and in bf16; the
    server's log-probabilities sit at the float32 one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    srv = fp32_server
    prompt = AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL)).encode("The capital of France is")
    info = srv.get("/sgl_memory/info").json()["dtype"]
    assert (info["dtype"], info["kv_cache_dtype"], info["source"], info["cpu_capability"]) == (
        "float32",
        "float32",
        "auto",
        "AVX2",
    )
    assert "bf16 would convert through float32" in info["reason"]
    assert "sgl-memory: compute dtype float32, KV cache float32 (auto: " in srv.log()
    assert srv.get("/server_info").json()["dtype"] == "float32"
    body = {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True}
    out = srv.post("/generate", body).json()
    assert "Paris" in out["text"]
    got = torch.tensor([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    tokens = torch.tensor([prompt + [t for _, t, *_ in out["meta_info"]["output_token_logprobs"]]])
    err = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(models.model_dir(TEST_MODEL), dtype=dtype).eval()
        with torch.no_grad():
            logits = model(tokens).logits[0, len(prompt) - 1 : -1].double()
        want = logits.log_softmax(-1).gather(-1, tokens[0, len(prompt) :, None])[:, 0]
        err[dtype] = float((got - want).abs().max())
    assert err[torch.float32] < 2e-3 and err[torch.float32] < err[torch.bfloat16] / 4, err


@pytest.mark.server(ends="*")
def test_every_server_the_suite_started_stopped_with_no_process_left(pool):
    """A SIGTERM after serving stops every process of a server: checked on every server the suite
    started, as the pool stopped it (this test runs last, after the last of them)."""
    if not pool.starts:
        pytest.skip("no server was started in this run")
    assert not pool.live, f"servers still up: {sorted(pool.live)}"
    assert pool.left_alive == [], f"processes left after SIGTERM (then killed): {pool.left_alive}"
