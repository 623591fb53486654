"""Our CPU attention (merged parts, slot-map plans) vs an independent reference: explicit softmax
over masked scores, with GQA by explicit head mapping, in float64."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sgl_memory.core import kv_rows
from sgl_memory.engine.attention.cpu_backend import plan_requests, run_plans
from sgl_memory.engine.attention.kv_source import locate
from sgl_memory.engine.attention.merged import attend


def reference(q, k, v, scale=None):
    """q [n, H, D], k/v [L, KVH, D]; new token i sees keys 0 .. L - n + i."""
    n, heads, d = q.shape
    kv_len, kv_heads, _ = k.shape
    group = heads // kv_heads
    scale = scale if scale is not None else 1 / math.sqrt(d)
    out = torch.empty(n, heads, v.shape[-1], dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = (q[:, h].double() @ kh.T) * scale
        for i in range(n):
            visible = torch.arange(kv_len) <= kv_len - n + i
            s = scores[i].masked_fill(~visible, -math.inf)
            p = torch.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vh
    return out


CASES = [
    # (n_new, prefix_len, heads, kv_heads, head_dim, prefix split points)
    (1, 0, 4, 4, 16, ()),
    (1, 700, 14, 2, 64, ()),
    (1, 700, 14, 2, 64, (1, 350, 699)),
    (7, 0, 9, 3, 64, ()),
    (33, 250, 14, 2, 64, ()),
    (33, 250, 14, 2, 64, (100,)),
    (5, 2100, 8, 1, 32, (7, 2000)),
    (128, 64, 6, 2, 16, ()),
]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n_new, prefix_len, heads, kv_heads, d, splits", CASES)
def test_attend_matches_masked_softmax(dtype, tol, n_new, prefix_len, heads, kv_heads, d, splits):
    g = torch.Generator().manual_seed(n_new * 1000 + prefix_len + len(splits))
    kv_len = prefix_len + n_new
    q = torch.randn(n_new, heads, d, generator=g).to(dtype)
    k = torch.randn(kv_len, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(kv_len, kv_heads, d, generator=g).to(dtype)
    scale = 0.125 if d == 64 else None
    visible_len = kv_len if n_new == 1 else prefix_len  # one new token sees everything without a mask
    bounds = [0, *splits, visible_len]
    visible = [(k[a:b], v[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    own = None if n_new == 1 else (k[prefix_len:], v[prefix_len:])
    got = attend(q, visible, own, scale).double()
    want = reference(q, k, v, scale)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=tol, rtol=tol), (got - want).abs().max()


def brute_force_runs(slots):
    runs = []
    for s in slots:
        if runs and runs[-1][1] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, s + 1])
    return [tuple(r) for r in runs]


@pytest.mark.parametrize("seed", range(20))
def test_locate_finds_the_contiguous_runs(seed):
    rng = random.Random(seed)
    slots = []
    for _ in range(rng.randint(0, 6)):
        start = rng.randint(0, 10_000)
        slots += range(start, start + rng.randint(1, 50))
    source = locate(torch.tensor(slots, dtype=torch.int64), max_runs=4)
    runs = brute_force_runs(slots)
    if len(runs) > 4:
        assert source.slots is not None and source.slots.tolist() == slots and not source.runs
    else:
        assert list(source.runs) == runs and source.slots is None
    cache = torch.arange(20_000).view(-1, 1, 1)
    assert torch.cat([*source.read(cache), cache[:0]]).flatten().tolist() == slots


def test_batch_through_the_slot_map_matches_reference():
    """A mixed batch (cold prefill, decode, extend over a cached prefix; contiguous, two-run and
    fragmented slot rows) attends exactly the KV its slot-map row names."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, d, pool = 6, 2, 32, 6000
    k_cache = torch.randn(pool, kv_heads, d, generator=g)
    v_cache = torch.randn(pool, kv_heads, d, generator=g)
    req_to_token = torch.zeros(6, 4096, dtype=torch.int64)
    layouts = {  # row: (prefix, new, slots)
        3: (0, 9, torch.arange(100, 109)),
        0: (1500, 1, torch.arange(1000, 2501)),
        4: (37, 120, torch.cat([torch.arange(3000, 3037), torch.arange(200, 320)])),
        5: (300, 4, torch.randperm(pool - 1, generator=g)[:304] + 1),
    }
    for row, (_, _, slots) in layouts.items():
        req_to_token[row, : len(slots)] = slots
    rows = list(layouts)
    prefix = [layouts[r][0] for r in rows]
    new = [layouts[r][1] for r in rows]
    plans = plan_requests(req_to_token, rows, prefix, new)
    assert plans[1].visible.runs == ((1000, 2501),) and plans[2].own.runs == ((200, 320),)
    assert plans[3].visible.slots is not None

    q = torch.randn(sum(new), heads, d, generator=g)
    out = run_plans(plans, q, torch.empty_like(q), k_cache, v_cache, None)
    start = 0
    for row, p, n in zip(rows, prefix, new):
        idx = req_to_token[row, : p + n]
        want = reference(q[start : start + n], k_cache[idx], v_cache[idx])
        assert torch.allclose(out[start : start + n].double(), want, atol=1e-5), row
        start += n


def int8_rows(values: torch.Tensor) -> torch.Tensor:
    """The int8 pool's rows of `values` (core/kv_rows.py)."""
    return kv_rows.encode(values)


def held_int8(rows: torch.Tensor) -> torch.Tensor:
    """What packed int8 rows hold, read by hand: 8-bit codes times the fp16 scale in a row's last
    two bytes, in float64."""
    scale = rows[..., -2:].contiguous().view(torch.float16).double()
    return rows[..., :-2].double() * scale


POOL_FORMATS = {
    # name: (the pool's rows of float values, what rows hold in float64)
    "fp8_e4m3": (lambda x: x.to(torch.float8_e4m3fn), lambda r: r.double()),
    "fp8_e5m2": (lambda x: x.to(torch.float8_e5m2), lambda r: r.double()),
    "int8": (int8_rows, held_int8),
}


@pytest.mark.parametrize("kv_format", list(POOL_FORMATS))
@pytest.mark.parametrize("q_dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_batch_over_an_8_bit_pool_attends_the_values_the_pool_holds(kv_format, q_dtype, tol):
    """An 8-bit pool read by the same plans: fp8 (as SGLang stores one: uint8 bytes viewed as fp8)
    or our int8 rows (codes and a scale per token and head): each request attends exactly the
    values the pool holds, cast or decoded up to the query's dtype. Reference: the masked softmax
    over those values in float64."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d, pool = 6, 2, 32, 3000
    to_rows, held = POOL_FORMATS[kv_format]
    k_cache, v_cache = (to_rows(4 * torch.randn(pool, kv_heads, d, generator=g)) for _ in range(2))
    req_to_token = torch.zeros(3, 2048, dtype=torch.int64)
    layouts = {0: (700, 1, torch.arange(10, 711)), 1: (90, 17, torch.randperm(pool - 1, generator=g)[:107] + 1)}
    for row, (_, _, slots) in layouts.items():
        req_to_token[row, : len(slots)] = slots
    rows = list(layouts)
    new = [layouts[r][1] for r in rows]
    plans = plan_requests(req_to_token, rows, [layouts[r][0] for r in rows], new)
    q = torch.randn(sum(new), heads, d, generator=g).to(q_dtype)
    out = run_plans(plans, q, torch.empty_like(q), k_cache, v_cache, None)
    start = 0
    for row, n in zip(rows, new):
        p = layouts[row][0]
        idx = req_to_token[row, : p + n]
        # as the query's dtype reads them: an int8 value is rounded to bf16 there (an fp8 one is exact)
        k, v = (held(cache[idx]).to(q_dtype).double() for cache in (k_cache, v_cache))
        want = reference(q[start : start + n], k, v)
        assert torch.allclose(out[start : start + n].double(), want, atol=tol, rtol=tol), row
        start += n


@pytest.mark.parametrize("kv_format", list(POOL_FORMATS))
def test_a_prefills_own_rows_are_attended_as_computed_and_the_cached_ones_as_the_pool_holds_them(kv_format):
    """With the forward's computed K and V given (a pool of another dtype than the compute dtype),
    the new tokens attend one another's rows as computed and the cached prefix as the pool holds
    it: a contiguous extend, and a request of which the layer computes only some rows (a row layout
    from KEEP) whose other positions are read from the pool. A decode step reads every row, its own
    included, from the pool. Reference: the masked softmax in float64 over those values."""
    from sgl_memory.core.capture import ExtendRows
    from sgl_memory.engine.attention.cpu_backend import plan_layout

    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d, pool = 6, 2, 32, 3000
    to_rows, held = POOL_FORMATS[kv_format]
    req_to_token = torch.zeros(3, 1024, dtype=torch.int64)
    req_to_token[0, :120] = torch.arange(100, 220)  # extend: 90 cached, 30 new
    req_to_token[1, :401] = torch.arange(1000, 1401)  # decode: 400 cached, 1 new
    req_to_token[2, :80] = torch.randperm(pool - 1, generator=g)[:80] + 1  # rows at positions 50, 52, ... 78
    layout_positions = torch.arange(50, 80, 2)
    computed = [4 * torch.randn(30 + 1 + len(layout_positions), kv_heads, d, generator=g) for _ in range(2)]
    values = [4 * torch.randn(pool, kv_heads, d, generator=g) for _ in range(2)]
    starts = [0, 30, 31]
    for (row, positions), start in zip(
        ((0, torch.arange(90, 120)), (1, torch.tensor([400])), (2, layout_positions)), starts
    ):
        for x, c in zip(values, computed):
            x[req_to_token[row, positions]] = c[start : start + len(positions)]  # the forward wrote its rows
    k_cache, v_cache = (to_rows(x) for x in values)
    rows = [
        ExtendRows("a", 0, 90, 30, 0),
        ExtendRows("b", 30, 400, 1, 1),
        ExtendRows("c", 31, 50, len(layout_positions), 2, positions=layout_positions),
    ]
    plans = plan_layout(req_to_token, rows)
    q = torch.randn(len(computed[0]), heads, d, generator=g)
    out = run_plans(plans, q, torch.empty_like(q), k_cache, v_cache, None, computed=tuple(computed))

    def want(row: int, start: int, q_positions: torch.Tensor, exact: torch.Tensor) -> None:
        n, end = len(q_positions), int(q_positions[-1]) + 1
        k, v = (held(cache[req_to_token[row, :end]]).float() for cache in (k_cache, v_cache))
        for x, c in zip((k, v), computed):
            x[exact] = c[start : start + len(exact)]  # the rows this forward computed, in its order
        got = out[start : start + n].double()
        for i, p in enumerate(q_positions.tolist()):
            ref = reference(q[start + i : start + i + 1], k[: p + 1], v[: p + 1])
            assert torch.allclose(got[i : i + 1], ref, atol=1e-5), (row, p)

    want(0, 0, torch.arange(90, 120), torch.arange(90, 120))  # its own rows as computed
    want(1, 30, torch.tensor([400]), torch.tensor([], dtype=torch.long))  # a decode step: all from the pool
    want(2, 31, layout_positions, layout_positions)  # the computed rows as computed, the rest from the pool
    # the pool's rounding is there: reading the own rows from the pool answers otherwise
    pooled = run_plans(plans, q, torch.empty_like(q), k_cache, v_cache, None)
    assert not torch.allclose(pooled[:30], out[:30], atol=1e-4)
