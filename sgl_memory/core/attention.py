"""Attention weights of captured query rows over keys read from the pool: how the prefill-time
scorers (intent's rule and SnapKV scorers, SentenceKV's observation window) weigh a prompt's tokens.
"""

from __future__ import annotations

import math

import torch


def attention_probs(keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Softmax over the candidates of each query row: keys [n, KVH, D], rows [R, H, D] -> [R, H, n].
    KV heads are expanded to the query heads (GQA) by grouping the query heads instead of copying keys.
    Computed where the keys are (the pool's device); the query states may sit on the host."""
    n, kv_heads, dim = keys.shape
    r, heads, _ = rows.shape
    grouped = rows.float().to(keys.device).view(r, kv_heads, heads // kv_heads, dim)
    logits = torch.einsum("rkgd,nkd->rkgn", grouped, keys.float()) / math.sqrt(dim)
    return torch.softmax(logits, dim=-1).reshape(r, heads, n)
