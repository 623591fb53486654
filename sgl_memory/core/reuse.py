"""Reusable KV placed among a request's new tokens: what a mechanism that places KV (memory) leaves
for the one that repairs it (keep), so that neither imports the other.

KV memory places blocks whose KV was computed in other contexts. Reused as a prefix hit, that KV
is never recomputed ("full reuse"). When the request asks for a repair, memory makes the blocks'
tokens part of the request's prefill instead and answers `Mechanism.placed_kv` with a `ReusedKV`:
the mechanism that declares the repair asked for (Mechanism.repairs: keep) asks the tree for it
(KVHost.placed_kv) and writes the placed KV over the rows it decides not to recompute, layer by
layer, inside the forward (keep/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReusedKV:
    """The KV a mechanism placed among a request's new tokens, with the repair asked for: what the
    repairing mechanism reads (KVHost.placed_kv)."""

    start: int  # request position of the first placed token; the placed tokens are [start, start + M)
    keys: torch.Tensor  # [layers, M, kv heads, head dim], post-RoPE at positions start..start+M-1, host memory
    values: torch.Tensor  # [layers, M, kv heads, head dim]
    segments: list[int]  # token counts of the placed segments (memory blocks), in order; they sum to M
    method: str  # the repair asked for: one the repairer declares (Mechanism.repairs, mechanism.repairer)

    @property
    def end(self) -> int:
        return self.start + self.keys.shape[1]

    def segment_of_token(self) -> torch.Tensor:
        """[M] the segment index of each placed token."""
        return torch.repeat_interleave(torch.arange(len(self.segments)), torch.tensor(self.segments))
