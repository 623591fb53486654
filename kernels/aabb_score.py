"""Score KV memory blocks against prompt queries by the bounding boxes of their keys (MemArt).

A block is summarised by the element-wise minimum `lo` and maximum `hi` of its keys. For a query q,
I(q, block) = sum_i max(q_i * hi_i, q_i * lo_i) bounds q . k from above for every key k in the
block, so ranking blocks by it never ranks a block below its best key. Because lo <= hi, each term
is q_i * hi_i where q_i >= 0 and q_i * lo_i where q_i < 0: the score is
clamp(q, min=0) . hi + clamp(q, max=0) . lo, two matmuls. Both paths use that form, so neither
materialises an [L, T, H, N, D] product; the Triton kernel runs it as tl.dot (tensor cores for 16-bit
inputs) where the elementwise max would need a [BLOCK_T, BLOCK_N, BLOCK_D] tile in registers.

The two forms agree only for finite lo <= hi: an empty block written as lo=+inf, hi=-inf gives
0 * inf = NaN here (the max form would give +inf), so callers keep such blocks out of the inputs.

Shapes: q [L, T, H, D] (layers, prompt tokens, query heads); lo, hi [L, N, Hkv, D] (N blocks, KV
heads). Query head h reads KV head h // (H // Hkv), grouped-query attention as in Llama and Qwen2.
Scores are float32 [L, T, H, N].
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves CPU-only installs
    triton = None

BLOCK_T = 32
BLOCK_N = 64
BLOCK_D = 64
_LOADABLE = (torch.float32, torch.bfloat16, torch.float16)


def _check(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    if q.dim() != 4 or lo.dim() != 4 or lo.shape != hi.shape:
        got = ", ".join(str(tuple(x.shape)) for x in (q, lo, hi))
        raise ValueError(f"want q [L,T,H,D] and lo, hi [L,N,Hkv,D]; got {got}")
    L, _, H, D = q.shape
    Lb, _, Hkv, Db = lo.shape
    if L != Lb or D != Db or Hkv == 0 or H % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit blocks {tuple(lo.shape)} (same L and D, H % Hkv == 0)")


def aabb_scores_torch(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """float32 [L, T, H, N]: sum_d max(q[l,t,h,d] * hi[l,n,kv(h),d], q[l,t,h,d] * lo[l,n,kv(h),d])."""
    _check(q, lo, hi)
    L, T, H, D = q.shape
    Hkv = lo.shape[2]
    # Query heads sharing a KV head become one more matmul row dimension, so lo/hi are never repeated.
    q = q.float().reshape(L, T, Hkv, H // Hkv, D)
    out = torch.einsum("ltkgd,lnkd->ltkgn", q.clamp(min=0), hi.float())
    out += torch.einsum("ltkgd,lnkd->ltkgn", q.clamp(max=0), lo.float())
    return out.reshape(L, T, H, -1)


if triton is not None:

    @triton.jit
    def _aabb_scores_kernel(
        q,
        lo,
        hi,
        out,
        T,
        N,
        H,
        HKV,
        D,
        BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        lh = tl.program_id(0)
        layer = lh // H
        head = lh % H
        kv_head = head // (H // HKV)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        # int64 rows: L * T * H * D passes 2**31 on long prompts.
        q_rows = ((layer * T + t.to(tl.int64)) * H + head) * D
        kv_rows = ((layer * N + n.to(tl.int64)) * HKV + kv_head) * D
        t_ok = t < T
        n_ok = n < N
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_ok = d < D
            # Masked lanes load 0 and add 0 * 0 to the sums.
            qt = tl.load(q + q_rows[:, None] + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            kv_off = kv_rows[None, :] + d[:, None]  # [BLOCK_D, BLOCK_N]: the dot's right operand, transposed
            kv_ok = n_ok[None, :] & d_ok[:, None]
            hit = tl.load(hi + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
            lot = tl.load(lo + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
            acc = tl.dot(tl.maximum(qt, 0.0), hit, acc, input_precision=PRECISION)
            acc = tl.dot(tl.minimum(qt, 0.0), lot, acc, input_precision=PRECISION)
        out_rows = ((layer * T + t.to(tl.int64)) * H + head) * N
        tl.store(out + out_rows[:, None] + n[None, :], acc, mask=t_ok[:, None] & n_ok[None, :])


def aabb_scores_triton(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The same contract as aabb_scores_torch, as one Triton kernel."""
    _check(q, lo, hi)
    L, T, H, D = q.shape
    N, Hkv = lo.shape[1], lo.shape[2]
    # Tiles are widened to float32 on load (the interpreter's dot would multiply bf16 tiles as raw
    # bits). The dot may still use TF32 tensor cores when no operand started in float32: bf16 and
    # fp16 values are exact in TF32 and their products exact in the float32 accumulator. A float32
    # operand asks for "ieee", since TF32 would round it to 10 mantissa bits before multiplying.
    q, lo, hi = (x.contiguous() if x.dtype in _LOADABLE else x.float().contiguous() for x in (q, lo, hi))
    wide = torch.float32 in (q.dtype, lo.dtype, hi.dtype)
    out = torch.empty((L, T, H, N), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    grid = (L * H, triton.cdiv(T, BLOCK_T), triton.cdiv(N, BLOCK_N))
    _aabb_scores_kernel[grid](
        q,
        lo,
        hi,
        out,
        T,
        N,
        H,
        Hkv,
        D,
        BLOCK_T=BLOCK_T,
        BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D,
        PRECISION="ieee" if wide else "tf32",
    )
    return out


def aabb_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """float32 [L, T, H, N] block scores: the Triton kernel on CUDA tensors, the torch path elsewhere."""
    if q.is_cuda and triton is not None:
        return aabb_scores_triton(q, lo, hi)
    return aabb_scores_torch(q, lo, hi)
