"""Attention of a request's new tokens over KV held in several parts, merged by log-sum-exp.

The keys of a request come in parts: runs of its cached prefix, which every new token sees in full,
and the new tokens' own keys, which they see causally. Attending each part separately and merging
with the parts' log-sum-exp gives exact softmax attention over the union, without building a
[new, kv_len] mask (SDPA with an explicit mask leaves the flash path) and without copying the
prefix into one tensor. The cost is proportional to new tokens x kv_len, never kv_len^2.

GQA: the G query heads that share a KV head are folded into the query length ([kv_heads, G * n]),
so keys are never repeated per query head.
"""

from __future__ import annotations

import torch

from sgl_memory.core import kv_rows

# CPU flash attention returning the log-sum-exp next to the output; public SDPA does not return it.
_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _as_heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[len, kv_heads, dim] pool rows (any pool's format, core/kv_rows.py) -> [1, kv_heads, len, dim]
    values (a view unless a cast or a decode is needed: only this part's rows, never the pool's)."""
    return kv_rows.convert(x, dtype).movedim(0, 1).unsqueeze(0)


def attend(
    q: torch.Tensor,
    visible: list[tuple[torch.Tensor, torch.Tensor]],
    own: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float | None,
) -> torch.Tensor:
    """q [n, H, D]; visible: (k, v) parts [len_i, KVH, D] seen by every query; own: the queries' own
    (k, v) [n, KVH, D], seen causally (query i sees own keys 0..i), or None. Returns [n, H, Dv]."""
    n, heads, dim = q.shape
    kv_heads = (own or visible[0])[0].shape[1]
    group = heads // kv_heads
    q_groups = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3)  # [KVH, G, n, D]

    outs, lses = [], []
    if visible:
        q_folded = q_groups.reshape(1, kv_heads, group * n, dim)
        for k, v in visible:
            o, lse = _flash_with_lse(q_folded, _as_heads_first(k, q.dtype), _as_heads_first(v, q.dtype), scale=scale)
            outs.append(o.view(kv_heads, group, n, -1))
            lses.append(lse.view(kv_heads, group, n))
    if own is not None:
        k, v = (_as_heads_first(x, q.dtype).squeeze(0).unsqueeze(1) for x in own)  # [KVH, 1, n, D]
        o, lse = _flash_with_lse(
            q_groups, k.expand(-1, group, -1, -1), v.expand(-1, group, -1, -1), is_causal=True, scale=scale
        )
        outs.append(o)
        lses.append(lse)

    if len(outs) == 1:
        out = outs[0]
    else:
        lse = torch.stack(lses)  # [parts, KVH, G, n]
        weights = torch.softmax(lse, dim=0).unsqueeze(-1)
        out = (torch.stack(outs).float() * weights).sum(0).to(q.dtype)
    return out.permute(2, 0, 1, 3).reshape(n, heads, -1)


def attend_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """q [n, H, D] over k, v [len, KVH, D] where mask [n, len] is True: for query rows that are not
    one run (a layer that computes only some rows of a request). Returns [n, H, Dv]."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    q_folded = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        q_folded, _as_heads_first(k, q.dtype), _as_heads_first(v, q.dtype), attn_mask=mask.repeat(group, 1), scale=scale
    )
    return out.view(kv_heads, group, n, -1).permute(2, 0, 1, 3).reshape(n, heads, -1)
