"""Smoke test of the embedded default model (Qwen2.5-Coder-0.5B-Instruct) in our server."""

from __future__ import annotations

import json

import pytest

from test_server_e2e import ask_weather_tool

pytestmark = [pytest.mark.server, pytest.mark.default_model]


@pytest.fixture(scope="module")
def qwen(qwen_server):
    """The suite's default-model server (its intent, memory and persistence act on no request here:
    none names a session or exceeds intent's budget)."""
    return qwen_server


def test_answers_a_factual_question(qwen):
    r = qwen.post(
        "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "What is the capital of Japan? Answer in one word."}],
            "max_tokens": 16,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    assert "tokyo" in r.json()["choices"][0]["message"]["content"].lower()


def test_required_tool_call_fills_the_schema(qwen):
    call = ask_weather_tool(qwen)
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args, dict) and "paris" in args.get("city", "").lower()


def test_launcher_chose_the_qwen_tool_parser_and_the_start_up_is_clean(qwen):
    log = qwen.log()
    assert "--tool-call-parser qwen " in log and "The tool_call_parser" not in log  # not a deprecated name
    # a normal start: no traceback (SGLang's freeze_gc under --skip-server-warmup), no warnings of
    # GPU-only modules, no stacked-hook warning; one banner line names what is served, before ready
    for noise in ("Traceback", "freeze_gc failed", "Only CUDA", "Multiple AROUND hooks", "Ignore import error"):
        assert noise not in log, noise
    banner = next(line for line in log.splitlines() if "sgl-memory: serving" in line)
    assert "qwen2.5-coder-0.5b-instruct" in banner and " at http://" in banner and "mechanisms:" in banner
    assert log.index("sgl-memory: serving") < log.index("ready to roll")


TOUCH = {
    "type": "function",
    "function": {
        "name": "touch",
        "description": "Create an empty file in the current directory.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"file_name": {"type": "string"}},
            "required": ["file_name"],
            "additionalProperties": False,
        },
    },
}


def test_a_strict_tool_schema_constrains_the_arguments(qwen):
    """Without `strict` SGLang constrains only a call's framing and name (the default model once
    gave `touch` the arguments ["a.txt", "b"]); with it, the arguments follow the schema."""
    r = qwen.post(
        "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "Create the files a.txt and b.txt."}],
            "tools": [TOUCH],
            "tool_choice": "required",
            "max_tokens": 64,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "touch" for c in calls)
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        assert isinstance(args, dict) and set(args) == {"file_name"} and isinstance(args["file_name"], str), args
