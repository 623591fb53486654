"""KEEP's settings: the `keep:` config section and the per-request overrides of it
(`sgl_memory.keep`: ratio, hops, drop_rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from sgl_memory.core.config import require
from sgl_memory.core.request import RequestPart, flag, integer, number, object_at, renamed_key

MAX_HOPS = 64  # importance propagation rounds (it stops earlier once its set is stable)
# keys renamed since an earlier release (old -> new), still read with a warning: `compact` is
# intent's layout; what KEEP does is drop rows (core/rows.py)
RENAMED = {"compact": "drop_rows"}


@dataclass(frozen=True)
class KeepConfig:
    """Recomputation of the placed memory blocks that matter (KEEP, and CacheBlend as its baseline):
    see sgl_memory/keep/README.md."""

    enabled: bool = False  # allow memory.recompute starts / keep / cacheblend; on with memory unless this says
    # share of the placed segments (keep) or tokens (cacheblend) recomputed at layer 1; layer 0
    # recomputes all of them, and layer l the share ratio ** (1 + decay * (l - 1) / (layers - 2)),
    # each layer's set inside the one before (a row dropped at a layer has no hidden state after it)
    ratio: float = 0.3
    # the same share for `starts` (the segments' first tokens, the assembly's first one first): the
    # first placed token recomputed is what closes most of the gap to a full recompute (a token
    # from the middle of a transcript is no attention sink), bench/reuse_gap.py
    starts_ratio: float = 0.01
    decay: float = 0.5  # how fast the recomputed share shrinks with depth (in the ratio formula above)
    hops: int = 4  # importance propagation rounds of keep (1: the new turn's attention alone)
    # drop the rows no later layer recomputes from the hidden states (the speed-up, on backends that
    # attend a row layout); false: write the placed KV over them at full cost (the same attention).
    # Was `compact`, which is still read
    drop_rows: bool = True
    # how the placed KV reaches each layer (keep/loading.py): when the layer starts (sync), while the
    # layer before computes (next_layer), or that plus preloading the rows no later layer
    # recomputes while the loader is idle (balanced, KEEP's layer-balanced loading)
    loading: Literal["sync", "next_layer", "balanced"] = "balanced"
    tier_bandwidth: float = 0.0  # bytes/s of a simulated slower tier for the placed KV (0: none)
    trace_dir: str = ""  # diagnostics: each repaired request's memory KV and selections, one file per request
    RENAMED: ClassVar[dict[str, str]] = RENAMED

    def validate(self, path: str) -> None:
        require(0.0 <= self.ratio <= 1.0, f"{path}.ratio", "a number in [0, 1]")
        require(0.0 <= self.starts_ratio <= 1.0, f"{path}.starts_ratio", "a number in [0, 1]")
        require(self.decay >= 0.0, f"{path}.decay", "a number >= 0")
        require(1 <= self.hops <= MAX_HOPS, f"{path}.hops", f"an integer in [1, {MAX_HOPS}]")
        require(
            self.tier_bandwidth >= 0.0,
            f"{path}.tier_bandwidth",
            "a number >= 0 (bytes per second; 0: no simulated tier)",
        )


@dataclass(frozen=True)
class KeepRequest(RequestPart):
    """`sgl_memory.keep`: a request's overrides of the repair of its placed memory blocks (None:
    the server's value). Which repair runs is KV memory's choice (`sgl_memory.memory.recompute`)."""

    ratio: float | None = None
    hops: int | None = None
    drop_rows: bool | None = None  # false: this repair keeps every row (the same attention, at full cost)


def parse_request(raw: dict, internal: bool = False) -> KeepRequest | None:
    body, where = object_at(raw, "keep", ("ratio", "hops", "drop_rows", *RENAMED))
    if body is None:
        return None
    key = renamed_key(body, "compact", "drop_rows", where)
    return KeepRequest(
        number(body.get("ratio"), 0, 1, f"{where}.ratio"),
        integer(body.get("hops"), 1, MAX_HOPS, f"{where}.hops"),
        flag(body.get(key), f"{where}.{key}"),
    )
