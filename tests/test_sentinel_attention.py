"""Sentinel-redirected attention equals attention with the dropped positions masked (invariant 2).

A request's row has some prefix positions pointing at the sentinel slot, whose KV is garbage on
purpose; our backend's plans must leave them out. The reference is a float64 softmax over the
request's true keys with the dropped positions masked, computed per query head."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_memory.engine.attention.cpu_backend import plan_requests, run_plans

SENTINEL = 1


def masked_reference(q, k, v, dropped, n_new):
    """q [n, H, D]; k/v [L, KVH, D] of the request's positions; new token i sees keys <= L - n + i
    except the dropped positions."""
    n, heads, dim = q.shape
    length, kv_heads, _ = k.shape
    out = torch.empty(n, heads, v.shape[-1], dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // (heads // kv_heads)].double(), v[:, h // (heads // kv_heads)].double()
        for i in range(n):
            ok = torch.arange(length) <= length - n_new + i
            ok[dropped] = False
            s = (q[i, h].double() @ kh.T) / math.sqrt(dim)
            s = s.masked_fill(~ok, -math.inf)
            out[i, h] = torch.softmax(s, 0) @ vh
    return out


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (14, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("n_new", [1, 5])
def test_sentinel_positions_are_masked(heads, kv_heads, n_new):
    torch.manual_seed(heads * 10 + n_new)
    dim, prefix, pool = 16, 300, 1000
    length = prefix + n_new
    k_cache = torch.randn(pool, kv_heads, dim)
    v_cache = torch.randn(pool, kv_heads, dim)
    k_cache[SENTINEL] = 50.0  # a sentinel that leaked into attention would dominate the softmax
    v_cache[SENTINEL] = 1e3
    slots = torch.randperm(pool - 2)[:length] + 2
    dropped = torch.randperm(prefix)[:120].sort().values
    row = slots.clone()
    row[dropped] = SENTINEL
    req_to_token = torch.zeros(2, 512, dtype=torch.int64)
    req_to_token[1, :length] = row
    q = torch.randn(n_new, heads, dim)
    plans = plan_requests(req_to_token, [1], [prefix], [n_new], sentinel=SENTINEL)
    out = run_plans(plans, q, torch.empty(n_new, heads, dim), k_cache, v_cache, 1 / math.sqrt(dim))
    want = masked_reference(q, k_cache[slots], v_cache[slots], dropped, n_new)
    assert torch.allclose(out.double(), want, atol=1e-5)
