"""The memory entries API inside the real server (SmolLM2-135M, float32: the suite's float32 server,
memory, keep and persistence on).

References are plain requests of the same server: a retrieved entry's KV was computed from its text
alone at positions 0..n-1, so a memory-mode request that places exactly that entry first must
answer, greedy token for token, as the plain request whose prompt is the entry's text followed by
the question; a static group's joint KV likewise as the members' texts concatenated. A replaced or
forgotten entry must never be placed again. The entries survive a restart: the second float32
server, finding the session's file in its store, reads back the same book, and text mode places
the restored entries' current texts as lines.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from servers import TEST_MODEL
from sgl_memory import models

pytestmark = pytest.mark.server

# float32: bf16 matmuls round a row differently with the row count of the pass, and the
# references prefill the entry together with the question while the entry was computed alone
KITCHEN = {
    "apple": "The red apple is on the kitchen table.",
    "knife": "The sharp knife is in the kitchen drawer.",
    "bread": "The loaf of bread is on the kitchen counter.",
}
GARAGE = {"car": "The blue car is parked in the garage.", "bike": "The old bicycle leans against the garage wall."}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))


@pytest.fixture(scope="module")
def srv(fp32_server):
    """The suite's float32 server. It places memory after the system message unless asked; these
    requests place it first, where the references put the entries' text."""
    memory = fp32_server.get("/sgl_memory/info").json()["config"]["memory"]
    assert (memory["static_after"], memory["group_threshold"]) == (2, 0.3)  # what the group test writes for
    return fp32_server


def write(srv, session, entries, status=200):
    r = srv.post(
        "/sgl_memory/memory/write",
        {"session_id": session, "entries": [{"key": k, "text": t} for k, t in entries.items()]},
    )
    assert r.status_code == status, r.text
    return r.json()


def question_ids(tok, question):
    return tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def ask(srv, ids, memory=None, n=12):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    if memory is not None:
        body["sgl_memory"] = memory
    r = srv.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def line(tok, text):
    return tok.encode(text.rstrip() + "\n", add_special_tokens=False)


def test_a_written_entry_is_placed_as_its_text_alone(srv, tok):
    out = write(srv, "one", {"key": "The spare key is taped under the blue flowerpot."})
    assert [w["key"] for w in out["written"]] == ["key"] and out["book"]["entries"] == 1
    q = question_ids(tok, "Where is the spare key?")
    got = ask(srv, q, {"session_id": "one", "memory": {"top_k": 8, "store": False, "placement": "first"}})
    text = line(tok, "The spare key is taped under the blue flowerpot.")
    assert got["meta_info"]["sgl_memory"]["memory_kv_tokens"] == len(text)
    assert got["meta_info"]["sgl_memory"]["retrieved_entries"] == 1
    assert got["output_ids"] == ask(srv, text + q)["output_ids"]


def test_a_replaced_entry_is_never_placed_again(srv, tok):
    write(srv, "two", {"key": "The spare key is taped under the blue flowerpot."})
    out = write(srv, "two", {"key": "The spare key is now in the kitchen drawer."})
    assert out["book"]["entries"] == 1
    q = question_ids(tok, "Where is the spare key?")
    got = ask(srv, q, {"session_id": "two", "memory": {"top_k": 64, "store": False, "placement": "first"}})
    new = line(tok, "The spare key is now in the kitchen drawer.")
    assert got["meta_info"]["sgl_memory"]["memory_kv_tokens"] == len(new)  # the old text is gone
    assert got["output_ids"] == ask(srv, new + q)["output_ids"]
    r = srv.post("/sgl_memory/memory/forget", {"session_id": "two", "keys": ["key"]})
    assert r.status_code == 200 and r.json()["book"]["entries"] == 0
    got = ask(srv, q, {"session_id": "two", "memory": {"top_k": 64, "store": False, "placement": "first"}})
    assert got["meta_info"]["sgl_memory"]["memory_kv_tokens"] == 0


def test_a_quiet_group_gets_a_joint_kv_and_a_write_makes_it_dynamic(srv, tok):
    write(srv, "three", KITCHEN)
    out = write(srv, "three", GARAGE)  # two writes after the last kitchen change (static_after 2)
    book = out["book"]
    kitchen = [g for g in book["groups"] if set(g["members"]) == set(KITCHEN)]
    assert len(kitchen) == 1 and kitchen[0]["static"], book
    assert [j["group"] for j in out["joint"]] == [kitchen[0]["id"]]
    assert book["static_groups"] == 1 and book["dynamic_groups"] >= 1
    # retrieved as one unit: its joint KV equals a plain prefill of the members' lines together
    q = question_ids(tok, "Where is the red apple?")
    got = ask(srv, q, {"session_id": "three", "memory": {"top_k": 1, "store": False, "placement": "first"}})
    joint = [t for key in kitchen[0]["members"] for t in line(tok, KITCHEN[key])]
    metrics = got["meta_info"]["sgl_memory"]
    assert metrics["retrieved_static_groups"] == 1 and metrics["memory_kv_tokens"] == len(joint), metrics
    assert got["output_ids"] == ask(srv, joint + q)["output_ids"]
    # KEEP over the unit: recomputing all of it is the plain prefill of the members' lines
    got = ask(
        srv,
        q,
        {
            "session_id": "three",
            "memory": {"top_k": 1, "store": False, "placement": "first", "recompute": "keep"},
            "keep": {"ratio": 1.0},
        },
    )
    assert got["meta_info"]["sgl_memory"]["recompute"] == "keep"
    assert got["output_ids"] == ask(srv, joint + q)["output_ids"]
    # a member changes: the group is dynamic, members are placed on their own again
    out = write(srv, "three", {"apple": "The red apple is in the fridge now."})
    kitchen = [g for g in out["book"]["groups"] if "knife" in g["members"]][0]
    assert not kitchen["static"] and out["joint"] == []
    got = ask(srv, q, {"session_id": "three", "memory": {"top_k": 1, "store": False, "placement": "first"}})
    metrics = got["meta_info"]["sgl_memory"]
    assert metrics["retrieved_static_groups"] == 0 and metrics["retrieved_entries"] == 1, metrics


def test_the_book_reads_back_and_other_sessions_see_nothing(srv, tok):
    write(srv, "four", GARAGE)
    r = srv.get("/sgl_memory/memory?session_id=four")
    assert r.status_code == 200 and r.json()["book"]["entries"] == 2
    r = srv.get("/sgl_memory/memory?session_id=nobody-here")
    assert r.status_code == 200 and r.json()["book"]["entries"] == 0
    got = ask(
        srv,
        question_ids(tok, "Where is the car?"),
        {"session_id": "nobody-here", "memory": {"store": False, "placement": "first"}},
    )
    assert got["meta_info"]["sgl_memory"]["memory_kv_tokens"] == 0


@pytest.mark.parametrize(
    "body",
    [
        {"entries": [{"key": "a", "text": "x"}]},  # no session
        {"session_id": "s", "entries": []},
        {"session_id": "s", "entries": [{"key": "", "text": "x"}]},
        {"session_id": "s", "entries": [{"key": "a", "text": "   "}]},
        {"session_id": "s", "entries": [{"key": "a", "text": "x", "extra": 1}]},
        {"session_id": "s", "entries": [{"key": "a", "text": "x"}, {"key": "a", "text": "y"}]},
        {"session_id": "../s", "entries": [{"key": "a", "text": "x"}]},
        {"session_id": "s", "entries": [{"key": "a", "text": "word " * 12000}]},  # past the context
        [1, 2],
    ],
)
def test_bad_writes_are_400s_and_the_server_lives(srv, body):
    r = srv.post("/sgl_memory/memory/write", body)
    assert r.status_code == 400, r.text
    assert "message" in r.json()["error"]
    assert srv.get("/sgl_memory/memory?session_id=s").status_code == 200


def test_a_client_cannot_send_the_internal_modes(srv, tok):
    r = srv.post(
        "/generate",
        {
            "input_ids": question_ids(tok, "hi"),
            "sampling_params": {"max_new_tokens": 1},
            "sgl_memory": {"session_id": "x", "memory": {"mode": "write", "entry": "k"}},
        },
    )
    assert r.status_code == 400


def test_entries_and_groups_survive_a_restart(srv, fp32_b_server, pool, tok, minilm):
    """Session files hold the pool with its book: a second server on the same store answers from it."""
    write(srv, "five", KITCHEN)
    write(srv, "five", GARAGE)  # the kitchen group turns static
    write(srv, "five", {"car": "The blue car is at the mechanic."})  # a replaced entry
    before = srv.get("/sgl_memory/memory?session_id=five").json()["book"]
    assert before["static_groups"] == 1
    assert srv.post("/flush_cache?timeout=60", {}).status_code == 200  # the session's file is written
    again = fp32_b_server
    pool.copy_sessions(srv, again, None)
    after = again.get("/sgl_memory/memory?session_id=five").json()["book"]
    assert after == before
    q = question_ids(tok, "Where is the blue car?")
    got = ask(again, q, {"session_id": "five", "memory": {"top_k": 64, "store": False, "placement": "first"}})
    metrics = got["meta_info"]["sgl_memory"]
    # every entry once: the static group's joint KV, the garage entries, not the replaced text
    want = (
        sum(len(line(tok, t)) for t in KITCHEN.values())
        + len(line(tok, GARAGE["bike"]))
        + len(line(tok, "The blue car is at the mechanic."))
    )
    assert metrics["memory_kv_tokens"] == want and metrics["retrieved_static_groups"] == 1, metrics
    # text mode reads the restored pool too: its lines are the entries' current texts (the replaced
    # one gone from them as from the blocks), and the one placed for top_k 1 is the one MiniLM
    # ranks first here by brute force
    lines = [*KITCHEN.values(), GARAGE["bike"], "The blue car is at the mechanic."]
    scores = minilm.encode(lines, normalize_embeddings=True) @ minilm.encode(["Where is the blue car?"])[0]
    best = lines[int(scores.argmax())]
    text = ask(again, q, {"session_id": "five", "memory": {"mode": "text", "top_k": 1, "store": False}})
    inserted = tok.encode("Earlier in this conversation:\n" + best + "\n\n", add_special_tokens=False)
    assert text["meta_info"]["prompt_tokens"] == len(q) + len(inserted), text["meta_info"]
    every = ask(again, q, {"session_id": "five", "memory": {"mode": "text", "store": False}})
    assert every["meta_info"]["sgl_memory"]["text_lines"] == len(lines)  # never the replaced text
