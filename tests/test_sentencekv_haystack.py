"""bench/sentencekv's haystacks: read back as a reader would (every "secret code" sentence parsed out
of the decoded prompt), each asks about exactly one vault that exactly one sentence answers, with
the code the benchmark scores against, beside the asked number of other vaults' codes."""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from bench import sentencekv
from sgl_memory import models

NEEDLE = re.compile(r"The secret code of the (\w+) vault is (\d+)\.")
QUESTION = re.compile(r"What is the secret code of the (\w+) vault\?")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(models.fetch(models.DEFAULT_MODEL))


@pytest.mark.parametrize("context,depth,seed,distractors", [(2048, 0.1, 0, 7), (4096, 0.9, 1, 3), (2048, 0.5, 2, 0)])
def test_one_answer_among_distractors(tokenizer, context, depth, seed, distractors):
    ids, code = sentencekv.haystack(tokenizer, context, depth, seed, distractors)
    text = tokenizer.decode(ids)
    notes, _, question = text.rpartition("I have read the notes.")
    needles = NEEDLE.findall(notes)
    asked = QUESTION.findall(question)
    assert len(asked) == 1 and len(needles) == distractors + 1
    assert len({v for v, _ in needles}) == len(needles)  # one sentence per vault
    assert len({c for _, c in needles}) == len(needles)  # no two vaults share a code
    assert [c for v, c in needles if v == asked[0]] == [code]
    assert 0.9 * context <= len(ids) <= 1.05 * context


def test_needle_at_its_depth(tokenizer):
    ids, code = sentencekv.haystack(tokenizer, 4096, 0.9, 3, 0)
    text = tokenizer.decode(ids)
    at = text.index(f"is {code}.") / text.index("I have read the notes.")
    assert 0.85 <= at <= 0.95


def test_too_many_distractors(tokenizer):
    with pytest.raises(ValueError, match="distractors"):
        sentencekv.haystack(tokenizer, 2048, 0.5, 0, len(sentencekv.VAULTS))
