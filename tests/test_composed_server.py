"""Intent pruning, session persistence and KV memory together in one real server (SmolLM2-135M,
the pool in the dtype the launcher picks for this CPU, the session store in that same dtype): all
three with SentenceKV's decode-time reads on too, and the pairs with persistence.

The suite's `all` server runs every mechanism; a case chooses per request what it leaves out: a
case without intent asks for no budget (the server's is above every prompt: nothing is pruned),
one without SentenceKV turns it off (`sentencekv.enabled: false`). KV memory records every case's
turns (what a full-history request carries is recorded on a server with memory on); the memory
checks run for the cases with memory. Each case is a tenant of its own.

All three: one agent session of 24 turns: each turn brings a tool observation and a question, and the client
resends its whole history (full-history turns), which intent prunes to a small budget (the
observations are history it may drop; the question is the turn's actionable span), persistence
writes after every turn and KV memory records; at turn 12 the server restarts; at turn 24 a
memory-mode request asks about turn 1.

The reference for the restart is the same server that never restarted: server A runs turns 1-12,
the session's file is copied once turn 12 is written (the file then holds turn 12's pruned path,
its live mask, the QueryMemory and the memory pool) into the store of server B (a second server
like A that never saw the session), A answers turn 13, and B answers turn 13 again, restoring the
session from the file. A store in the pool's dtype restores bit-identical KV and the QueryMemory and
the pool are stored exactly, so B must prune the same positions and answer the same greedy tokens.
Each pair runs the same session for 8 turns, restarting at turn 4.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors import safe_open

from servers import TEST_MODEL
from sgl_memory import models
from sgl_memory.persist.layout import digest

pytestmark = pytest.mark.server

BUDGET = 96
SKV_BUDGET, SKV_ALWAYS = 32, 4 + 32  # SentenceKV's budget; its sinks and recent rows (the defaults)
FACT = "My locker code is 4812."
SYSTEM = {"role": "system", "content": "You are a brief assistant."}
TOPICS = [
    "rivers",
    "owls",
    "copper",
    "tea",
    "glaciers",
    "violins",
    "bees",
    "comets",
    "salt",
    "maple trees",
    "otters",
    "granite",
    "kites",
    "lighthouses",
    "penguins",
    "volcanoes",
    "paper",
    "wolves",
    "coral",
    "bridges",
    "clocks",
    "deserts",
    "honey",
    "tigers",
    "rain",
    "glass",
    "moss",
    "trains",
    "whales",
    "cotton",
    "lakes",
    "pepper",
    "rockets",
    "sand",
    "bats",
    "ink",
    "tulips",
    "caves",
]
TURNS = [f"{FACT} Please remember it."] + [f"Tell me one short fact about {t}." for t in TOPICS]  # turns 1..39


def observation(turn: int) -> dict:
    readings = ", ".join(f"sensor {j} read {(turn * 37 + j * 11) % 100}" for j in range(6))
    return {"role": "user", "content": f"Tool output {turn}: {readings}."}


@dataclass(frozen=True)
class Case:
    mechanisms: tuple[str, ...]
    turns: int  # full-history turns before the memory-mode question
    restart: int  # the turn after which the server restarts

    def has(self, name: str) -> bool:
        return name in self.mechanisms

    @property
    def tenant(self) -> str:
        return "composed-" + "-".join(self.mechanisms)


CASES = {
    "all": Case(("intent", "persist", "memory", "sentencekv"), 23, 12),  # the history outgrows the budget by turn 3
    "intent+persist": Case(("intent", "persist"), 8, 4),
    "memory+persist": Case(("persist", "memory"), 8, 4),
}


def fields(case: Case) -> dict:
    """What a request of the case asks for besides its session: the mechanisms it leaves out, off."""
    out = {"budget": BUDGET} if case.has("intent") else {}
    # a decode step reads the sinks and recent rows, and sentences of at most 32 tokens of the rest
    out["sentencekv"] = {"budget": SKV_BUDGET} if case.has("sentencekv") else {"enabled": False}
    return out


def chat(server, case: Case, messages, max_tokens=6, **memory):
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "sgl_memory": {"session_id": "agent", "tenant": case.tenant, **fields(case), **memory},
    }
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"]["content"], out["usage"], out["sgl_memory"]


def next_turn(messages, text) -> list[dict]:
    """The request of the next turn: after the first, a tool observation comes before the question."""
    return messages + ([observation(len(messages))] if len(messages) > 1 else []) + [{"role": "user", "content": text}]


def run(server, case: Case, messages, turns):
    """Full-history turns; appends to messages; returns [(answer, usage, metrics)]."""
    results = []
    for text in turns:
        messages[:] = next_turn(messages, text)
        answer, usage, metrics = chat(server, case, messages)
        messages.append({"role": "assistant", "content": answer})
        results.append((answer, usage, metrics))
    return results


def wait_written(store: Path, case: Case, turns: int, path_tokens: int, timeout: float = 120) -> Path:
    """The session's file once its writer has stored `turns` turns (of QueryMemory, of the memory
    pool) and a path of at least `path_tokens` tokens."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for path in (store / digest("tenant", case.tenant)).glob("*/*.safetensors"):
            try:
                with safe_open(str(path), "pt") as f:
                    done = int(f.metadata()["tokens"]) >= path_tokens
                    if case.has("intent"):
                        done = (
                            done
                            and "s.intent.updates" in f.keys()
                            and int(f.get_tensor("s.intent.updates")[0]) >= turns
                        )
                    if case.has("memory"):
                        done = done and "s.memory.meta" in f.keys() and int(f.get_tensor("s.memory.meta")[0]) >= turns
                    if done:
                        return path
            except Exception:  # replaced while we read it
                pass
        time.sleep(0.5)
    raise AssertionError(f"the session file did not reach {turns} turns")


@dataclass
class Session:
    case: Case
    server: object  # the server the rest of the session runs on (restarted)
    messages: list[dict]  # the history up to the restart point
    first: list  # [(answer, usage, metrics)] of the turns before it
    reference: tuple  # the next turn on the server that never restarted
    stored: Path  # the session file at the restart point


@pytest.fixture(scope="module", params=list(CASES))
def session(request, all_server, all_b_server, pool):
    case, a, b = CASES[request.param], all_server, all_b_server
    messages = [SYSTEM]
    first = run(a, case, messages, TURNS[: case.restart])
    stored = wait_written(a.dir / "store", case, case.restart, first[-1][1]["prompt_tokens"])
    pool.copy_sessions(a, b, case.tenant)  # B restarts the session from turn `restart`'s file
    reference = run(a, case, list(messages), TURNS[case.restart : case.restart + 1])[
        0
    ]  # the server that never restarted
    return Session(case, b, messages, first, reference, b.dir / "store" / stored.relative_to(a.dir / "store"))


def needs(session: Session, *names: str) -> None:
    if not all(session.case.has(n) for n in names):
        pytest.skip(f"needs {' and '.join(names)}")


def test_the_session_is_pruned_to_its_budget_every_turn(session):
    needs(session, "intent")
    pruned = [m for _, _, m in session.first if m["compression_events"]]
    assert len(pruned) >= len(session.first) // 3, "the history must outgrow the budget"
    for _, usage, m in session.first:
        assert m["live_kv_tokens"] <= max(BUDGET, m["budget"]) + usage["completion_tokens"]
    # full-history turns reuse the pruned path: only the new turn is prefilled
    late = session.first[-1][1]
    assert late["prompt_tokens_details"]["cached_tokens"] > late["prompt_tokens"] // 2


def test_every_metric_a_turn_reports_is_in_the_request_reference(session):
    """docs/requests.md lists each mechanism's response keys: a key the server sends and the page
    lacks fails here (every mechanism of the case reported on these turns)."""
    from test_docs import documented_response_keys

    seen = {key for _, _, m in [*session.first, session.reference] for key in m}
    assert seen - documented_response_keys() == set()


def test_the_stored_session_holds_the_pruned_path_its_live_mask_and_the_other_mechanisms_state(session):
    with safe_open(str(session.stored), "pt") as f:
        names = set(f.keys())
        meta = f.metadata()
        live = f.get_tensor("live") if "live" in names else None
    if session.case.has("intent"):
        assert "s.intent.query_memory" in names and json.loads(meta["branches"])
        assert live.numel() == int(meta["tokens"]) and 0 < int(live.sum()) < live.numel()
    if session.case.has("memory"):
        assert {"s.memory.keys", "s.memory.values", "s.memory.tokens"} <= names


def test_the_turn_after_a_restart_equals_the_turn_on_a_server_that_never_restarted(session):
    turn = session.case.restart + 1
    answer, usage, metrics = chat(session.server, session.case, next_turn(session.messages, TURNS[turn - 1]))
    ref_answer, ref_usage, ref = session.reference
    assert metrics["restored_from"] == "disk" and metrics["restored_tokens"] > 0, metrics
    # the path came back (with its dead positions): the same prefix is reused; with intent, the same
    # number of positions is pruned from a QueryMemory of the same turns; with memory, the same pool
    assert usage["prompt_tokens_details"]["cached_tokens"] == ref_usage["prompt_tokens_details"]["cached_tokens"]
    if session.case.has("intent"):
        assert metrics["query_memory_turns"] == ref["query_memory_turns"] == turn
        assert metrics["freed_slots"] == ref["freed_slots"] and metrics["live_kv_tokens"] == ref["live_kv_tokens"]
    if session.case.has("memory"):
        assert metrics["memory_blocks"] == ref["memory_blocks"] > 0
    assert answer == ref_answer


def test_a_fact_from_turn_1_is_recalled_as_kv_at_the_last_turn(session):
    needs(session, "memory")
    from transformers import AutoTokenizer

    messages = list(session.messages)
    done = len(session.first)
    run(
        session.server, session.case, messages, TURNS[done : session.case.turns]
    )  # the turns after the restart, on the restarted server
    answer, usage, metrics = chat(
        session.server,
        session.case,
        [SYSTEM, {"role": "user", "content": "What is my locker code?"}],
        memory={"top_k": 8},
    )
    # turn 1 is the pool's first turn (its whole first request): the fact's tokens must be placed
    tokenizer = AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))
    text = tokenizer.apply_chat_template([SYSTEM, {"role": "user", "content": TURNS[0]}], tokenize=False)
    turn_1 = tokenizer.encode(text, add_special_tokens=False)
    code = tokenizer.encode(" 4812", add_special_tokens=False)
    at = next(i for i in range(len(turn_1)) if turn_1[i : i + len(code)] == code)
    assert any(turn == 0 and offset <= at < offset + n for turn, offset, n in metrics["retrieved_spans"]), metrics
    # every mechanism on reports in the one object
    assert (
        metrics["retrieved_blocks"] > 0
        and usage["prompt_tokens_details"]["cached_tokens"] >= metrics["memory_kv_tokens"]
    )
    assert (metrics.get("budget") == BUDGET) == session.case.has("intent")
    assert "persist_error" in metrics


def test_sentencekv_reads_part_of_each_pruned_turn_and_the_recall(session):
    """On the pruned path (its live positions: the sentinel's are never read) and on the memory-mode
    request (its assembled prompt), a decode step reads the always-read rows, at most the budget of
    retrieved sentences, and what it generated."""
    needs(session, "sentencekv")
    for _, usage, m in session.first:
        live = m["live_kv_tokens"] - usage["completion_tokens"]
        if m.get("sentencekv_skipped") == "short prompt":  # the first turns: every live token is always read
            assert live <= SKV_ALWAYS and "kv_read_per_step" not in m, (m, usage)
            continue
        # the pool holds 2 x budget of the live tokens besides the always-read rows, some of which
        # intent may have pruned
        assert min(live, 2 * SKV_BUDGET) <= m["kept_tokens"] <= min(live, SKV_ALWAYS + 2 * SKV_BUDGET), (m, usage)
        steps = usage["completion_tokens"] - 1
        generated = sum(range(1, steps + 1)) / max(steps, 1)
        assert m["kv_read_per_step"] <= SKV_ALWAYS + SKV_BUDGET + generated + 1e-9
        if live > SKV_ALWAYS + SKV_BUDGET:
            assert m["retrieved_sentences"] >= 1 and m["kv_read_per_step"] < live + generated
    _, usage, recall = chat(
        session.server,
        session.case,
        [SYSTEM, {"role": "user", "content": "What is my locker code?"}],
        memory={"top_k": 8},
    )
    assert recall["retrieved_blocks"] > 0 and recall["decode_steps"] == usage["completion_tokens"] - 1
    assert (
        min(usage["prompt_tokens"], 2 * SKV_BUDGET)
        <= recall["kept_tokens"]
        <= min(usage["prompt_tokens"], SKV_ALWAYS + 2 * SKV_BUDGET)
    )


@pytest.mark.parametrize("who", [{"tenant": "composed-other"}, {"session_id": "agent-2"}])
def test_another_tenant_or_session_gets_nothing_of_the_session(session, who):
    """The same prompts under another tenant, or another session id: no restored path, no recalled
    block, a QueryMemory of its own, a memory pool of its own."""
    if session.case.mechanisms != CASES["all"].mechanisms:
        pytest.skip("run with all three on")
    b, messages = session.server, session.messages
    _, _, first = chat(b, session.case, messages[:2], **who)
    assert first["restored_tokens"] == 0 and first["text_match"] is None
    assert first["query_memory_turns"] == 1
    _, _, recall = chat(
        b, session.case, [SYSTEM, {"role": "user", "content": "What is my locker code?"}], memory={"top_k": 8}, **who
    )
    # its pool holds only its own first turn (about 45 tokens; the session's holds its turns)
    assert recall["retrieved_turns"] == [0] and recall["memory_blocks"] <= 4
    assert recall["query_memory_turns"] == 2


@dataclass(frozen=True)
class Twin(Case):
    """One of two tenants that run the same session: one stays hot, the other is evicted."""

    name: str = ""

    @property
    def tenant(self) -> str:
        return f"composed-twin-{self.name}"


def test_a_session_evicted_from_a_running_server_answers_as_one_that_stayed_hot(all_server):
    """Every mechanism on, in one running server: a session whose KV left the tree (its pruned path,
    QueryMemory and memory pool come back from the store's host-memory tier or its file) answers its next
    turn as the same session that stayed in the tree: the same reused prefix, the same pruning, the
    same memory pool, the same greedy tokens (the store is in the pool's dtype: the KV comes back
    bit for bit)."""
    mechanisms = CASES["all"].mechanisms
    hot, evicted = Twin(mechanisms, 6, 5, "hot"), Twin(mechanisms, 6, 5, "evicted")
    reference = run(all_server, hot, [SYSTEM], TURNS[:6])
    messages = [SYSTEM]
    first = run(all_server, evicted, messages, TURNS[:5])
    assert [a for a, _, _ in first] == [a for a, _, _ in reference[:5]]
    assert any(m["compression_events"] for _, _, m in first), "the history must outgrow the budget"
    wait_written(all_server.dir / "store", evicted, 5, first[-1][1]["prompt_tokens"])
    assert all_server.post("/flush_cache?timeout=600", {}).status_code == 200
    answer, usage, metrics = run(all_server, evicted, messages, TURNS[5:6])[0]
    ref_answer, ref_usage, ref = reference[5]
    assert metrics["restored_from"] in ("memory", "disk") and metrics["restored_tokens"] > 0, metrics
    assert usage["prompt_tokens_details"]["cached_tokens"] == ref_usage["prompt_tokens_details"]["cached_tokens"]
    assert metrics["query_memory_turns"] == ref["query_memory_turns"] == 6
    assert metrics["freed_slots"] == ref["freed_slots"] and metrics["live_kv_tokens"] == ref["live_kv_tokens"]
    assert metrics["memory_blocks"] == ref["memory_blocks"] > 0
    assert answer == ref_answer
