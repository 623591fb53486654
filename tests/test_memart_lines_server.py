"""KV memory with its default unit in the real server (the default model: the suite's server for it
runs the memory section's defaults): blocks cut at line ends, and a chosen block placed with the
rest of its line, within `placed_tokens`.

A session records one turn of notes, one per line, some lines longer than a block. The
references are the turn's own tokens (what the session sent and got back) and where the
tokenizer says lines end: every run of placed tokens must be whole lines of that turn, in order,
and a request that places everything must answer as the plain request whose prompt is the whole
turn plus the question (the blocks go back to their own positions)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sgl_memory import models

pytestmark = [pytest.mark.server, pytest.mark.default_model]

NOTES = [
    "Notes of the week.",
    "Alice: my cat is called Pepper and she sleeps on the red sofa in the living room all day.",
    "Bob: I went hiking on Saturday.",
    "Carol: the weather was sunny and warm, with a light wind from the sea in the evening.",
    "Dan: I made soup for dinner.",
    "Erin: tomorrow I will read a book about the history of the old harbour town.",
]
QUESTION = "What is the cat called?"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.model_dir(models.DEFAULT_MODEL))


@pytest.fixture(scope="module")
def server(qwen_server):
    info = qwen_server.get("/sgl_memory/info").json()["config"]["memory"]
    assert (info["cut"], info["unit"], info["placed_tokens"]) == ("lines", "line", 2048)  # the defaults
    return qwen_server


def generate(server, ids, memory, n=12):
    r = server.post(
        "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}, "sgl_memory": memory},
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def turn(server, tok):
    """The recorded turn's tokens: the prompt and the answer, less the answer's last token (no KV)."""
    ids = tok.encode("\n".join(NOTES) + "\n", add_special_tokens=False)
    out = generate(server, ids, {"session_id": "notes", "tenant": "a"}, n=4)["output_ids"]
    generate(server, ids, {"session_id": "notes", "tenant": "ref"}, n=4)  # the same turn for the reference
    return ids + out[:-1]


def line_starts(tok, tokens: list[int]) -> set[int]:
    """Offsets where a line starts: 0 and after every token whose text ends a line."""
    return {0} | {i + 1 for i, t in enumerate(tokens) if tok.decode([t]).endswith("\n")}


def runs(spans: list[list[int]]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive placed tokens of turn 0."""
    out: list[list[int]] = []
    for t, offset, n in spans:
        assert t == 0
        if out and out[-1][1] == offset:
            out[-1][1] += n
        else:
            out.append([offset, offset + n])
    return [tuple(r) for r in out]


QUERY = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def test_a_chosen_block_is_placed_with_its_whole_line(server, tok, turn):
    q = tok.encode(QUERY.format(QUESTION), add_special_tokens=False)
    starts = line_starts(tok, turn) | {len(turn)}
    m = generate(server, q, {"session_id": "notes", "tenant": "a", "memory": {"top_k": 2, "store": False}})[
        "meta_info"
    ]["sgl_memory"]
    placed = runs(m["retrieved_spans"])
    assert placed and all(a in starts and b in starts for a, b in placed), (placed, sorted(starts))
    assert (
        m["memory_kv_tokens"] == sum(b - a for a, b in placed) and m["retrieved_blocks"] > 2
    )  # lines longer than a block
    # the line holding the fact is among them
    pepper = next(p for p in range(len(turn)) if "Pepper" in tok.decode(turn[: p + 1]))
    assert any(a <= pepper < b for a, b in placed)


@pytest.mark.parametrize("cap", [30, 60])
def test_placed_tokens_caps_what_is_placed_with_whole_lines(server, tok, turn, cap):
    q = tok.encode(QUERY.format(QUESTION), add_special_tokens=False)
    starts = sorted(line_starts(tok, turn) | {len(turn)})
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    m = generate(server, q, {"session_id": "notes", "tenant": "a", "memory": {"placed_tokens": cap, "store": False}})[
        "meta_info"
    ]["sgl_memory"]
    placed = runs(m["retrieved_spans"])
    assert all(a in starts and b in starts for a, b in placed)
    assert 0 < m["memory_kv_tokens"] <= cap
    # nothing left out would still have fitted: every line not placed is longer than what is left
    left = cap - m["memory_kv_tokens"]
    taken = {a for a0, b0 in placed for a in starts if a0 <= a < b0}
    assert all(n > left for a, n in zip(starts, lengths) if a not in taken)


def test_every_line_placed_equals_the_whole_turn_in_the_prompt(server, tok, turn):
    q = tok.encode(QUERY.format(QUESTION), add_special_tokens=False)
    memory = {"placed_tokens": 0, "store": False, "recompute": "none"}  # reused as recorded
    got = generate(server, q, {"session_id": "notes", "tenant": "a", "memory": memory})
    m = got["meta_info"]["sgl_memory"]
    assert runs(m["retrieved_spans"]) == [(0, len(turn))] and m["prefill_tokens"] == len(q)
    want = generate(server, turn + q, {"session_id": "notes", "tenant": "ref"})
    assert got["output_ids"] == want["output_ids"]
