"""Intent pruning, session persistence and KV memory together in one real server (SmolLM2-135M,
bfloat16 pool, bf16 session store).

One agent session of 40 turns: each turn brings a tool observation and a question, and the client
resends its whole history (full-history turns), which intent prunes to a small budget (the
observations are history it may drop; the question is the turn's actionable span), persistence
writes after every turn and KV memory records; at turn 20 the server restarts; at turn 40 a
memory-mode request asks about turn 1.

The reference for the restart is the same server that never restarted: server A runs turns 1-20,
its store is copied once turn 20 is written (the file then holds turn 20's pruned path, its live
mask, the QueryMemory and the memory pool), A answers turn 21, and server B, started on the copy,
answers turn 21 again. A bf16 store of a bf16 pool restores bit-identical KV and the QueryMemory and
the pool are stored exactly, so B must prune the same positions and answer the same greedy tokens.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import TEST_MODEL, start_server, stop_server
from sgl_memory import models

pytestmark = pytest.mark.server

BF16 = ("--dtype", "bfloat16")
BUDGET = 96
FACT = "My locker code is 4812."
SYSTEM = {"role": "system", "content": "You are a brief assistant."}
TOPICS = ["rivers", "owls", "copper", "tea", "glaciers", "violins", "bees", "comets", "salt", "maple trees",
          "otters", "granite", "kites", "lighthouses", "penguins", "volcanoes", "paper", "wolves", "coral",
          "bridges", "clocks", "deserts", "honey", "tigers", "rain", "glass", "moss", "trains", "whales",
          "cotton", "lakes", "pepper", "rockets", "sand", "bats", "ink", "tulips", "caves"]  # fmt: skip
TURNS = [f"{FACT} Please remember it."] + [f"Tell me one short fact about {t}." for t in TOPICS]  # turns 1..39


def observation(turn: int) -> dict:
    readings = ", ".join(f"sensor {j} read {(turn * 37 + j * 11) % 100}" for j in range(6))
    return {"role": "user", "content": f"Tool output {turn}: {readings}."}


def write_config(d: Path, store: Path) -> Path:
    path = d / "memory.yaml"
    path.write_text(f"""
intent:
  enabled: true
  budget: {BUDGET}
  query_tail: 16
persist:
  enabled: true
  dir: {store}
  quant: bf16
memory:
  enabled: true
  block_size: 16
  top_k: 8
""")
    return path


def chat(server, messages, max_tokens=12, **memory):
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "sgl_memory": {"session_id": "agent", **memory}}  # fmt: skip
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"], out["sgl_memory"]


def next_turn(messages, text) -> list[dict]:
    """The request of the next turn: after the first, a tool observation comes before the question."""
    return messages + ([observation(len(messages))] if len(messages) > 1 else []) + [{"role": "user", "content": text}]


def run(server, messages, turns):
    """Full-history turns; appends to messages; returns [(answer, usage, metrics)]."""
    results = []
    for text in turns:
        messages[:] = next_turn(messages, text)
        answer, usage, metrics = chat(server, messages)
        messages.append({"role": "assistant", "content": answer})
        results.append((answer, usage, metrics))
    return results


def wait_written(store: Path, turns: int, timeout: float = 120) -> Path:
    """The session's file once its writer has stored `turns` turns of QueryMemory."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for path in store.glob("*/*/*.safetensors"):
            try:
                with safe_open(str(path), "pt") as f:
                    if "s.intent.updates" in f.keys() and int(f.get_tensor("s.intent.updates")[0]) >= turns:
                        return path
            except Exception:  # replaced while we read it
                pass
        time.sleep(0.5)
    raise AssertionError(f"the session file did not reach {turns} turns")


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    d = tmp_path_factory.mktemp("composed")
    store, snapshot = d / "store", d / "snapshot"
    a = start_server(TEST_MODEL, d / "a.log", "--memory-config", str(write_config(d, store)), *BF16)
    try:
        messages = [SYSTEM]
        first = run(a, messages, TURNS[:20])
        stored = wait_written(store, 20)
        shutil.copytree(store, snapshot)
        at_21 = run(a, list(messages), TURNS[20:21])[0]  # the server that never restarted
    finally:
        stop_server(a)
    b = start_server(TEST_MODEL, d / "b.log", "--memory-config", str(write_config(d, snapshot)), *BF16)
    yield b, messages, first, at_21, stored
    stop_server(b)


def test_the_session_is_pruned_to_its_budget_every_turn(session):
    _, _, first, _, _ = session
    pruned = [m for _, _, m in first if m["compression_events"]]
    assert len(pruned) >= 10, "the history must outgrow the budget"
    for _, usage, m in first:
        assert m["live_kv_tokens"] <= max(BUDGET, m["budget"]) + usage["completion_tokens"]
    # full-history turns reuse the pruned path: only the new turn is prefilled
    late = first[-1][1]
    assert late["prompt_tokens_details"]["cached_tokens"] > late["prompt_tokens"] // 2


def test_the_stored_session_holds_the_pruned_path_its_live_mask_and_the_other_mechanisms_state(session):
    _, _, _, _, stored = session
    with safe_open(str(stored), "pt") as f:
        names = set(f.keys())
        live = f.get_tensor("live")
        meta = f.metadata()
    assert {"s.intent.query_memory", "s.memory.keys", "s.memory.values", "s.memory.tokens"} <= names
    assert live.numel() == int(meta["tokens"]) and 0 < int(live.sum()) < live.numel()
    assert meta["branch"] != "null"


def test_the_turn_after_a_restart_equals_the_turn_on_a_server_that_never_restarted(session):
    b, messages, _, at_21, _ = session
    answer, usage, metrics = chat(b, next_turn(messages, TURNS[20]))
    ref_answer, ref_usage, ref = at_21
    assert metrics["restored_from"] == "disk" and metrics["restored_tokens"] > 0, metrics
    # the pruned path came back with its dead positions: the same prefix is reused, the same
    # number of positions is pruned, from a QueryMemory of the same 21 turns, with the same pool
    assert usage["prompt_tokens_details"]["cached_tokens"] == ref_usage["prompt_tokens_details"]["cached_tokens"]
    assert metrics["query_memory_turns"] == ref["query_memory_turns"] == 21
    assert metrics["freed_slots"] == ref["freed_slots"] and metrics["live_kv_tokens"] == ref["live_kv_tokens"]
    assert metrics["memory_blocks"] == ref["memory_blocks"] > 0
    assert answer == ref_answer


def test_a_fact_from_turn_1_is_recalled_as_kv_at_turn_40_after_the_restart(session):
    b, messages, _, _, _ = session
    from transformers import AutoTokenizer

    messages = next_turn(messages, TURNS[20])
    messages.append({"role": "assistant", "content": chat(b, messages)[0]})
    run(b, messages, TURNS[21:])  # turns 22-39
    assert len(messages) == 1 + 2 * 39 + 38
    answer, usage, metrics = chat(b, [SYSTEM, {"role": "user", "content": "What is my locker code?"}], memory={})
    # turn 1 is the pool's first turn (its whole first request): the fact's tokens must be placed
    tokenizer = AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))
    text = tokenizer.apply_chat_template([SYSTEM, {"role": "user", "content": TURNS[0]}], tokenize=False)
    turn_1 = tokenizer.encode(text, add_special_tokens=False)
    code = tokenizer.encode(" 4812", add_special_tokens=False)
    at = next(i for i in range(len(turn_1)) if turn_1[i : i + len(code)] == code)
    assert any(turn == 0 and offset <= at < offset + n for turn, offset, n in metrics["retrieved_spans"]), metrics
    # all three mechanisms report in one object
    assert metrics["retrieved_blocks"] > 0 and metrics["budget"] == BUDGET and "persist_error" in metrics
    assert usage["prompt_tokens_details"]["cached_tokens"] >= metrics["memory_kv_tokens"]


@pytest.mark.parametrize("who", [{"tenant": "other"}, {"session_id": "agent-2"}])
def test_another_tenant_or_session_gets_nothing_of_the_session_with_all_three_on(session, who):
    """The same prompts under another tenant, or another session id: no restored path, no recalled
    block, a QueryMemory of its own, a memory pool of its own."""
    b, messages, _, _, _ = session
    _, _, first = chat(b, messages[:2], **who)
    assert first["restored_tokens"] == 0 and first["text_match"] is None
    assert first["query_memory_turns"] == 1
    _, _, recall = chat(b, [SYSTEM, {"role": "user", "content": "What is my locker code?"}], memory={}, **who)
    # its pool holds only its own first turn (about 45 tokens; the session's holds 39 turns)
    assert recall["retrieved_turns"] == [0] and recall["memory_blocks"] <= 4
    assert recall["query_memory_turns"] == 2
