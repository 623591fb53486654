"""Text-level prefix matching of a new prompt against a stored session path.

A session's next prompt re-renders the previous turn's answer through the chat template and
tokenizes the whole text again; the new token ids can differ from the generated ones around the
seams (a merge across the answer's end, a different split of the same characters), and a token-level
match stops at the first such difference. Comparing text instead finds how much of the stored path
the new prompt really repeats. The request's ids are then rewritten to the stored ids for that part
plus the tokenization of the rest, so the stored KV is reused whole:

- EXACT: the prompt text is the stored text;
- EXTEND: the prompt text starts with the stored text: reuse every stored token, tokenize only the
  new suffix;
- DIVERGE: the texts part at some character: reuse the stored tokens whose text ends at or before
  it (the last safe token boundary) when at least `threshold` of the stored text matches;
- DISCARD: less than that matches: the stored path is not used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sgl_memory.core.tree_fill import common_prefix

EXACT, EXTEND, DIVERGE, DISCARD = "exact", "extend", "diverge", "discard"


@dataclass(frozen=True)
class TextMatch:
    """A prompt's text matched against a stored path: the outcome (EXACT, EXTEND, DIVERGE or
    DISCARD), the stored tokens reused and the request's ids."""

    outcome: str
    reuse: int  # stored tokens the request reuses
    input_ids: list[int]  # the request's ids: stored[:reuse] + the tokenization of the rest
    matched_chars: int


def match(
    stored: Sequence[int],
    stored_text: str,
    prompt_ids: Sequence[int],
    prompt_text: str,
    decode: Callable[[Sequence[int]], str],
    encode: Callable[[str], list[int]],
    threshold: float,
) -> TextMatch:
    stored, prompt_ids = list(stored), list(prompt_ids)
    chars = common_prefix(stored_text, prompt_text)
    if chars == len(stored_text):
        outcome = EXACT if chars == len(prompt_text) else EXTEND
        if prompt_ids[: len(stored)] == stored:
            return TextMatch(outcome, len(stored), prompt_ids, chars)  # the tokens agree already
        return TextMatch(outcome, len(stored), stored + encode(prompt_text[chars:]), chars)
    if chars < threshold * len(stored_text):
        return TextMatch(DISCARD, 0, prompt_ids, chars)
    # the longest stored prefix whose text the prompt repeats; decoding is monotone in j up to
    # partial multi-byte characters, so bisect on the prefix test itself
    tokens_agree = common_prefix(stored, prompt_ids)
    lo, hi = tokens_agree, len(stored)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prompt_text.startswith(decode(stored[:mid])):
            lo = mid
        else:
            hi = mid - 1
    head = decode(stored[:lo])
    if lo <= tokens_agree or not prompt_text.startswith(head):
        return TextMatch(DIVERGE, tokens_agree, prompt_ids, chars)  # text finds no more than tokens
    return TextMatch(DIVERGE, lo, stored[:lo] + encode(prompt_text[len(head) :]), chars)


class TextCodec:
    """The server's tokenizer as persistence uses it: a stored path's text (special tokens kept)
    and a new suffix's ids (none added). None until the first request brings the scheduler's, and
    under --skip-tokenizer-init (token-level reuse only)."""

    def __init__(self) -> None:
        self.tokenizer = None

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
