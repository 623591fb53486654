"""Group quantization of KV blocks for the session store: Q4 and Q8 (affine, fp16 scales and
biases), or values as a pool holds them (RAW: bf16, fp32, an 8-bit pool's fp8 bytes or the int8
pool's packed rows, core/kv_rows.py), stored and restored without conversion when the pool has that
dtype.

A group is `group` consecutive values along one axis: along the head dimension (one group per
token and head, the MLX / "Agent Memory Below the Prompt" layout) or, for keys in the KIVI layout,
along the tokens (one group per channel per `group` tokens), because key outliers sit in fixed
channels. Q4 packs two codes per byte. Dequantisation is one vectorised expression per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_memory.core import kv_rows

BITS = {"q4": 4, "q8": 8}
RAW = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": kv_rows.PACKED,
}
GROUP = 64
# an 8-bit pool's dtype (torch's name, as the cache spec holds it) -> its store format
EIGHT_BIT = {str(dtype).removeprefix("torch."): name for name, dtype in RAW.items() if dtype.itemsize == 1}


def store_format(quant: str, pool_dtype: str) -> str:
    """The store's format for `persist.quant` on a pool of `pool_dtype`: `auto` is an 8-bit pool's
    own format (a write stores its bytes, a restore copies them back: nothing to requantize), else q8."""
    return EIGHT_BIT.get(pool_dtype, "q8") if quant == "auto" else quant


@dataclass(frozen=True)
class Quantized:
    """One tensor in stored form. `codes` is uint8 (two 4-bit codes per byte for q4); `scales` and
    `biases` are fp16, one per group; `shape` is the original shape, `axis` the grouped axis."""

    codes: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    shape: tuple[int, ...]
    bits: int
    axis: int
    group: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.biases))


def _grouped(x: torch.Tensor, axis: int, group: int) -> tuple[torch.Tensor, int]:
    """x with `axis` moved last and cut into [..., n_groups, group]; returns the pad. A short last
    group is padded with its own last value: a zero would widen its range (a KIVI key channel far
    from zero, in a session's last tokens) and coarsen its step."""
    x = x.movedim(axis, -1)
    pad = (-x.shape[-1]) % group
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group), pad


def quantize(x: torch.Tensor, bits: int, axis: int = -1, group: int = GROUP) -> Quantized:
    axis = axis % x.dim()
    g, _ = _grouped(x.float(), axis, group)
    lo = g.amin(-1, keepdim=True)
    hi = g.amax(-1, keepdim=True)
    levels = (1 << bits) - 1
    # scale and bias are stored in fp16: quantise against the rounded values so decode matches
    scales = ((hi - lo) / levels).to(torch.float16)
    biases = lo.to(torch.float16)
    step = scales.float().clamp_min(torch.finfo(torch.float16).tiny)
    codes = torch.round((g - biases.float()) / step).clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return Quantized(codes, scales.squeeze(-1), biases.squeeze(-1), tuple(x.shape), bits, axis, group)


def _grouped_shape(q: Quantized) -> list[int]:
    """The original shape with the grouped axis moved last, as the groups are laid out."""
    shape = list(q.shape)
    shape.append(shape.pop(q.axis))
    return shape


def dequantize(q: Quantized, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor back, in `dtype`; with `out` (q.shape, any dtype) written into it instead, so a
    caller that assembles many blocks (the session restore) makes no second copy."""
    codes = q.codes
    if q.bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2)
    g = (
        codes.float().mul_(q.scales.float().unsqueeze(-1)).add_(q.biases.float().unsqueeze(-1))
    )  # in place: one float32 temporary
    moved = _grouped_shape(q)
    x = g.flatten(-2)[..., : moved[-1]].reshape(moved).movedim(-1, q.axis)
    return x.to(dtype) if out is None else out.copy_(x)


def error_bound(q: Quantized) -> torch.Tensor:
    """Per-element bound on |x - dequantize(q)|: half a step, plus the fp16 rounding of the group
    minimum and of the step (which can pull the top code below the group maximum)."""
    levels = (1 << q.bits) - 1
    half = q.scales.float() * (0.5 + levels * 2.0**-10) + q.biases.float().abs() * 2.0**-10 + 1e-6
    moved = _grouped_shape(q)
    per = half.unsqueeze(-1).expand(*half.shape, q.group).flatten(-2)[..., : moved[-1]].reshape(moved)
    return per.movedim(-1, q.axis)
