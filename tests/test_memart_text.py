"""Text mode's pieces on the HTTP side (memart/text.py), against independent references: where the
lines go in real chat templates (the text the template renders for the message), the lines chosen
against a brute-force ranking, the line cache's bound. The whole path runs in the server in
tests/test_memart_server.py."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoTokenizer

from sgl_memory import models
from sgl_memory.core.spans import RoleMarkers
from sgl_memory.memart import text
from sgl_memory.memart.text import Line, LineCache, choose, lines_of, target

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")  # tool results as "tool" / as Qwen's user messages


@pytest.fixture(scope="module", params=MODELS)
def tok(request):
    return AutoTokenizer.from_pretrained(models.model_dir(request.param))


def render(tok, messages):
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def decoder(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "last",
    [
        {"role": "user", "content": "Where does Ana live?\nShe moved last year."},
        {"role": "tool", "tool_call_id": "c1", "content": "rows: 3"},
    ],
)
def test_the_lines_open_the_last_user_or_tool_message(tok, last):
    system = {"role": "system", "content": "Be brief."}
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    ids = render(tok, [system, *history, last])
    found = target(ids, RoleMarkers.from_tokenizer(tok, "chatml"), decoder(tok))
    # the reference: the template's rendering through the header line of the message that holds the
    # text (a Qwen tool result's <tool_response> tag comes after it: the lines go before the tag)
    marker = "\x00MARK\x00"
    before = tok.apply_chat_template(
        [system, *history, {**last, "content": marker + last["content"]}], add_generation_prompt=True, tokenize=False
    )
    head = before[: before.index(marker)]
    header = head.rindex("<|im_start|>")
    assert tok.decode(ids[: found.at]) == head[: head.index("\n", header) + 1]
    assert last["content"] in found.query and "Hello." not in found.query


def test_a_prompt_without_markup_is_the_query_and_the_lines_go_first(tok):
    ids = tok.encode("What is my cat called?", add_special_tokens=False)
    found = target(ids, RoleMarkers.from_tokenizer(tok, "none"), decoder(tok))
    assert found == text.Target(0, "What is my cat called?")


def test_lines_are_the_turns_distinct_lines_without_markup(tok):
    turns = [
        {"turn": 0, "ids": render(tok, [{"role": "user", "content": "My cat is Pepper.\n\nI like tea."}])},
        {"turn": 1, "ids": tok.encode("Noted.\nI like tea.\n  The end  \nA line that", add_special_tokens=False)},
        {"turn": 2, "ids": tok.encode(" goes on.", add_special_tokens=False)},  # a turn may start inside a line
    ]
    got = lines_of(turns, decoder(tok))
    assert (
        "My cat is Pepper." in got and got.count("I like tea.") == 1 and got[-2:] == ["The end", "A line that goes on."]
    )
    assert not {"user", "assistant", "system", ""} & set(got)
    assert got.index("My cat is Pepper.") < got.index("I like tea.") < got.index("Noted.")


def test_choose_takes_the_best_ranked_lines_that_fit_in_recorded_order():
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 30)
        vectors = torch.nn.functional.normalize(
            torch.randn(n, 8, generator=torch.Generator().manual_seed(trial)), dim=1
        )
        lines = [Line(f"l{i}", vectors[i], rng.randint(1, 20)) for i in range(n)]
        query = vectors[rng.randrange(n)]
        budget = rng.choice([None, rng.randint(0, 120)])
        top_k = rng.choice([None, rng.randint(1, 10)])
        # reference: every line's cosine by a Python loop, best first (ties by index), taken while it fits
        cos = [sum(float(a) * float(b) for a, b in zip(v, query)) for v in vectors]
        want, used = [], 0
        for i in sorted(range(n), key=lambda i: (-cos[i], i)):
            if top_k is not None and len(want) == top_k:
                break
            if budget is None or used + lines[i].tokens <= budget:
                want.append(i)
                used += lines[i].tokens
        assert choose(lines, query, budget, top_k) == sorted(want), (trial, budget, top_k)


def test_each_line_is_embedded_once_and_the_cache_stays_within_its_bound(monkeypatch):
    embedded = []

    def fake_embed(texts):
        embedded.extend(texts)
        return [[float(len(t)), 1.0] for t in texts]

    monkeypatch.setattr(text, "embed", fake_embed)
    cache = LineCache(limit=5)
    tokenize = lambda s: s.split()  # noqa: E731
    first = asyncio.run(cache.lines(("", "a"), ["one two", "three"], tokenize))
    assert [line.tokens for line in first] == [3, 2]  # its tokens and the line end
    asyncio.run(cache.lines(("", "a"), ["three", "four"], tokenize))
    assert embedded == ["one two", "three", "four"]  # "three" was known
    asyncio.run(cache.lines(("", "b"), ["x", "y", "z", "w"], tokenize))  # 2 + 4 lines: over 5, "a" goes
    asyncio.run(cache.lines(("", "a"), ["three"], tokenize))
    assert embedded[-1] == "three"
