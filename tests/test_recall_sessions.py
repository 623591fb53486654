"""The generated recall family (bench/recall): every question has exactly one answer in the
session's tool outputs, found by a brute-force lookup that parses the outputs as a reader would,
and the sessions reach their lengths with the needle where the depth puts it."""

from __future__ import annotations

import json
import re

import pytest

from bench.recall import run
from bench.recall import sessions as S

QUESTIONS = [  # (question pattern, shape of the output that answers it, key field, value field)
    (r'Which item was bought in order "(\S+)"\?', "orders", "order_id", "item"),
    (r'In which city is the order of customer "(\S+)"\?', "orders", "customer_id", "city"),
    (r"Which user made the request with req=(\S+)\?", "logs", "request", "user"),
    (r"Who owns the file (\S+)\?", "files", "name", "owner"),
    (r"in what year was (.+) founded\?", "search", "subject", "year"),
]


def records(output: str) -> tuple[str, list[dict]]:
    """A tool output parsed back into its shape and items."""
    if output.startswith("| name | "):
        rows = [line.strip("| ").split(" | ") for line in output.splitlines()[1:]]
        return "files", [{"name": r[0], "owner": r[1], "size": r[2]} for r in rows]
    if output.startswith("[1] "):
        found = [
            re.match(r"\[\d+\] History of (.+) - .+ was founded in (\d+)\. \((\S+)\)$", line)
            for line in output.splitlines()
        ]
        return "search", [{"subject": m.group(1), "year": m.group(2), "source": m.group(3)} for m in found]
    if output.startswith("[\n"):
        return "orders", json.loads(output)
    found = [re.search(r" req=(\S+) user=(\S+) status=(\d+)", line) for line in output.splitlines()]
    return "logs", [{"request": m.group(1), "user": m.group(2), "status": m.group(3)} for m in found]


def keys(output: str) -> list[str]:
    """The key of each item of an output: what a question names it by."""
    shape, items = records(output)
    return [
        item[{"orders": "order_id", "logs": "request", "files": "name", "search": "subject"}[shape]] for item in items
    ]


def test_no_two_items_of_a_session_share_a_key_word():
    """Ids and file names are words the session uses once (near-duplicate ids made the small model
    answer from a neighbour); a one-hop session names no customer twice either."""
    fields = {"orders": ("order_id", "customer_id"), "logs": ("request", "user"), "files": ("name",), "search": ()}
    for seed in range(5):
        s = S.generate(seed, 100, "orders", 1, 0.5)  # 150+ keys: the word list comes round a second time
        parsed = [records(m["content"]) for m in s.messages if m["role"] == "tool"]
        words = [
            re.split(r"[-_]", item[f])[1 if f != "name" else 0]
            for shape, items in parsed
            for item in items
            for f in fields[shape]
        ]
        assert len(words) > len(S.KEYS) and len(words) == len(set(words))


def lookup(messages: list[dict], question: str) -> list[str]:
    for pattern, shape, key, value in QUESTIONS:
        m = re.search(pattern, question)
        if m:
            parsed = [records(x["content"]) for x in messages if x["role"] == "tool"]
            return [item[value] for kind, items in parsed if kind == shape for item in items if item[key] == m.group(1)]
    raise AssertionError(f"no pattern for {question!r}")


@pytest.mark.parametrize("shape", S.SHAPES)
@pytest.mark.parametrize("hops", (1, 2, 3))
@pytest.mark.parametrize("depth", (0.1, 0.9))
def test_every_question_has_exactly_its_gold_answer_in_the_outputs(shape, hops, depth):
    for seed in range(5):
        s = S.generate(seed, 12, shape, hops, depth)
        asked = [(i, m["content"]) for i, m in enumerate(s.messages) if m["role"] == "user"][1:]  # after the task
        assert len(asked) == max(hops, 2)  # a one-hop session's warm-up question before its own
        golds = [s.answer if i == len(s.messages) - 1 else s.messages[i + 1]["content"] for i, _ in asked]
        for (i, question), gold in zip(asked, golds):
            assert lookup(s.messages, question) == [gold], (seed, question)
        if hops == 1:  # the warm-up names no needle and does not give the gold answer away
            assert golds[0] != s.answer and asked[0][1] != asked[1][1]
            needle_keys = [v for st in s.needed_steps for v in keys(s.messages[3 + 2 * st]["content"])]
            assert not any(k in asked[0][1] for k in needle_keys), (seed, asked[0][1])
        first = s.needed_steps[0]
        assert first == round(depth * (12 - hops)) and s.needed_steps == list(range(first, first + hops))


def test_sessions_reach_their_length(tmp_path):
    from transformers import AutoTokenizer

    from sgl_memory import models

    tok = AutoTokenizer.from_pretrained(
        models.fetch(models.DEFAULT_MODEL)
    )  # the test model's template renders no tool calls
    for length, s in run.plan(tok, [1024, 3000], 4):
        n = len(run.render(tok, s.messages))
        assert length <= n < length + 1200, (length, n)


def test_correct_takes_the_value_alone_or_in_a_short_reply():
    assert S.correct("Dana Whitfield", "Dana Whitfield") and S.correct("The owner is Dana Whitfield.", "Dana Whitfield")
    assert S.correct("1907", "1907") and S.correct("cust-otter-45", "cust-otter-45")
    assert not S.correct("Dana", "Dana Whitfield") and not S.correct("1908", "1907")
    assert not S.correct("Lisbon, Porto, Lyon, Graz, Utrecht", "Lisbon")  # a list of candidates
