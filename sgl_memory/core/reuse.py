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


def prefill_cost(
    prompt_tokens: int, cached_tokens: int, reused_tokens: int, in_prefill: bool, recomputed: int, layers: int
) -> dict:
    """What a request that placed memory KV paid for its prefill, in the fields every memory-mode
    response carries (memory reports it where nothing repairs the blocks, the repairer where it does).

    `reused_tokens` are placed tokens whose KV came from memory (none when the blocks were prefilled
    as text); `in_prefill` says whether they ran in the prefill's batch (a repair runs them through
    its layers) or came as a prefix hit. `prefill_tokens` is then the prompt's tokens computed at
    every layer (the question, and the blocks prefilled as text), never the placed ones; the repair's
    share of them is `recomputed_token_layers` (tokens times the layers each was recomputed at).
    `full_prefill_token_layers` is what prefilling the same uncached tokens would have cost without
    memory; `prefill_work_share` is the work done over it."""
    computed = prompt_tokens - cached_tokens - (reused_tokens if in_prefill else 0)
    full = (computed + reused_tokens) * layers
    work = computed * layers + recomputed
    return {
        "prefill_tokens": computed,
        "reused_tokens": reused_tokens,
        "recomputed_token_layers": recomputed,
        "prefill_token_layers": work,
        "full_prefill_token_layers": full,
        "prefill_work_share": round(work / full, 6) if full else 0.0,
    }
