"""KV memory at its defaults recalls a fact from the start of an agent session, on the default model
(the suite's server for it runs the memory section's defaults).

A session states a fact in its first turn, then three tool outputs of about 1k tokens each fill it;
the question comes in memory mode alone. Every turn went through memory-mode requests, so no token
of the session's memory was computed at position 0: placed first, reused as it was recorded, a
line from the middle of a session is no attention sink, and reused blocks alone answered such a
question with a refusal (issue 58). The default repair (`recompute: starts`) recomputes the placed
segments' first tokens, the assembly's first one first. The reference is the same conversation as
text: the whole history in the prompt, no memory."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from sgl_memory import models

pytestmark = [pytest.mark.server, pytest.mark.default_model]

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
FACT = "The gate code of my storage unit is 5093. Please remember it."
QUESTION = "What is the gate code of my storage unit?"
CODE = "5093"


def monitor(day: int, lines: int = 30) -> str:
    """A tool's output: host readings, nothing about the fact."""
    rng = random.Random(day)
    hosts = ["alpha", "bravo", "delta", "kilo", "sierra"]
    return "\n".join(
        f"2026-03-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} "
        f"host-{rng.choice(hosts)} disk={rng.randint(10, 99)}% load={rng.random() * 4:.2f} "
        f"status={rng.choice(['ok', 'warn', 'ok', 'ok'])}"
        for _ in range(lines)
    )


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.model_dir(models.DEFAULT_MODEL))


def render(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def generate(server, ids, field, n=16):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    if field is not None:
        body["sgl_memory"] = field
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_fact_from_the_first_turn_comes_back_from_memory_at_the_defaults(qwen_server, tok):
    memory = qwen_server.get("/sgl_memory/info").json()["config"]["memory"]
    assert (memory["recompute"], memory["placement"], memory["placed_tokens"]) == ("starts", "first", 2048)
    history = [SYSTEM]
    for text in [FACT] + [f"Tool output of `monitor --day {d}`:\n{monitor(d)}" for d in range(3)]:
        out = generate(
            qwen_server,
            render(tok, [SYSTEM, {"role": "user", "content": text}]),
            {"session_id": "gate", "memory": {}},
            8,
        )
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": out["text"]}]
    asked = generate(
        qwen_server,
        render(tok, [SYSTEM, {"role": "user", "content": QUESTION}]),
        {"session_id": "gate", "memory": {"store": False}},
    )
    m = asked["meta_info"]["sgl_memory"]
    # a large placement, the fact's turn among it, repaired at a small share of a full recompute
    assert m["memory_kv_tokens"] > 1000 and 0 in m["retrieved_turns"]
    assert m["recompute_method"] == "starts" and 0 < m["recompute_share"] < 0.25
    text = generate(qwen_server, render(tok, history + [{"role": "user", "content": QUESTION}]), None)
    assert CODE in text["text"]  # the reference: the conversation as text
    assert CODE in asked["text"], asked["text"]
