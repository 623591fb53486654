"""Same configuration, same answers: two servers, one script, identical results.

The suite's `all` and `all_b` servers (one configuration: every mechanism on, each with a store of
its own) run the script at the same time, so their background workers (memory's recording,
persistence's writes), probes and schedulers interleave differently; each starts it with an empty
tree (what earlier tests left is flushed). Each runs the same two sessions, in the same order:
- a memory session: full-history turns that state facts (recorded by the background worker),
  then memory-mode questions that retrieve blocks (`store: false`) and one that is stored;
- a pruned session: full-history turns under a history budget that bites, with the memory
  scorer, SnapKV and the random scorer (whose draw must not depend on request ids).
The reference is the other server: every answer's tokens and log-probabilities, every retrieved
block (turn, offset, length) and every pruning event's counts must be equal, bit for bit."""

from __future__ import annotations

import concurrent.futures

import pytest
from transformers import AutoTokenizer

from servers import TEST_MODEL
from sgl_memory import models

pytestmark = pytest.mark.server

SYSTEM = "You are a brief, helpful assistant."
FACTS = [
    "My cat is called Pepper and she is grey.",
    "I went hiking near the lake on Saturday with Ana.",
    "The weather was sunny and warm, about 24 degrees.",
    "For dinner I made a lentil soup with carrots.",
    "Tomorrow I will read a book about the history of Lisbon.",
    "My sister lives in Porto and works as a nurse.",
]
QUESTIONS = [
    "What is my cat called?",
    "Where does my sister live?",
    "What did I cook for dinner?",
    "Who did I go hiking with?",
]
PRUNED = [
    {"budget": 24, "budget_mode": "history", "scorer": s, "layout": "dead_slot"} for s in ("memory", "snapkv", "random")
]
# what a response must repeat exactly: the sgl_memory metrics that name what was placed or pruned
SAME = (
    "retrieved_blocks",
    "retrieved_turns",
    "retrieved_spans",
    "memory_kv_tokens",
    "memory_blocks",
    "live_kv_tokens",
    "compression_events",
    "freed_slots",
    "budget",
    "prefill_tokens",
)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))


@pytest.fixture(scope="module")
def servers(all_server, all_b_server):
    for server in (all_server, all_b_server):
        assert server.post("/flush_cache?timeout=60", {}).status_code == 200
    return all_server, all_b_server


def turn(tok, history: list[dict], text: str) -> list[int]:
    return tok.apply_chat_template(
        history + [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def ask(server, ids: list[int], field: dict) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "sgl_memory": {"tenant": "determinism", **field},
    }
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    return {
        "output_ids": out["output_ids"],
        "logprobs": [x[0] for x in meta["output_token_logprobs"]],
        **{k: v for k, v in meta["sgl_memory"].items() if k in SAME},
    }


def session(server, tok, sid: str, field: dict, questions: bool) -> list[dict]:
    """Full-history turns stating FACTS, then (memory) questions that retrieve; every answer."""
    history, answers = [{"role": "system", "content": SYSTEM}], []
    for fact in FACTS:
        a = ask(server, turn(tok, history, fact), {"session_id": sid, **field})
        answers.append(a)
        history += [
            {"role": "user", "content": fact},
            {"role": "assistant", "content": tok.decode(a["output_ids"], skip_special_tokens=True)},
        ]
    if questions:
        system = [{"role": "system", "content": SYSTEM}]
        for i, q in enumerate(QUESTIONS):  # the last one is stored, so the pool grows between questions
            memory = {"mode": "retrieve", "store": i == len(QUESTIONS) - 1}
            answers.append(ask(server, turn(tok, system, q), {"session_id": sid, "memory": memory}))
        answers.append(
            ask(server, turn(tok, system, QUESTIONS[0]), {"session_id": sid, "memory": {"mode": "retrieve"}})
        )
    return answers


def run_script(server, tok) -> dict:
    out = {"memory": session(server, tok, "mem", {}, questions=True)}
    for field in PRUNED:
        out[field["scorer"]] = session(server, tok, f"pruned-{field['scorer']}", field, questions=False)
    return out


def test_two_fresh_servers_give_the_same_answers_blocks_and_prunings(servers, tok):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda s: run_script(s, tok), servers)
    # the script does what it is meant to test: blocks retrieved, prunings that freed positions
    assert all(a["retrieved_spans"] for a in first["memory"][len(FACTS) :]), first["memory"]
    for scorer in ("memory", "snapkv", "random"):
        assert sum(a["compression_events"] for a in first[scorer]) >= len(FACTS) - 2, first[scorer]
    for name in first:
        for i, (a, b) in enumerate(zip(first[name], second[name], strict=True)):
            assert a == b, f"{name} turn {i}: {a} != {b}"
