"""The keep selectors against loop-written references, the ratio schedule, and the config and
request checks of the recompute modes."""

from __future__ import annotations

import math
import time

import pytest
import torch

from sgl_memory.core import config, request
from sgl_memory.keep.loading import LOADINGS, LayerLoader
from sgl_memory.keep.select import SELECTORS, KVDeviation, LayerView, MultiHop, RandomTokens, SegmentStarts, ratio_at
from sgl_memory.keep.settings import KeepConfig
from sgl_memory.memart.settings import MemArtConfig


def view(seed: int, sizes=(5, 16, 3, 9, 16), turn=7, heads=4, kv_heads=2, dim=8, candidates=None) -> LayerView:
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    segment = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    cand = torch.ones(m, dtype=torch.bool) if candidates is None else candidates
    return LayerView(
        r(m, heads, dim),
        r(m, kv_heads, dim),
        r(m, kv_heads, dim),
        r(turn, heads, dim),
        r(turn, kv_heads, dim),
        r(m, kv_heads, dim),
        r(m, kv_heads, dim),
        cand,
        segment,
    )


def softmax_row(logits: list[float]) -> list[float]:
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    return [x / sum(e) for x in e]


def reference_keep(v: LayerView, n: int, hops: int) -> list[int]:
    """KEEP's propagation written out with loops, one (head, row) softmax at a time."""
    m, t, heads = v.k_mem.shape[0], v.k_turn.shape[0], v.q_mem.shape[1]
    group = heads // v.k_mem.shape[1]
    seg = v.segment.tolist()
    segs = max(seg) + 1
    d = v.q_mem.shape[2]
    keys = torch.cat([v.k_mem, v.k_turn])
    query = [0.0] * segs
    for h in range(heads):
        for i in range(t):
            visible = list(range(m)) + [m + j for j in range(i + 1)]
            w = softmax_row([float(v.q_turn[i, h] @ keys[k, h // group]) / math.sqrt(d) for k in visible])
            for k in range(m):
                query[seg[k]] += w[k] / (heads * t)
    cand = [s for s in range(segs) if any(v.candidates[k] and seg[k] == s for k in range(m))]

    def pick(scores):
        return sorted(sorted(cand)[:], key=lambda s: -scores[s])[: min(n, len(cand))]

    chosen = pick(query)
    if hops == 1 or n >= len(cand):
        return sorted(chosen)
    cross = [[0.0] * segs for _ in range(segs)]
    rows_of = {s: [k for k in range(m) if seg[k] == s and v.candidates[k]] for s in range(segs)}
    for a in range(segs):
        if not rows_of[a]:
            continue
        last = max(rows_of[a])
        for h in range(heads):
            pooled = sum(v.q_mem[r, h] for r in rows_of[a]) / len(rows_of[a])
            w = softmax_row([float(pooled @ v.k_mem[k, h // group]) / math.sqrt(d) for k in range(last + 1)])
            for k in range(last + 1):
                if seg[k] != a:
                    cross[a][seg[k]] += w[k] / heads
    for _ in range(hops - 1):
        importance = [(query[b] + sum(cross[a][b] for a in chosen)) / (1 + len(chosen)) for b in range(segs)]
        again = pick(importance)
        if sorted(again) == sorted(chosen):
            break
        chosen = again
    return sorted(chosen)


@pytest.mark.parametrize("hops", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_keep_selects_the_segments_of_a_loop_written_propagation(seed, n, hops):
    cand = torch.ones(49, dtype=torch.bool)
    if seed % 2:
        cand[5:21] = False  # segment 1 was dropped at an earlier layer
    v = view(seed, candidates=cand)
    got = MultiHop(hops).select(v, n)
    segments = sorted(set(v.segment[got].tolist()))
    assert segments == reference_keep(v, n, hops)
    assert bool((got == torch.isin(v.segment, torch.tensor(segments))).all())  # whole segments


def test_propagation_reaches_a_segment_the_turn_does_not_attend_to():
    """One hop picks what the turn attends to; the later hops add what that segment attends to."""
    heads, dim = 2, 4
    sizes = (4, 4, 4)
    m = sum(sizes)
    e = torch.eye(dim)
    k_mem = torch.zeros(m, 1, dim)
    k_mem[0:4, 0] = 8 * e[0]  # segment 0: what segment 2 looks at
    k_mem[4:8, 0] = e[1]  # segment 1: what the turn looks at a little
    k_mem[8:12, 0] = 8 * e[1]  # segment 2: what the turn looks at most
    q_mem = torch.zeros(m, heads, dim)
    q_mem[8:12] = e[0]  # segment 2's rows attend to segment 0
    q_turn = e[1].expand(3, heads, dim).clone()
    v = LayerView(
        q_mem,
        k_mem,
        k_mem.clone(),
        q_turn,
        torch.zeros(3, 1, dim),
        k_mem.clone(),
        k_mem.clone(),
        torch.ones(m, dtype=torch.bool),
        torch.repeat_interleave(torch.arange(3), torch.tensor(sizes)),
    )
    one = set(v.segment[MultiHop(1).select(v, 2)].tolist())
    many = set(v.segment[MultiHop(4).select(v, 2)].tolist())
    assert one == {1, 2} and many == {0, 2}


@pytest.mark.parametrize("seed", range(4))
def test_cacheblend_selects_the_largest_kv_deviations_among_the_candidates(seed):
    cand = torch.rand(49, generator=torch.Generator().manual_seed(seed)) < 0.6
    v = view(seed, candidates=cand)
    got = KVDeviation().select(v, 10)
    dev = [
        float(((v.k_mem[i] - v.placed_k[i]) ** 2).sum() + ((v.v_mem[i] - v.placed_v[i]) ** 2).sum()) for i in range(49)
    ]
    want = sorted((i for i in range(49) if cand[i]), key=lambda i: -dev[i])[:10]
    assert sorted(got.nonzero().squeeze(1).tolist()) == sorted(want)


@pytest.mark.parametrize("seed", range(4))
def test_starts_selects_the_earliest_tokens_of_every_segment_among_the_candidates(seed):
    cand = torch.rand(49, generator=torch.Generator().manual_seed(seed)) < 0.6
    v = view(seed, candidates=cand)
    offsets, seen = [], {}
    for s in v.segment.tolist():  # a token's place in its segment, counted with a loop
        offsets.append(seen.get(s, 0))
        seen[s] = offsets[-1] + 1
    for n in (1, 5, 12):
        got = SegmentStarts().select(v, n)
        want = sorted((i for i in range(49) if cand[i]), key=lambda i: (offsets[i], i))[:n]
        assert sorted(got.nonzero().squeeze(1).tolist()) == sorted(want)


def test_random_picks_a_fixed_order_the_same_on_every_call_and_nested_as_the_candidates_shrink():
    v = view(3)
    picks = [RandomTokens().select(v, n) for n in (20, 10, 5)]
    assert [int(p.sum()) for p in picks] == [20, 10, 5]
    assert all(not bool((small & ~large).any()) for large, small in zip(picks, picks[1:]))
    assert torch.equal(RandomTokens().select(v, 10), picks[1]) and not torch.equal(
        RandomTokens(seed=1).select(v, 10), picks[1]
    )
    # the next layer's candidates are this layer's picks: the same order keeps the set nested
    narrowed = view(3, candidates=picks[0])
    assert torch.equal(RandomTokens().select(narrowed, 10), picks[1])
    # not the positions' order nor their reverse: a pick spread over the placed tokens
    chosen = picks[0].nonzero().squeeze(1)
    assert chosen.tolist() != list(range(20)) and chosen.tolist() != list(range(29, 49))


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_every_selector_stays_inside_its_candidates(name):
    cand = torch.zeros(49, dtype=torch.bool)
    cand[21:49] = True  # segments 2, 3 and 4
    v = view(7, candidates=cand)
    selector = SELECTORS[name]()
    for n in (0, 1, 2, 100):
        got = selector.select(v, n)
        assert not bool((got & ~cand).any())
        units = len(set(v.segment[got].tolist())) if selector.unit == "segment" else int(got.sum())
        assert units == min(n, 3 if selector.unit == "segment" else 28)


def test_the_ratio_schedule():
    layers = 24
    for ratio in (0.0, 0.1, 0.3, 0.7, 1.0):
        shares = [ratio_at(i, layers, ratio, 0.5) for i in range(layers)]
        assert shares[0] == 1.0 and shares[1] == pytest.approx(ratio)
        assert shares[-1] == pytest.approx(ratio**1.5)
        assert all(a >= b for a, b in zip(shares[1:], shares[2:]))
    assert all(ratio_at(i, layers, 1.0, 2.0) == 1.0 for i in range(layers))
    assert all(ratio_at(i, layers, 0.3, 0.0) == pytest.approx(0.3) for i in range(1, layers))


def test_a_repair_needs_the_keep_mechanism_which_is_on_with_memory_unless_turned_off():
    off = {"enabled": False}
    assert config.from_dict({"memory": {"enabled": True}}).of(KeepConfig).enabled  # memory's default repair runs there
    assert not config.from_dict({}).of(KeepConfig).enabled
    assert not config.from_dict({"memory": {"enabled": False}}).of(KeepConfig).enabled
    for repair in ("cacheblend", "starts"):
        with pytest.raises(config.ConfigError, match="keep.enabled"):
            config.from_dict({"memory": {"enabled": True, "recompute": repair}, "keep": off})
    assert (
        config.from_dict({"memory": {"enabled": True, "recompute": "full"}, "keep": off}).of(MemArtConfig).recompute
        == "full"
    )
    served = config.from_dict({"memory": {"enabled": True, "recompute": "none"}, "keep": off})
    for mode in ("keep", "cacheblend", "starts"):
        spec = request.parse({"session_id": "s", "memory": {"recompute": mode}})
        with pytest.raises(request.SpecError, match="keep.enabled"):
            request.check_served(spec, served)
    for mode in ("none", "full"):
        request.check_served(request.parse({"session_id": "s", "memory": {"recompute": mode}}), served)


@pytest.mark.parametrize(
    "raw,needle",
    [
        ({"memory": {"recompute": "some"}}, "memory.recompute"),
        ({"memory": {"recompute": 1}}, "memory.recompute"),
        ({"keep": {"ratio": 1.5}}, "keep.ratio"),
        ({"keep": {"ratio": True}}, "keep.ratio"),
        ({"keep": {"hops": 0}}, "keep.hops"),
        ({"keep": {"hops": 2.5}}, "keep.hops"),
        ({"keep": {"ratios": 1}}, "keep: unknown field"),
        ({"keep": 1}, "keep must be an object"),
        ({"keep": {"drop_rows": "no"}}, "keep.drop_rows must be true or false"),
        ({"keep": {"compact": "no"}}, "keep.compact must be true or false"),  # the key it was renamed from
        ({"keep": {"compact": True, "drop_rows": True}}, r"keep.compact and .*keep.drop_rows: the same key, renamed"),
        ({"memory": {"recompute_ratio": 0.5}}, "unknown field"),
    ],
)
def test_bad_recompute_fields(raw, needle):
    with pytest.raises(request.SpecError, match=needle):
        request.parse({"session_id": "s", **raw})


def test_keep_overrides_are_parsed_by_keep():
    spec = request.parse(
        {"session_id": "s", "memory": {"recompute": "keep"}, "keep": {"ratio": 0.25, "hops": 2, "drop_rows": False}}
    )
    assert (
        spec.part("keep").ratio,
        spec.part("keep").hops,
        spec.part("keep").drop_rows,
        spec.part("memory").recompute,
    ) == (0.25, 2, False, "keep")
    with pytest.raises(request.SpecError, match=r"keep.enabled: false"):
        request.check_served(
            spec, config.from_dict({"memory": {"enabled": True, "recompute": "none"}, "keep": {"enabled": False}})
        )


def placed(layers=6, m=40, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, m, heads, dim, generator=g), torch.randn(layers, m, heads, dim, generator=g)


@pytest.mark.parametrize("mode", LOADINGS)
def test_every_loading_hands_each_layer_the_rows_it_asks_for(mode):
    keys, values = placed()
    loader = LayerLoader(keys, values, "cpu", mode)
    g = torch.Generator().manual_seed(1)
    selected = torch.ones(40, dtype=torch.bool)
    try:
        for layer in range(6):
            need = ~selected
            k, v = loader.ready(layer, need)
            assert torch.equal(k[need], keys[layer][need]) and torch.equal(v[need], values[layer][need])
            selected = selected & (torch.rand(40, generator=g) < 0.7)  # nested, as a selector's
            loader.want(layer + 1, ~selected, ~selected)
    finally:
        loader.close()
    assert loader.metrics()["load_bytes"] == loader.bytes > 0


def wait_loaded(loader: LayerLoader, where, timeout_s: float = 30.0) -> None:
    """Until the loader's thread has loaded `where` (an index into its [layers, M] loaded mask), or
    the timeout: the caller asserts what it finds."""
    deadline = time.monotonic() + timeout_s
    while not bool(loader.loaded[where].all()) and time.monotonic() < deadline:
        time.sleep(0.005)


def test_a_balanced_loader_preloads_the_rows_no_later_layer_recomputes():
    keys, values = placed(layers=8)
    loader = LayerLoader(keys, values, "cpu", "balanced")
    try:
        dropped = torch.zeros(40, dtype=torch.bool)
        dropped[:10] = True
        loader.want(1, dropped, dropped)
        loader.ready(1, dropped)
        wait_loaded(loader, (slice(2, None), slice(None, 10)), timeout_s=5)
        # every later layer holds the dropped rows before it asks, and nothing else was loaded
        assert bool(loader.loaded[2:, :10].all()) and not bool(loader.loaded[:, 10:].any())
        for layer in range(2, 8):
            k, _ = loader.ready(layer, dropped)
            assert torch.equal(k[:10], keys[layer][:10])
    finally:
        loader.close()
    next_layer = LayerLoader(keys, values, "cpu", "next_layer")
    try:
        next_layer.want(1, dropped, dropped)
        next_layer.ready(1, dropped)
        time.sleep(0.1)
        assert not bool(next_layer.loaded[2:].any())  # only what a layer asked for
    finally:
        next_layer.close()


def test_the_simulated_tier_holds_copies_to_its_bandwidth_and_a_pipeline_hides_them():
    keys, values = placed(layers=4, m=64, heads=2, dim=64)
    row_bytes = keys[0][0].nbytes + values[0][0].nbytes
    bandwidth = 64 * row_bytes / 0.05  # one layer's 64 rows in 50 ms
    rows = torch.ones(64, dtype=torch.bool)
    sync = LayerLoader(keys, values, "cpu", "sync", bandwidth)
    for layer in range(4):
        sync.ready(layer, rows)
    assert sync.load_s >= 0.2 and sync.metrics()["load_overlap"] == pytest.approx(0.0, abs=0.02)
    piped = LayerLoader(keys, values, "cpu", "next_layer", bandwidth)
    try:
        piped.ready(0, rows)
        for layer in range(1, 4):
            piped.want(layer, rows, torch.zeros(64, dtype=torch.bool))
            # The layer before computes for longer than a layer's load: modelled by waiting for the
            # loader rather than by a fixed sleep, which a loaded CI machine outran (a 50 ms copy
            # held 116 ms).
            wait_loaded(piped, layer)
            piped.ready(layer, rows)
    finally:
        piped.close()
    assert piped.load_s >= 0.2 and piped.metrics()["load_overlap"] > 0.5


def test_the_renamed_drop_rows_key_is_still_read_with_a_warning(caplog):
    """`keep.compact` was renamed `keep.drop_rows` (`compact` is intent's layout): a config or a
    request written before still means the same, and says so; both keys at once are refused."""
    with caplog.at_level("WARNING"):
        cfg = config.from_dict({"memory": {"enabled": True}, "keep": {"compact": False}})
        spec = request.parse({"session_id": "s", "keep": {"compact": False}})
    assert cfg.of(KeepConfig).drop_rows is False and spec.part("keep").drop_rows is False
    assert "keep.compact is renamed keep.drop_rows" in caplog.text
    with pytest.raises(config.ConfigError, match="the same key, renamed; give keep.drop_rows only"):
        config.from_dict({"keep": {"compact": False, "drop_rows": True}})
