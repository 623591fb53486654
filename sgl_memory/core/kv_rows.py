"""K and V rows as a KV pool stores them, and values back: the one place that knows a row's format.

SGLang's pools hold each K or V value in the pool's dtype (float32, bf16, fp8): rows become values
by a cast and values become rows by one. Our int8 pool (engine/int8_pool.py) holds each token's
head as 8-bit codes with its scale in the same row: [..., head_dim + 2] int8, the last two bytes an
fp16 scale (the head's largest magnitude over 127, symmetric, so a zero row stays zero). With the
scale inside the row, whatever moves rows without computing on them (a copy between slots, a
compaction, a restore or a write of the store's own format, the sentinel's zeros) moves codes and
scale together; only what computes with the values decodes them (`convert`).

One byte a value and two a head: the default model's token is 6,336 bytes against 12,288 in bf16
(1.94x the tokens in the same bytes) and 24,576 in float32 (3.88x).
"""

from __future__ import annotations

import torch

PACKED = torch.int8  # marks packed rows: no SGLang KV pool stores int8
SCALE_BYTES = 2  # an fp16 scale per token and head
LEVELS = 127  # codes are -127..127: symmetric, so the scale is the magnitude alone


def packed(rows: torch.Tensor) -> bool:
    """Rows in the int8 pool's format (codes and scale per token and head)."""
    return rows.dtype == PACKED


def head_dim(rows: torch.Tensor) -> int:
    """The head dimension of pool rows (or values) [..., heads, width]."""
    return rows.shape[-1] - SCALE_BYTES if packed(rows) else rows.shape[-1]


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K (or V) row of one head in a pool of `dtype` (PACKED: ours)."""
    return head_dim + SCALE_BYTES if dtype == PACKED else head_dim * dtype.itemsize


def encode(values: torch.Tensor) -> torch.Tensor:
    """Values [..., D] (any float dtype) -> packed rows [..., D + 2]: each row's codes against its
    scale rounded to fp16, so that decoding gives code x the stored scale exactly."""
    x = values.float()
    scale = (x.abs().amax(-1, keepdim=True) / LEVELS).to(torch.float16)
    step = scale.float().clamp_min(torch.finfo(torch.float16).tiny)  # a zero row: codes 0, scale 0
    codes = torch.round(x / step).clamp_(-LEVELS, LEVELS).to(PACKED)
    return torch.cat([codes, scale.view(PACKED)], dim=-1)


def decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows [..., D + 2] -> values [..., D] in `dtype`, multiplied out in float32 (a code
    times an fp16 scale is exact there) and rounded once to `dtype`."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16)
    values = rows[..., :-SCALE_BYTES].float().mul_(scale.float())
    return values if dtype == torch.float32 else values.to(dtype)


def convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows or values of any pool's format in `dtype`'s: a float dtype gives values, PACKED gives
    packed rows (rows already packed are returned as they are)."""
    if dtype == PACKED:
        return x if packed(x) else encode(x)
    return decode(x, dtype) if packed(x) else x.to(dtype)


def values(rows: torch.Tensor) -> torch.Tensor:
    """Rows to compute with: packed rows decoded to float32, any other pool's rows as they are
    (their callers cast them as before)."""
    return decode(rows, torch.float32) if packed(rows) else rows
