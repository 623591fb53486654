"""KV memory's settings: the `memory:` config section and the per-request `sgl_memory.memory` object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sgl_memory.core.config import MAX_BUDGET, ConfigError, choices, require
from sgl_memory.core.request import FIELD, RequestPart, SpecError, choice, flag, integer, number, object_at
from sgl_memory.core.mechanism import repairer
from sgl_memory.core.spans import RoleFamily


@dataclass(frozen=True)
class MemArtConfig:
    """KV memory blocks retrieved per request (MemArt): see sgl_memory/memart/README.md."""

    enabled: bool = False  # record sessions' turns into their memory pools and serve memory-mode requests
    block_size: int = 16  # tokens per memory block (with cut: lines a block also ends at a line end)
    top_k: int = 1024  # ranked blocks considered; placed_tokens decides what is placed
    # each query token's block scores normalised: softmax, or reciprocal rank (rr)
    norm: Literal["softmax", "rr"] = "softmax"
    agg: Literal["sum", "max"] = "max"  # a block's score over the query tokens: their sum or their max
    capacity_blocks: int = 4096  # per session; beyond it the eviction policy drops (or merges) blocks
    pool_bytes: int = 4 << 30  # host memory of all sessions' pools; least recently used sessions go first
    # past capacity_blocks: drop the least recently retrieved (lru) or oldest (fifo) block, or merge
    # the neighbouring pair that stands for the fewest session tokens into one (merge)
    eviction: Literal["lru", "fifo", "merge"] = "lru"
    scoring: Literal["exact", "aabb"] = "exact"  # a block's logit: its best key's, or the AABB bound
    score_layers: float = 0.5  # the share of layers, from the first, whose queries score blocks
    score_tokens: Literal["text", "query", "all"] = "text"  # text: the last user turn without markup
    roles: RoleFamily = "chatml"  # chat template family that marks turns
    placement: Literal["first", "after_system"] = "first"  # where the blocks go in the prompt
    rr_constant: float = 60.0  # c in 1 / (rank + c)
    cut: Literal["tokens", "lines"] = "lines"  # lines: a block also ends after each line end; tokens: block_size alone
    # placed with each chosen block: the first block of its turn (turn), of its line (line, where
    # blocks are cut at lines), or both; a block from the middle of a turn then has its context
    header: Literal["none", "turn", "line", "turn_line"] = "none"
    # what a chosen block brings with it: nothing more (block), or the rest of its line (line: a
    # dialogue turn, a tool result's row, whole; needs cut: lines)
    unit: Literal["block", "line"] = "line"
    # memory tokens placed at most per request, units and headers included (0: top_k alone bounds them)
    placed_tokens: int = 2048
    # what repairs the placed blocks' KV (computed in other contexts): none (reused as placed), starts
    # (their first tokens recomputed: the assembly's first token becomes an attention sink), keep and
    # cacheblend (a selected share), random (a share at random: the baseline; these four run in
    # sgl_memory/keep, on with memory unless its section says), full (the blocks' tokens prefilled
    # again in the request's context)
    recompute: Literal["none", "keep", "cacheblend", "starts", "random", "full"] = "starts"
    # memory entries written by key (POST /sgl_memory/memory/write, memart/entries.py): grouped by
    # MiniLM sentence embeddings (an entry joins the nearest group at cosine >= group_threshold); a
    # group unchanged for static_after writes gets a joint KV and is retrieved as one unit
    groups: bool = True
    group_threshold: float = 0.4  # the cosine at which an entry joins the nearest group
    static_after: int = 3  # writes a group stays unchanged before it gets a joint KV
    # a full-history session request (no `memory` object) whose history is longer than this many
    # tokens is served in memory mode: its last `window` tokens of messages stay in the prompt, the
    # older turns come back from the session's memory (memart/window.py); 0: off
    window: int = 0
    # `memory: {mode: text}` (memart/text.py): the lines retrieved from the session's turns open its
    # last user message under this line
    text_header: str = "Earlier in this conversation:\n"

    def validate(self, path: str) -> None:
        require(self.block_size >= 1, f"{path}.block_size", "an integer >= 1")
        require(-1 <= self.group_threshold <= 1, f"{path}.group_threshold", "a number in [-1, 1]")
        require(self.static_after >= 1, f"{path}.static_after", "an integer >= 1")
        require(self.top_k >= 1, f"{path}.top_k", "an integer >= 1")
        require(self.capacity_blocks >= 1, f"{path}.capacity_blocks", "an integer >= 1")
        require(self.pool_bytes >= 1, f"{path}.pool_bytes", "an integer >= 1")
        require(self.rr_constant >= 0, f"{path}.rr_constant", "a number >= 0")
        require(0 < self.score_layers <= 1, f"{path}.score_layers", "a number in (0, 1]")
        require(self.placed_tokens >= 0, f"{path}.placed_tokens", "an integer >= 0")
        require(self.window >= 0, f"{path}.window", "an integer >= 0 (tokens; 0: off)")
        require(
            self.unit != "line" or self.cut == "lines",
            f"{path}.unit",
            "block, or line with cut: lines (lines are known where blocks are cut at them)",
        )


MODES = ("retrieve", "text")
INTERNAL_MODES = ("probe", "write", "forget", "turns")  # sent by the server's own HTTP side only
MAX_TOP_K = 1 << 16
NAMED = ("norm", "agg", "scoring", "placement", "header", "unit", "recompute")  # options named in the section
CLIENT_KEYS = ("mode", "top_k", *NAMED, "store", "placed_tokens")
INTERNAL_KEYS = (
    "probe",
    "entry",
    "embedding",
    "group",
    "version",
    "forget",
    "windowed",
    "text_span",
    "text_lines",
    "text_ms",
)


@dataclass(frozen=True)
class MemArtRequest(RequestPart):
    """`sgl_memory.memory`: the request carries only its new turn and the server places the
    session's relevant memory blocks before it (None: the server's value of the section)."""

    mode: str = "retrieve"
    top_k: int | None = None
    norm: str | None = None
    agg: str | None = None
    scoring: str | None = None
    placement: str | None = None
    store: bool = True  # False: this turn is not added to the session's memory
    header: str | None = None
    unit: str | None = None
    placed_tokens: int | None = None  # 0: no cap
    recompute: str | None = None  # a repair of the placed blocks (KEEP's knobs are `sgl_memory.keep`)
    probe: str | None = None  # internal: the id of the query pass the HTTP hook ran first
    windowed: int = 0  # internal: history tokens the HTTP hook left out of a full-history request (window.py)
    # internal, mode "text" (text.py): the prompt positions [start, end) of the lines the HTTP side
    # placed, how many lines and its retrieval's milliseconds; mode "turns" asks for the session's
    # recorded token ids
    text_span: tuple[int, int] | None = None
    text_lines: int = 0
    text_ms: float = 0.0
    # internal, the memory entries API (memart/writes.py): mode "write" records the prompt as the
    # entry `entry` (with its sentence `embedding`) or as the joint KV of group `group` at `version`;
    # mode "forget" drops the entries `forget`
    entry: str | None = None
    embedding: tuple[float, ...] | None = None
    group: int | None = None
    version: int | None = None
    forget: tuple[str, ...] = ()

    @property
    def internal(self) -> bool:
        return self.mode in INTERNAL_MODES

    @property
    def transient(self) -> bool:
        # the query pass computes its prompt for retrieval and leaves nothing behind (memart/probe.py)
        return self.mode == "probe"

    @property
    def reads_only(self) -> bool:
        # a probe, a forget of no keys (the entries API reading a session's book), text mode's read
        # of the session's turns
        return self.mode in ("probe", "turns") or (self.mode == "forget" and not self.forget)

    @property
    def assembles(self) -> bool:
        return True


def parse_request(raw: dict, internal: bool) -> MemArtRequest | None:
    body, where = object_at(raw, "memory", CLIENT_KEYS + (INTERNAL_KEYS if internal else ()))
    if body is None:
        return None
    mode = choice(body.get("mode", "retrieve"), MODES + (INTERNAL_MODES if internal else ()), f"{where}.mode")
    named = {k: choice(body.get(k), choices(MemArtConfig, k), f"{where}.{k}") for k in NAMED}
    probe = body.get("probe")
    if probe is not None and not isinstance(probe, str):
        raise SpecError(f"{where}.probe must be a string")
    if raw.get("session_id") is None:
        raise SpecError(f"{where} needs {FIELD}.session_id: memory belongs to a session")
    embedding = body.get("embedding")
    span = body.get("text_span")
    return MemArtRequest(
        mode,
        integer(body.get("top_k"), 1, MAX_TOP_K, f"{where}.top_k"),
        store=flag(body.get("store", True), f"{where}.store"),
        placed_tokens=integer(body.get("placed_tokens"), 0, MAX_BUDGET, f"{where}.placed_tokens"),
        probe=probe,
        entry=body.get("entry"),
        embedding=None if embedding is None else tuple(embedding),
        group=body.get("group"),
        version=body.get("version"),
        forget=tuple(body.get("forget", ())),
        windowed=integer(body.get("windowed"), 0, MAX_BUDGET, f"{where}.windowed") or 0,
        text_span=None if span is None else (int(span[0]), int(span[1])),
        text_lines=integer(body.get("text_lines"), 0, MAX_BUDGET, f"{where}.text_lines") or 0,
        text_ms=number(body.get("text_ms"), 0, float("inf"), f"{where}.text_ms") or 0.0,
        **named,
    )


def check_request(part: MemArtRequest, config) -> None:
    if part.mode == "text":
        kv_only = [k for k in NAMED if getattr(part, k) is not None]
        if kv_only:
            raise SpecError(
                f"{FIELD}.memory.{kv_only[0]} places KV blocks; mode 'text' places the session's lines as "
                "prompt text (top_k, placed_tokens and store apply)"
            )
    if part.unit == "line" and config.of(MemArtConfig).cut != "lines":
        raise SpecError(
            f"{FIELD}.memory.unit 'line': this server cuts memory blocks by tokens, not at lines "
            "(memory.cut: tokens), so it does not know its blocks' lines"
        )
    repairs = repairer(part.recompute) if part.recompute is not None else None
    if repairs is not None and not config.section(repairs).enabled:
        raise SpecError(
            f"{FIELD}.memory.recompute {part.recompute!r}: the repair of memory blocks is off on this "
            f"server ({repairs}.enabled: false)"
        )


def check_config(config) -> None:
    memory = config.of(MemArtConfig)
    repair = memory.recompute
    repairs = repairer(repair)
    if memory.enabled and repairs is not None and not config.section(repairs).enabled:
        raise ConfigError(f"memory.recompute: {repair!r} needs {repairs}.enabled: true")
