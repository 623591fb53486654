"""Text-level prefix matching on the real SmolLM2 tokenizer, against brute-force references:
the rewritten prompt must say the same text, start with the reused stored tokens, and reuse the
longest stored prefix whose text the prompt repeats (found by a linear scan)."""

from __future__ import annotations

import pytest

from servers import TEST_MODEL
from sgl_memory import models
from sgl_memory.persist import textmatch
from sgl_memory.core.tree_fill import common_prefix


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.model_dir(TEST_MODEL))


def run(tok, stored_text, prompt_text, threshold=0.5):
    stored = tok.encode(stored_text, add_special_tokens=False)
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
    encode = lambda text: tok.encode(text, add_special_tokens=False)
    return stored, prompt, textmatch.match(stored, decode(stored), prompt, decode(prompt), decode, encode, threshold)


def longest_repeated_prefix(tok, stored, prompt_text):
    return max(
        j for j in range(len(stored) + 1) if prompt_text.startswith(tok.decode(stored[:j], skip_special_tokens=False))
    )


CHAT = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a sea.<|im_end|>\n<|im_start|>assistant\n"


def test_exact_and_plain_extend_keep_the_prompt_tokens(tok):
    stored, prompt, m = run(tok, CHAT, CHAT)
    assert (m.outcome, m.reuse, m.input_ids) == (textmatch.EXACT, len(stored), prompt)
    stored, prompt, m = run(tok, CHAT, CHAT + "The Baltic Sea.")
    assert m.outcome == textmatch.EXTEND and m.reuse == len(stored)
    assert m.input_ids == prompt  # the tokens agree already: nothing is rewritten


def test_extend_across_a_token_boundary_reuses_the_whole_stored_path(tok):
    # the stored path ends inside what the next prompt tokenizes as one token
    stored_text, prompt_text = CHAT + "The Baltic Se", CHAT + "The Baltic Sea.<|im_end|>\n<|im_start|>user\nMore?"
    stored, prompt, m = run(tok, stored_text, prompt_text)
    assert common_prefix(stored, prompt) < len(stored)  # a token-level match falls short
    assert m.outcome == textmatch.EXTEND and m.reuse == len(stored)
    assert m.input_ids[: len(stored)] == stored
    assert tok.decode(m.input_ids, skip_special_tokens=False) == prompt_text


def test_diverge_reuses_up_to_the_last_safe_boundary(tok):
    stored_text = CHAT + "The Baltic Sea is cold and brackish, and it freezes in winter."
    prompt_text = CHAT + "The Baltic Sea is cold and salty.<|im_end|>"
    stored, prompt, m = run(tok, stored_text, prompt_text)
    assert m.outcome == textmatch.DIVERGE
    assert m.reuse == longest_repeated_prefix(tok, stored, prompt_text)
    assert m.reuse > common_prefix(stored, prompt) or m.input_ids == prompt
    assert m.input_ids[: m.reuse] == stored[: m.reuse]
    assert tok.decode(m.input_ids, skip_special_tokens=False) == prompt_text


def test_little_shared_text_is_discarded(tok):
    stored, prompt, m = run(tok, CHAT + "x" * 400, CHAT + "y")
    assert m.outcome == textmatch.DISCARD and m.reuse == 0 and m.input_ids == prompt
    # the same texts pass a lower threshold
    assert run(tok, CHAT + "x" * 400, CHAT + "y", threshold=0.1)[2].outcome == textmatch.DIVERGE
