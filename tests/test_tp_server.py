"""Every mechanism at tensor-parallel size 2 in the real server: SGLang's CPU engine, one core per
rank, the default 0.5B model (SmolLM2-135M's 9 attention heads do not split in two).

Each rank holds half the heads. Intent, KV memory and KEEP combine their per-head scores over the
ranks, so every rank prunes the same positions, places the same blocks and recomputes the same
rows, the ones a server with every head on one rank chooses. The reference is that server: the
same session (full-history turns that intent prunes to its budget, persistence and KV memory
recording them, then memory-mode questions repaired by KEEP and by CacheBlend) on a TP 1 server
must report the same live KV, freed slots, retrieved spans and recompute shares, and answer the
same greedy tokens. (With the scores left per rank, turns answer differently and other blocks are
placed: measured when this test was written.)

Persistence writes one file per rank; a restart loads a session from every rank's file or from
none. The restarted server must restore an intact session and answer its next turn as the server
that never restarted did; a session whose rank-1 file is a turn behind rank 0's (a write that had
not landed) must be served by normal prefill, counted, with the server still serving: ranks that
restored different paths would compute different batches.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sgl_memory import models
from sgl_memory.persist.session import RANKS_DIFFER
from sgl_memory.persist.header import read_metadata

pytestmark = pytest.mark.server

MODEL = models.DEFAULT_MODEL
SYSTEM = [{"role": "system", "content": "You are a brief, helpful assistant."}]
FACTS = [
    "Remember this: my cat is called Pepper.",
    "I went hiking on Saturday.",
    "The weather was sunny and warm.",
    "I made soup for dinner.",
    "Tomorrow I will read a book.",
    "My sister lives in Oslo.",
]
TURNS = 5  # of FACTS before the questions; the sixth comes after the restart


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.model_dir(MODEL))


def generate(server, ids, memory, n=12):
    r = server.post(
        "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}, "sgl_memory": memory},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    return {"out": out["output_ids"], "cached": out["meta_info"]["cached_tokens"], **out["meta_info"]["sgl_memory"]}


def observation(i: int) -> str:
    return f"Tool output {i}: " + ", ".join(f"sensor {j} read {(i * 37 + j * 11) % 100}" for j in range(8)) + "."


def next_ids(tok, ids, out, i):
    """The full-history prompt of turn i + 1 after turn i answered `out`."""
    return (
        ids
        + out
        + tok.encode(
            f"\n<|im_start|>user\n{observation(i)} {FACTS[i + 1]}<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        )
    )


def first_prompt(tok):
    return tok.apply_chat_template(
        SYSTEM + [{"role": "user", "content": FACTS[0]}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def converse(server, tok, session: dict, turns: int) -> tuple[list[dict], list[int]]:
    """Full-history turns of one session; returns their results and the next turn's prompt."""
    ids, results = first_prompt(tok), []
    for i in range(turns):
        result = generate(server, ids, session)
        result["path"] = (
            len(ids) + len(result["out"]) - 1
        )  # what the turn leaves in the tree (the last token has no KV)
        results.append(result)
        ids = next_ids(tok, ids, result["out"], i)
    return results, ids


def ask(server, tok, session: dict, recompute: str) -> dict:
    q = tok.apply_chat_template(
        SYSTEM + [{"role": "user", "content": "What is my cat called?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return generate(server, q, {**session, "memory": {"top_k": 4, "store": False, "recompute": recompute}})


def rank_files(store: Path, session_id: str) -> dict[str, Path]:
    """The session's file of each rank, by shard ("tp0/2")."""
    found = {}
    for path in store.glob("*/*/*.safetensors"):
        meta = read_metadata(path)
        if meta["session_id"] == session_id:
            found[json.loads(meta["spec"])["shard"]] = path
    return found


def wait_written(store: Path, session_id: str, tokens: int, timeout: float = 120) -> dict[str, Path]:
    """Every rank's file of the session, once each holds a path of at least `tokens` tokens."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        files = rank_files(store, session_id)
        try:
            if len(files) == 2 and all(int(read_metadata(p)["tokens"]) >= tokens for p in files.values()):
                return files
        except FileNotFoundError:  # replaced while we read it
            pass
        time.sleep(0.5)
    raise AssertionError(f"the ranks' files of {session_id!r} did not reach {tokens} tokens")


def settle(store: Path, quiet: float = 1.5, timeout: float = 60) -> None:
    """Once no file of the store has changed for `quiet` seconds: no write is in flight."""
    deadline, last, since = time.time() + timeout, None, time.time()
    while time.time() < deadline:
        now = sorted((str(p), p.stat().st_mtime_ns) for p in store.glob("*/*/*.safetensors"))
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= quiet:
            return
        time.sleep(0.25)
    raise AssertionError("the store's files kept changing")


S = {"session_id": "s", "tenant": "a"}  # the session compared with TP 1 and restored
T = {"session_id": "t", "tenant": "a"}  # the session whose rank-1 file is left a turn behind


@pytest.fixture(scope="module")
def reference(qwen_tp1_server, qwen_tp2_server, tok, pool):
    """S's turns and questions on the TP 1 server (every head on one rank), which then stops: the
    TP 2 restart takes its place, started while server A works."""
    try:
        turns, _ = converse(qwen_tp1_server, tok, S, TURNS)
        return turns, {how: ask(qwen_tp1_server, tok, S, how) for how in ("keep", "cacheblend")}
    finally:
        pool.stop("qwen_tp1")
        pool.start_ahead("qwen_tp2_b")


@pytest.fixture(scope="module")
def tp2(qwen_tp2_server, reference, tok, pool):
    """Server A (TP 2) runs S and T, its store is copied once both are written (T's rank-1 file
    then replaced by its copy of a turn before), A answers S's next turn and stops; B starts on the
    copy (the suite's TP 2 server restarted, with metrics on)."""
    a = qwen_tp2_server
    store, snapshot = a.dir / "store", a.dir / "snapshot"
    turns, next_prompt = converse(a, tok, S, TURNS)
    questions = {how: ask(a, tok, S, how) for how in ("keep", "cacheblend")}
    (t_first,), t_ids = converse(a, tok, T, 1)
    behind = wait_written(store, "t", t_first["path"])["tp1/2"].read_bytes()  # T's turn 1, as rank 1 wrote it
    t_second = generate(a, t_ids, T)
    t_next = next_ids(tok, t_ids, t_second["out"], 1)
    wait_written(store, "t", len(t_ids) + len(t_second["out"]) - 1)
    wait_written(store, "s", turns[-1]["path"])
    settle(store)
    shutil.copytree(store, snapshot)
    rank_files(snapshot, "t")["tp1/2"].write_bytes(behind)
    after_restart = generate(a, next_prompt, S)  # on the server that never restarted
    pool.stop("qwen_tp2")
    shutil.copytree(snapshot, pool.directory("qwen_tp2_b") / "store", dirs_exist_ok=True)  # B finds the sessions there
    b = pool.get("qwen_tp2_b")
    return {"turns": turns, "questions": questions, "t_next": t_next, "next": (next_prompt, after_restart), "b": b}


def test_every_turn_prunes_and_answers_as_one_rank_with_every_head(reference, tp2):
    ref_turns, _ = reference
    assert any(r["freed_slots"] for r in ref_turns), "the history must outgrow the budget"
    for ref, got in zip(ref_turns, tp2["turns"], strict=True):
        assert (got["out"], got["live_kv_tokens"], got["freed_slots"], got["cached"]) == (
            ref["out"],
            ref["live_kv_tokens"],
            ref["freed_slots"],
            ref["cached"],
        )


@pytest.mark.parametrize("how", ["keep", "cacheblend"])
def test_memory_recall_places_and_repairs_as_one_rank_with_every_head(reference, tp2, how):
    _, ref_questions = reference
    ref, got = ref_questions[how], tp2["questions"][how]
    assert ref["retrieved_blocks"] > 0 and 0 < ref["recompute_share"] < 1
    assert (got["out"], got["retrieved_spans"], got["recompute_share"], got["recomputed_token_layers"]) == (
        ref["out"],
        ref["retrieved_spans"],
        ref["recompute_share"],
        ref["recomputed_token_layers"],
    )


def test_a_restart_restores_a_session_from_every_ranks_file(tp2):
    prompt, reference = tp2["next"]
    got = generate(tp2["b"], prompt, S)
    assert got["restored_from"] == "disk" and got["restored_tokens"] > 0, got
    assert (got["out"], got["cached"], got["live_kv_tokens"], got["freed_slots"]) == (
        reference["out"],
        reference["cached"],
        reference["live_kv_tokens"],
        reference["freed_slots"],
    )


def test_a_session_whose_ranks_files_differ_is_restored_by_no_rank(tp2, tok):
    b = tp2["b"]
    refusals = ("sgl_memory_refusals_total", (("mechanism", "persist"), ("reason", "ranks")))
    before = b.prometheus().get(refusals, 0.0)
    prompt = tp2["t_next"]
    got = generate(b, prompt, T)
    assert got["restored_tokens"] == 0 and got["persist_refused"] == RANKS_DIFFER, got
    assert b.prometheus()[refusals] == before + 1
    # the server serves on: the session's next turn, and a session it never saw
    generate(b, next_ids(tok, prompt, got["out"], 2), T)
    assert len(generate(b, first_prompt(tok), {"session_id": "u"})["out"]) > 0
    # and one asking whether the pool is under pressure (intent.when pressure; a history over the
    # budget, so the question is asked): each rank reads its own clock, the answer is one collective
    # at admission, and a rank asking alone would stall the scheduler
    assert len(prompt) > 128 + 64
    pressed = generate(b, prompt, {"session_id": "v", "when": "pressure"})
    assert len(pressed["out"]) > 0 and pressed["pruned_for"] in (None, "pressure")


DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "sgl_memory_dashboard.json"


def test_every_series_the_grafana_dashboard_reads_is_on_the_server(tp2, tok):
    """The operators' dashboard against the TP 2 server, which by now has pruned, restored,
    refused a session: one KV-memory question repaired by KEEP and one bad request more, and every
    series a panel's query names must be among the server's /metrics samples."""
    b = tp2["b"]
    ask(b, tok, S, "keep")
    assert (
        b.post("/v1/chat/completions", {"model": "m", "messages": [], "sgl_memory": {"session_id": "../x"}}).status_code
        == 400
    )
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert queries and all(panel["targets"] for panel in dashboard["panels"])
    named = {name for q in queries for name in re.findall(r"\bsgl_memory_[a-z_]+", q)}
    served = {name for name, _ in b.prometheus()}
    assert named and named <= served, sorted(named - served)
