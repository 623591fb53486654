"""Which memory blocks a prompt needs (MemArt 3.2.2): block logits, normalised, aggregated, top-k.

A block's logit for one (layer, query head, prompt token) is, at the attention's temperature
1/sqrt(head_dim), either
- `exact`: the largest q.k over the block's own keys, the attention logit of its best key; or
- `aabb`: the AABB upper bound of that (kernels/aabb_score.py), MemArt's compressed key.
Measured on LoCoMo with the default model (bench/locomo/retrieval_study.py), the 16-token AABB is
nearly the same for every question (two questions share 96% of their top-64 blocks: the width of
the boxes decides, not the question), and finds the evidence turns about as often as random blocks;
the exact maximum finds most of them. Both read only the layers the index holds (blocks.ScoreKeys:
position-free keys in the pool's dtype; the boxes are taken from them when `aabb` asks).

Logits of different tokens are not comparable, so each (layer, head, token) row is normalised over
the blocks (softmax, or reciprocal rank 1/(rank + c) with rank 1 the best block), then aggregated
over the tokens (sum or max). Layers and heads are then averaged: one block set serves every layer
and head, because the blocks become a single token prefix in the radix tree, which a per-layer or
per-head choice could not be. The mean gives every (layer, head) pair one equal vote after
normalisation; a max over them would let the single most peaked head decide for all of them.
Under tensor parallelism a rank holds a share of the heads: that mean is combined over the ranks
(`reduce`, the tree's reduce_heads), so every rank ranks the blocks as one rank with every head.
"""

from __future__ import annotations

import math

import torch

from sgl_memory.core.kvhost import Reduce, one_rank
from sgl_memory.kernels.aabb_score import aabb_scores
from sgl_memory.memart.blocks import BlockIndex

EXACT_CHUNK = 256  # blocks per step of the exact scan: bounds the [L, T, H, blocks, block_size] product
SCAN_BYTES = 256 << 20  # transient memory of one scoring pass, whatever the prompt length and pool size


def aabb_logits(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """q [L, T, H, D]; lo, hi [L, N, Hkv, D] -> [L, T, H, N]."""
    return aabb_scores(q, lo, hi) / math.sqrt(q.shape[-1])


def exact_logits(q: torch.Tensor, index: BlockIndex) -> torch.Tensor:
    """q [L, T, H, D]; the index's N blocks -> the largest logit over each block's keys, [L, T, H, N]."""
    L, T, H, D = q.shape
    N, Hkv = len(index.ids), index.keys.shape[2]
    grouped = q.float().view(L, T, Hkv, H // Hkv, D)  # query heads that read the same KV head
    out = torch.empty(L, T, H, N)
    for n0 in range(0, N, EXACT_CHUNK):
        chunk = index.block_keys(n0, n0 + EXACT_CHUNK).float()  # [L, n, S, Hkv, D], short blocks padded
        best = torch.einsum("ltkgd,lnskd->ltkgns", grouped, chunk).amax(-1)
        out[..., n0 : n0 + chunk.shape[1]] = best.reshape(L, T, H, -1)
    return out / math.sqrt(D)


def softmax_norm(logits: torch.Tensor, rr_constant: float) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


def rr_norm(logits: torch.Tensor, rr_constant: float) -> torch.Tensor:
    order = logits.argsort(dim=-1, descending=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(1, logits.shape[-1] + 1).expand_as(order))
    return 1.0 / (ranks.float() + rr_constant)


NORMS = {"softmax": softmax_norm, "rr": rr_norm}
AGGS = {"sum": lambda x, dim: x.sum(dim), "max": lambda x, dim: x.amax(dim)}


def block_scores(logits: torch.Tensor, norm: str, agg: str, rr_constant: float = 60.0) -> torch.Tensor:
    """Block logits [L, T, H, N] -> one score per block [N]."""
    per_token = NORMS[norm](logits, rr_constant)
    return AGGS[agg](per_token, 1).mean(dim=(0, 1))


def score_blocks(
    q: torch.Tensor,
    index: BlockIndex,
    scoring: str,
    norm: str,
    agg: str,
    rr_constant: float = 60.0,
    cap_bytes: int = SCAN_BYTES,
    reduce: Reduce = one_rank,
) -> torch.Tensor:
    """`block_scores` of the `scoring` logits of q [L, T, H, D] over the index's blocks, computed
    over slices of the prompt tokens so that the logits and the exact scan's products stay under
    `cap_bytes`. Normalisation is per (layer, head, token) row, so the rows of one slice are final;
    the aggregation over tokens is a running sum or max, and the mean over layers and heads comes
    last (then over the TP ranks' heads: `reduce`)."""
    L, T, H, _ = q.shape
    N = len(index.ids)
    per_token = 3 * L * H * N * 4  # the slice's logits, their normalisation, one intermediate of either
    if scoring == "exact":
        per_token += L * H * min(N, EXACT_CHUNK) * index.rows.shape[1] * 4  # the scan's q.k products
    else:
        lo, hi = index.boxes()
    step = max(1, cap_bytes // max(per_token, 1))
    total = None
    for t0 in range(0, T, step):
        part = q[:, t0 : t0 + step]
        logits = exact_logits(part, index) if scoring == "exact" else aabb_logits(part, lo, hi)
        rows = AGGS[agg](NORMS[norm](logits, rr_constant), 1)  # [L, H, N]
        del logits
        if total is None:
            total = rows
        elif agg == "sum":
            total += rows
        else:
            torch.maximum(total, rows, out=total)
    return reduce(total.mean(dim=(0, 1)), "mean")


def top_blocks(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the k best blocks, best first."""
    return scores.topk(min(k, scores.numel())).indices.tolist()
