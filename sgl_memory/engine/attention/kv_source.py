"""Where one request's keys live in the KV pool, read through its slot map.

A request's slots are usually a few contiguous runs: a fresh prefill gets consecutive slots, and a
radix hit adds the run of the cached prefix. Attention can read a run as a view of the pool (no
copy), so the slot list is kept as runs; only a fragmented list (after eviction churn, or a pruned
row) is gathered, once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Past this many runs, one gather is cheaper than one attention call per run.
MAX_RUNS = 4


@dataclass(frozen=True)
class KvSource:
    """Where one request's keys lie in the KV pool: contiguous runs of slots, or the slot list
    itself when it is too fragmented for runs."""

    runs: tuple[tuple[int, int], ...] = ()  # [start, stop) ranges of pool slots, in position order
    slots: torch.Tensor | None = None  # the slot list itself, when it is too fragmented for runs

    def read(self, cache: torch.Tensor) -> list[torch.Tensor]:
        """The source's rows of one layer's cache [pool, heads, dim], as views where possible."""
        if self.slots is not None:
            return [cache[self.slots]]
        return [cache[start:stop] for start, stop in self.runs]

    def read_joined(self, cache: torch.Tensor) -> torch.Tensor:
        """The same rows as one tensor (a view when they are one run)."""
        parts = self.read(cache)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def locate(slots: torch.Tensor, max_runs: int = MAX_RUNS) -> KvSource:
    """Describe a 1-D slot list as contiguous runs, or as itself when it has more than max_runs."""
    if slots.numel() == 0:
        return KvSource()
    breaks = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
    if len(breaks) >= max_runs:
        return KvSource(slots=slots)
    bounds = [0, *breaks, slots.numel()]
    firsts = slots[bounds[:-1]].tolist()
    return KvSource(runs=tuple((first, first + stop - start) for first, start, stop in zip(firsts, bounds, bounds[1:])))
