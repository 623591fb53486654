"""Which memory blocks a prompt needs (MemArt 3.2.2): AABB bounds, normalised, aggregated, top-k.

For every layer, query head and prompt token, each block's relevance is the AABB upper bound of
the token's attention logit over the block's keys (kernels/aabb_score.py), at the attention's
temperature 1/sqrt(head_dim). Bounds of different tokens are not comparable, so each (layer, head,
token) row is first normalised over the blocks (softmax, or reciprocal rank 1/(rank + c) with rank 1
the best block), then aggregated over the tokens (sum or max).

Layers and heads are then averaged: one block set serves every layer and head, because the blocks
become a single token prefix in the radix tree, which a per-layer or per-head choice could not be.
The mean gives every (layer, head) pair one equal vote after normalisation; a max over them would
let the single most peaked head decide for all of them.
"""

from __future__ import annotations

import math

import torch

from sgl_memory.kernels.aabb_score import aabb_scores


def softmax_norm(logits: torch.Tensor, rr_constant: float) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


def rr_norm(logits: torch.Tensor, rr_constant: float) -> torch.Tensor:
    order = logits.argsort(dim=-1, descending=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(1, logits.shape[-1] + 1).expand_as(order))
    return 1.0 / (ranks.float() + rr_constant)


NORMS = {"softmax": softmax_norm, "rr": rr_norm}
AGGS = {"sum": lambda x, dim: x.sum(dim), "max": lambda x, dim: x.amax(dim)}


def block_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, norm: str, agg: str,
                 rr_constant: float = 60.0) -> torch.Tensor:  # fmt: skip
    """q [L, T, H, D] position-free prompt queries; lo, hi [L, N, Hkv, D] block AABBs -> scores [N]."""
    logits = aabb_scores(q, lo, hi) / math.sqrt(q.shape[-1])  # [L, T, H, N]
    per_token = NORMS[norm](logits, rr_constant)
    return AGGS[agg](per_token, 1).mean(dim=(0, 1))


def top_blocks(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the k best blocks, best first."""
    return scores.topk(min(k, scores.numel())).indices.tolist()
