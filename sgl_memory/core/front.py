"""What a mechanism's HTTP side may ask of the engine (HTTP process), without touching SGLang.

Two things, implemented by engine/front.py over SGLang's tokenizer manager:
- `Incoming`: a generate request on its way in (native or OpenAI, before tokenization), which a
  mechanism's `Mechanism.before_generate` sees and may rewrite (KV memory sends a query pass of the
  same prompt first and points the request at it);
- `Engine`: the server's own passes. A mechanism sends prefill-only passes that carry its internal
  `sgl_memory` keys (a client cannot send those: the field parser refuses them on client requests);
  they reach the scheduler like any request and skip every `before_generate`.
"""

from __future__ import annotations

from typing import Protocol

from sgl_memory.core.spans import RoleMarkers


class Incoming(Protocol):
    """One generate request as the HTTP process receives it."""

    def fields(self) -> list:
        """The raw `sgl_memory` field of each of its prompts' sampling params (None where a prompt
        has none); one item for a request that is not a batch. Raises request.SpecError for a
        field that is not JSON."""

    def batched(self) -> bool:
        """Whether it carries several prompts (a list of texts or of token-id lists)."""

    def set_field(self, raw: dict) -> None:
        """Replace the `sgl_memory` field of its one prompt (not a batch) by `raw`."""

    def prompt_ids(self) -> list[int] | None:
        """Its one prompt's token ids when it came as ids (an OpenAI chat request does); None for a
        text prompt or a batch."""

    def prompt_text(self) -> str | None:
        """Its one prompt when it came as text (a native /generate with `text`); None for ids or a batch."""

    def set_prompt_ids(self, ids: list[int]) -> None:
        """Make its one prompt these token ids (a text prompt becomes them)."""

    def reads_prompt_logprobs(self) -> bool:
        """Whether it asks for log-probabilities of prompt tokens (at the client's positions)."""


class Engine(Protocol):
    """The engine as a mechanism's HTTP side uses it. The tokenizer is there once the server runs
    (a route uses it, `mount` does not)."""

    def tokenize(self, text: str) -> list[int]:
        """The text's token ids, without special tokens."""

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's token ids as SGLang tokenizes a `text` request (the tokenizer's own
        special tokens included)."""

    def decode(self, ids: list[int]) -> str:
        """The ids' text, without special tokens."""

    def markers(self, family: str) -> RoleMarkers:
        """The chat template family's role markers in this model's tokenizer (spans.RoleMarkers)."""

    def context_len(self) -> int:
        """The longest prompt plus output the model takes, in tokens."""

    async def prefill(self, raw: dict, input_ids: list[int] | None = None, like: Incoming | None = None) -> dict:
        """Send one prefill-only pass whose `sgl_memory` field is `raw`: over `input_ids`, or over
        the prompt of `like` (its text or ids, adapter and cache key). Returns its meta_info (the
        scheduler's metrics of the pass under request.FIELD; an abort in its finish_reason)."""
