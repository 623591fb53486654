"""SentenceKV's settings: the `sentencekv:` config section and a request's overrides of it
(`sgl_memory.sentencekv`: the same keys)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from sgl_memory.core.config import MAX_BUDGET, choices, require
from sgl_memory.core.request import RequestPart, choice, flag, integer, number, object_at
from sgl_memory.core.spans import RoleFamily

MAX_FACTOR = 64.0
MAX_WINDOW = 1024
MAX_SENTENCE = 4096
MAX_INTERVAL = 1 << 16


@dataclass(frozen=True)
class SentenceKVConfig:
    """Sentence-level KV with decode-time retrieval (SentenceKV, Zhu et al.): see
    sgl_memory/sentencekv/README.md. The paper's values where it gives them (budget, keep_factor,
    window); the others are ours, said so below."""

    enabled: bool = False  # decode steps read retrieved sentences instead of every prompt position
    # tau: the most prompt tokens a decode step reads from the retrieved sentences (paper: 1024)
    budget: int = 1024
    # r: the prefill keeps the ceil(r * budget) highest-scoring prompt tokens as the semantic pool
    # the sentences are retrieved from; the rest is never read again (paper: 2 or 3)
    keep_factor: float = 2.0
    window: int = 32  # N: the observation window, the prompt's last rows, whose attention scores tokens (paper: 32)
    # always read, besides the window itself: the first tokens (attention sinks) and the prompt's
    # last `recent` rows (ours: the paper leaves both unsaid; 4 sinks as StreamingLLM, the window)
    sinks: int = 4
    recent: int = 32  # the prompt's last rows always read (see sinks)
    # ours: also always read the prompt's first message when it is a system message (an agent's tool
    # schemas and call format, which a decode step's retrieval may not bring back), found by the
    # chat template's role markers of the `roles` family
    system: bool = False
    roles: RoleFamily = "chatml"  # the chat template family whose role markers find the system message
    max_sentence: int = 64  # a sentence longer than this is cut into pieces of it (ours: the paper has no cap)
    # the tokens whose text ends a sentence (a trailing space ignored): ours, the paper names
    # periods and question marks
    boundaries: str = ".!?\n"
    interval: int = 1  # decode steps between retrievals; in between, a step reads the last retrieval's sentences
    # sentence: the paper's method. page: the Quest-style baseline it is measured against: no pool
    # (every prompt token stays readable), pages of `page_size` positions instead of sentences,
    # scored by the step's own query against each page's element-wise key bounds (Tang et al.)
    selection: Literal["sentence", "page"] = "sentence"
    page_size: int = 16  # positions per page of selection: page

    def validate(self, path: str) -> None:
        require(1 <= self.budget <= MAX_BUDGET, f"{path}.budget", f"an integer in [1, {MAX_BUDGET}]")
        require(1.0 <= self.keep_factor <= MAX_FACTOR, f"{path}.keep_factor", f"a number in [1, {MAX_FACTOR:g}]")
        require(1 <= self.window <= MAX_WINDOW, f"{path}.window", f"an integer in [1, {MAX_WINDOW}]")
        require(0 <= self.sinks <= MAX_WINDOW, f"{path}.sinks", f"an integer in [0, {MAX_WINDOW}]")
        require(0 <= self.recent <= MAX_BUDGET, f"{path}.recent", f"an integer in [0, {MAX_BUDGET}]")
        require(1 <= self.max_sentence <= MAX_SENTENCE, f"{path}.max_sentence", f"an integer in [1, {MAX_SENTENCE}]")
        require(bool(self.boundaries), f"{path}.boundaries", "a non-empty string of characters")
        require(1 <= self.interval <= MAX_INTERVAL, f"{path}.interval", f"an integer in [1, {MAX_INTERVAL}]")
        require(1 <= self.page_size <= MAX_SENTENCE, f"{path}.page_size", f"an integer in [1, {MAX_SENTENCE}]")

    @property
    def pool(self) -> int:
        """The size of the semantic pool: ceil(keep_factor * budget); page selection keeps every token."""
        return math.ceil(self.keep_factor * self.budget) if self.selection == "sentence" else MAX_BUDGET


OVERRIDES = tuple(f.name for f in fields(SentenceKVConfig) if f.name not in ("boundaries", "roles"))


@dataclass(frozen=True)
class SentenceKVRequest(RequestPart):
    """`sgl_memory.sentencekv`: a request's overrides of the server's section (None: the server's
    value); `enabled: false` serves the request with the full cache."""

    enabled: bool | None = None
    budget: int | None = None
    keep_factor: float | None = None
    window: int | None = None
    sinks: int | None = None
    recent: int | None = None
    system: bool | None = None
    max_sentence: int | None = None
    interval: int | None = None
    selection: str | None = None
    page_size: int | None = None


def parse_request(raw: dict, internal: bool = False) -> SentenceKVRequest | None:
    body, where = object_at(raw, "sentencekv", OVERRIDES)
    if body is None:
        return None
    return SentenceKVRequest(
        enabled=flag(body.get("enabled"), f"{where}.enabled"),
        budget=integer(body.get("budget"), 1, MAX_BUDGET, f"{where}.budget"),
        keep_factor=number(body.get("keep_factor"), 1.0, MAX_FACTOR, f"{where}.keep_factor"),
        window=integer(body.get("window"), 1, MAX_WINDOW, f"{where}.window"),
        sinks=integer(body.get("sinks"), 0, MAX_WINDOW, f"{where}.sinks"),
        recent=integer(body.get("recent"), 0, MAX_BUDGET, f"{where}.recent"),
        system=flag(body.get("system"), f"{where}.system"),
        max_sentence=integer(body.get("max_sentence"), 1, MAX_SENTENCE, f"{where}.max_sentence"),
        interval=integer(body.get("interval"), 1, MAX_INTERVAL, f"{where}.interval"),
        selection=choice(body.get("selection"), choices(SentenceKVConfig, "selection"), f"{where}.selection"),
        page_size=integer(body.get("page_size"), 1, MAX_SENTENCE, f"{where}.page_size"),
    )
