"""scripts/train_pruner.py without a server: the values a gold action names (a tool call rendered by
the model's chat template, a command in words), the labels those values give a history (against the
tokenizer's own character offsets), and the split by trajectory."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from bench.fidelity import points as P
from sgl_memory import models

spec = importlib.util.spec_from_file_location(
    "train_pruner", P.__file__.replace("bench/fidelity/points.py", "scripts/train_pruner.py")
)
T = importlib.util.module_from_spec(spec)
spec.loader.exec_module(T)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "find",
            "description": "Find files.",
            "parameters": {
                "type": "object",
                "properties": {
                    "folder": {"type": "string"},
                    "count": {"type": "integer"},
                    "recursive": {"type": "boolean"},
                    "names": {"type": "array"},
                },
            },
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.resolve(models.DEFAULT_MODEL))


def test_a_tool_calls_values_are_its_arguments_of_three_characters_or_more(tokenizer):
    """Through the chat template, as collect decodes a point's gold tokens: strings and numbers of
    3+ characters and the words of a value of several, nested lists and objects walked; booleans,
    short values, function words and the name are not values."""
    call = {
        "id": "c0",
        "type": "function",
        "function": {
            "name": "find",
            "arguments": {
                "folder": "old documents from 2023",
                "count": 12,
                "recursive": True,
                "names": ["a.txt", "bb", {"deep": 4096}],
            },
        },
    }
    gold = {"role": "assistant", "content": "", "tool_calls": [call]}
    pt = P.point(tokenizer, [{"role": "user", "content": "find them"}], gold, TOOLS, "test")
    assert sorted(T.action_strings(tokenizer.decode(pt.gold, skip_special_tokens=True))) == sorted(
        ["old documents from 2023", "old", "documents", "2023", "a.txt", "4096"]
    )


def test_an_action_in_words_names_its_words_of_three_characters_or_more():
    assert T.action_strings("take red apple from counter") == ["take", "red", "apple", "counter"]
    assert T.action_strings("7 May 2023, in Paris_x") == ["May", "2023", "Paris"]


def test_labels_are_the_tokens_that_overlap_an_occurrence_of_a_value(tokenizer):
    """The positives, against the tokenizer's character offsets: every token whose span overlaps one
    of the occurrences of a value, case ignored; candidates are a subset of positions; special
    tokens are ignored."""
    text = "<|im_start|>user\nopen Documents/notes.txt then ls documents<|im_end|>"
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    spans = [(i, i + len("documents")) for i in (text.lower().find("documents"), text.lower().rfind("documents"))]
    expected = torch.tensor([float(any(lo < hi_s and hi > lo_s for lo_s, hi_s in spans)) for lo, hi in offsets])
    positions = torch.tensor(
        [p for p in range(len(ids)) if p % 3 != 2 or p == len(ids) - 1]
    )  # candidates: a subset, <|im_end|> in it
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    special = set(tokenizer.all_special_ids)
    labels = T.label_row(ids, positions, ["DOCUMENTS"], pieces, special)
    want = expected[positions]
    want[torch.tensor([ids[p] in special for p in positions.tolist()])] = -1.0
    assert want.eq(1).any() and want.eq(-1).any()  # the case covers both
    assert labels.tolist() == want.tolist()


def test_the_split_is_by_trajectory_stable_and_near_its_share():
    ids = [f"game{i}" for i in range(2000)]
    held = [t for t in ids if T.held_out(t, 0.5)]
    assert held == [t for t in ids if T.held_out(t, 0.5)]  # the same ids every time
    assert 0.45 < len(held) / len(ids) < 0.55
    assert set(t for t in ids if T.held_out(t, 0.2)) <= set(held)  # a smaller share is a subset
