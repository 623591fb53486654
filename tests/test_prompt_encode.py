"""A chat prompt encoded in pieces (engine/prompt_encode.py) has the ids of encoding it whole, and a
turn that extends the conversation encodes only its new text.

Reference: the tokenizer's own `encode` of the whole rendered prompt, on a tokenizer object of its own.
"""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from servers import TEST_MODEL
from sgl_memory import models
from sgl_memory.engine import prompt_encode

MODELS = [models.DEFAULT_MODEL, TEST_MODEL]


class RecordingBackend:
    """The tokenizer's Rust backend, recording the texts it is asked to encode."""

    def __init__(self, backend):
        self._backend = backend
        self.encoded: list[str] = []

    def encode_batch(self, texts, *args, **kwargs):
        self.encoded.extend(texts)
        return self._backend.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def conversation(seed: int, turns: int, long_message: bool = False) -> list[dict]:
    """An agent-like history: tool results with code, numbers, unicode and stray markup, text that
    spells an added token, whitespace at message edges."""
    rng = random.Random(seed)
    words = [
        "lorem",
        "ipsum",
        "Ünïcode",
        "日本語",
        "42",
        "3.14159",
        "{'k': [1, 2]}",
        "def f(x):\n    return x",
        "\t\ttabs",
        "  spaces  ",
        "<|im_start|>",
        "<|endoftext|>",
        "<tool_call>",
        "emoji 🙂",
        "\n\n",
        "’quotes’",
    ]
    messages = [{"role": "system", "content": "You are a careful agent. " * 20}]
    for n in range(turns):
        role = ("user", "assistant", "tool")[n % 3]
        text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 200)))
        if role == "tool":
            messages.append({"role": "tool", "content": text, "tool_call_id": f"call_{n}"})
        else:
            messages.append({"role": role, "content": text})
    if long_message:  # past SGLANG_PARALLEL_PROMPT_ENCODE_MIN_CHARS: SGLang splits it inside the message too
        messages.append({"role": "user", "content": " ".join(rng.choice(words) for _ in range(12000))})
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": "And then?"})
    return messages


def render(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module", params=MODELS)
def tokenizers(request):
    path = models.model_dir(request.param)
    return AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def not_called(*args):
    raise AssertionError("SGLang's whole-prompt encode was called")


@pytest.mark.parametrize("seed", range(4))
def test_the_ids_equal_the_whole_encode(tokenizers, seed):
    ours, reference = tokenizers
    messages = conversation(seed, turns=30, long_message=seed == 3)
    text = render(reference, messages)
    for kwargs in ({"add_special_tokens": False}, None):
        assert prompt_encode.encode_hook(not_called, ours, text, kwargs) == reference.encode(text, **(kwargs or {}))


def test_a_turn_encodes_its_new_messages_only(tokenizers):
    """Turn after turn of one conversation: the same ids as the whole encode, and after the first
    turn the backend sees the new messages' text, not the history's."""
    ours, reference = tokenizers
    fresh = AutoTokenizer.from_pretrained(ours.name_or_path)  # the segment cache is per tokenizer
    fresh._tokenizer = backend = RecordingBackend(fresh._tokenizer)
    messages = conversation(7, turns=40)
    for end in range(10, len(messages) + 1, 6):
        turn = messages[:end]
        text = render(reference, turn)
        backend.encoded.clear()
        assert prompt_encode.encode_hook(not_called, fresh, text, {"add_special_tokens": False}) == reference.encode(
            text, add_special_tokens=False
        )
        if end > 10:
            new = render(reference, turn[end - 6 :])
            assert sum(map(len, backend.encoded)) <= len(new), "the history was encoded again"


def test_text_that_is_not_a_string_goes_to_sglang(tokenizers):
    ours, _ = tokenizers
    assert prompt_encode.encode_hook(lambda tok, text, kw: ("sglang", text), ours, [1, 2], None) == ("sglang", [1, 2])
