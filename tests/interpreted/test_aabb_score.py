"""Run by tests/test_kernels.py with TRITON_INTERPRET=1: the AABB block-score kernel against the
torch path, and the torch path against the score's literal definition."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_kernels.py"

from sgl_memory.kernels.aabb_score import (  # noqa: E402
    BLOCK_D,
    BLOCK_N,
    BLOCK_T,
    aabb_scores,
    aabb_scores_torch,
    aabb_scores_triton,
)


def boxes(g, L, T, H, N, Hkv, D):
    """Queries and the bounding boxes of N blocks of random keys (so lo <= hi as in real blocks)."""
    q = torch.randn(L, T, H, D, generator=g)
    keys = torch.randn(L, N, 5, Hkv, D, generator=g)
    return q, keys.amin(2), keys.amax(2)


def literal(q, lo, hi):
    """sum_d max(q_d * hi_d, q_d * lo_d), one (layer, token, head, block) at a time."""
    L, T, H, _ = q.shape
    N, Hkv = lo.shape[1], lo.shape[2]
    q, lo, hi = q.double(), lo.double(), hi.double()
    out = torch.empty(L, T, H, N, dtype=torch.float64)
    for l in range(L):
        for t in range(T):
            for h in range(H):
                kv = h // (H // Hkv)
                for n in range(N):
                    out[l, t, h, n] = torch.maximum(q[l, t, h] * hi[l, n, kv], q[l, t, h] * lo[l, n, kv]).sum()
    return out


@pytest.mark.parametrize(
    "L, T, H, N, Hkv, D",
    [
        (1, 3, 2, 5, 2, 8),  # one query head per KV head
        (2, 4, 6, 3, 2, 16),  # grouped-query attention
        (1, 2, 4, 7, 1, 5),  # one KV head, D not a power of two
    ],
)
def test_torch_path_equals_the_literal_score(L, T, H, N, Hkv, D):
    q, lo, hi = boxes(torch.Generator().manual_seed(L * T + N), L, T, H, N, Hkv, D)
    got = aabb_scores_torch(q, lo, hi)
    assert got.dtype == torch.float32 and got.shape == (L, T, H, N)
    torch.testing.assert_close(got.double(), literal(q, lo, hi), rtol=1e-5, atol=1e-5)


def test_the_score_bounds_every_key_of_the_block():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 4, 32, generator=g)
    keys = torch.randn(1, 9, 8, 2, 32, generator=g)  # 9 blocks of 8 keys, 2 KV heads
    scores = aabb_scores_torch(q, keys.amin(2), keys.amax(2))
    dots = torch.einsum("lthd,lnjhd->lthnj", q, keys.repeat_interleave(2, dim=3)).amax(-1)
    assert (scores >= dots - 1e-5).all()


def close(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize(
    "L, T, H, N, Hkv, D",
    [
        (2, 5, 14, 9, 2, 64),  # Qwen2-0.5B heads; T and N inside one tile
        (1, BLOCK_T + 3, 4, BLOCK_N + 5, 4, 128),  # T and N past a tile edge; two D chunks
        (1, 7, 6, 11, 3, BLOCK_D + 24),  # D past a chunk edge
    ],
)
def test_kernel_equals_torch_path(L, T, H, N, Hkv, D):
    q, lo, hi = boxes(torch.Generator().manual_seed(T + N), L, T, H, N, Hkv, D)
    close(aabb_scores_triton(q, lo, hi), aabb_scores_torch(q, lo, hi))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_torch_path_on_16_bit_inputs(dtype):
    q, lo, hi = boxes(torch.Generator().manual_seed(5), 1, 19, 14, 23, 2, 64)
    q, lo, hi = q.to(dtype), lo.to(dtype), hi.to(dtype)
    close(aabb_scores_triton(q, lo, hi), aabb_scores_torch(q, lo, hi))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kernel_and_torch_path_score_boxes_of_an_8_bit_pools_keys(dtype):
    """Blocks whose keys came from an 8-bit KV pool: their boxes in its dtype (rounding is monotone,
    so lo <= hi still), scored against bf16 queries as the literal score of those values."""
    q, lo, hi = boxes(torch.Generator().manual_seed(9), 1, 19, 14, 23, 2, 64)
    q, lo, hi = q.bfloat16(), lo.to(dtype), hi.to(dtype)
    want = aabb_scores_torch(q, lo, hi)
    torch.testing.assert_close(want.double(), literal(q, lo, hi), rtol=1e-5, atol=1e-4)
    close(aabb_scores_triton(q, lo, hi), want)


def test_kernel_on_mixed_dtypes_and_empty_inputs():
    q, lo, hi = boxes(torch.Generator().manual_seed(6), 1, 4, 4, 6, 2, 64)
    close(aabb_scores_triton(q.bfloat16(), lo, hi), aabb_scores_torch(q.bfloat16(), lo, hi))
    assert aabb_scores_triton(q, lo[:, :0], hi[:, :0]).shape == (1, 4, 4, 0)


def test_launcher_takes_the_torch_path_off_gpu():
    q, lo, hi = boxes(torch.Generator().manual_seed(7), 1, 3, 4, 5, 2, 16)
    assert torch.equal(aabb_scores(q, lo, hi), aabb_scores_torch(q, lo, hi))


def test_shapes_that_do_not_fit_are_refused():
    q, lo, hi = boxes(torch.Generator().manual_seed(8), 1, 3, 6, 5, 4, 16)  # 6 query heads, 4 KV heads
    with pytest.raises(ValueError):
        aabb_scores_torch(q, lo, hi)
    with pytest.raises(ValueError):
        aabb_scores_triton(q, lo, hi)
