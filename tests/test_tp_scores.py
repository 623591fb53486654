"""Scores under tensor parallelism: two real processes in a gloo group, each holding half of the
attention heads (as a TP = 2 server's ranks do), score the same candidates, combining over the group
through the engine's own `reduce_heads`: IntentKV's positions with every scorer, KV memory's blocks
with every scoring, normalisation and aggregation, and the rows KEEP's and CacheBlend's selectors
recompute. The reference is one process with all the heads: every rank must hold its scores (to
float rounding) and choose exactly its positions, blocks or rows. And `rank_range`, with which
ranks agree on what they read from their own files: every rank gets the least and the greatest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_memory.intent import scorers
from sgl_memory.intent.head import HeadShape, PrunerHead
from sgl_memory.keep import select as keep_select
from sgl_memory.memart.blocks import BlockIndex
from sgl_memory.memart.retrieval import score_blocks, top_blocks

LAYERS, HEADS, KV_HEADS, DIM, N, WINDOW, QUERY, KEEP = 3, 8, 4, 16, 48, 5, 6, 12
BLOCKS, BLOCK, PROMPT, TOP_K = 20, 4, 7, 5  # KV memory: blocks of BLOCK tokens, a prompt of PROMPT query rows
PLACED, SEGMENTS, TURN = 24, 4, 5  # KEEP: placed rows in segments, the new turn's rows
RANKS = 2
BLOCK_SCORING = [
    (scoring, norm, agg) for scoring in ("exact", "aabb") for norm in ("softmax", "rr") for agg in ("sum", "max")
]


def head() -> PrunerHead:
    """A head whose residual is not zero (a fresh head's output layer is zero-initialised)."""
    torch.manual_seed(7)
    h = PrunerHead(HeadShape(head_dim=DIM, hidden=32, width=16, heads=2))
    torch.nn.init.normal_(h.out.weight, std=0.5)
    return h.eval()


def inputs(scorer: str, rank: int | None = None, reduce=None) -> scorers.ScoringInputs:
    """The same request for every process; `rank` keeps that rank's contiguous share of the query
    heads and of the KV heads (SGLang's TP split), None all of them."""
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(N, KV_HEADS, DIM, generator=g) for _ in range(LAYERS)]
    query_keys = [torch.randn(QUERY, KV_HEADS, DIM, generator=g) for _ in range(LAYERS)]
    q_mean = torch.randn(LAYERS, HEADS, DIM, generator=g)
    q_window = torch.randn(LAYERS, WINDOW, HEADS, DIM, generator=g)
    memory = torch.nn.functional.normalize(torch.randn(LAYERS, HEADS, DIM, generator=g), dim=-1)
    if rank is not None:
        kv, q = KV_HEADS // RANKS, HEADS // RANKS
        keys = [k[:, rank * kv : (rank + 1) * kv] for k in keys]
        query_keys = [k[:, rank * kv : (rank + 1) * kv] for k in query_keys]
        q_mean, memory = q_mean[:, rank * q : (rank + 1) * q], memory[:, rank * q : (rank + 1) * q]
        q_window = q_window[:, :, rank * q : (rank + 1) * q]
    extra = {"reduce": reduce} if reduce is not None else {}
    return scorers.ScoringInputs(
        layer_keys=lambda: iter(keys),
        positions=torch.arange(N) * 2 + 3,
        q_mean=q_mean,
        q_window=q_window,
        memory=memory,
        keep=KEEP,
        seed=3,
        sinks=2,
        kernel=5,
        query_keys=lambda: iter(query_keys),
        head=head() if scorer == "learned" else None,
        **extra,
    )


def blocks(rank: int | None = None) -> tuple[torch.Tensor, BlockIndex]:
    """A prompt's queries [L, T, H, D] and a pool of blocks; `rank`: that rank's heads."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(LAYERS, PROMPT, HEADS, DIM, generator=g)
    keys = torch.randn(LAYERS, BLOCKS * BLOCK, KV_HEADS, DIM, generator=g)
    if rank is not None:
        kv, h = KV_HEADS // RANKS, HEADS // RANKS
        q, keys = q[:, :, rank * h : (rank + 1) * h], keys[:, :, rank * kv : (rank + 1) * kv]
    return q, BlockIndex(list(range(BLOCKS)), keys, torch.arange(BLOCKS * BLOCK).view(BLOCKS, BLOCK))


def layer_view(rank: int | None = None, reduce=None) -> keep_select.LayerView:
    """One layer of a request with placed segments; `rank`: that rank's heads."""
    g = torch.Generator().manual_seed(2)
    q_mem, q_turn = torch.randn(PLACED, HEADS, DIM, generator=g), torch.randn(TURN, HEADS, DIM, generator=g)
    kv = [torch.randn(n, KV_HEADS, DIM, generator=g) for n in (PLACED, PLACED, TURN, PLACED, PLACED)]
    if rank is not None:
        h, k = HEADS // RANKS, KV_HEADS // RANKS
        q_mem, q_turn = q_mem[:, rank * h : (rank + 1) * h], q_turn[:, rank * h : (rank + 1) * h]
        kv = [t[:, rank * k : (rank + 1) * k] for t in kv]
    k_mem, v_mem, k_turn, placed_k, placed_v = kv
    candidates = torch.ones(PLACED, dtype=torch.bool)
    candidates[3] = False  # a row an earlier layer dropped
    segment = torch.arange(PLACED) // (PLACED // SEGMENTS)
    extra = {"reduce": reduce} if reduce is not None else {}
    return keep_select.LayerView(q_mem, k_mem, v_mem, q_turn, k_turn, placed_k, placed_v, candidates, segment, **extra)


KEEP_SELECTIONS = {"keep": 2, "cacheblend": 9}  # selector -> units recomputed next (segments, tokens)


def rank_main(rank: int, rendezvous: str, out: str) -> None:
    """One rank: join the gloo group, score with every scorer, save the scores."""
    import torch.distributed as dist

    from sgl_memory.engine import tree_host

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=RANKS)

    class Group:  # SGLang's TP group coordinator, as reduce_heads reads it: its gloo side
        cpu_group = dist.group.WORLD

    tree_host.get_tp_group = lambda: Group
    tree = type("Rank", (), {"tp_size": RANKS})()
    reduce = lambda x, op: tree_host.TreeHost.reduce_heads(tree, x, op)  # noqa: E731
    with torch.no_grad():
        scores = {name: scorers.get(name).score(inputs(name, rank, reduce)) for name in sorted(scorers.SCORERS)}
        q, index = blocks(rank)
        scores.update({how: score_blocks(q, index, *how, reduce=reduce) for how in BLOCK_SCORING})
        scores["turn_attention"] = keep_select.turn_attention(layer_view(rank, reduce))
        scores.update(
            {
                name: keep_select.SELECTORS[name]().select(layer_view(rank, reduce), n)
                for name, n in KEEP_SELECTIONS.items()
            }
        )
        # what persistence agrees on: each rank's own counts and digests
        scores["rank_range"] = tree_host.TreeHost.rank_range(tree, [rank, 5, -3 * rank, 2**62 + rank])
    torch.save(scores, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    here = Path(__file__).resolve().parent
    script = (
        f"import sys; sys.path.insert(0, {str(here)!r}); import test_tp_scores as t; "
        "t.rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(r), str(d / "rendezvous"), str(d / f"rank{r}.pt")])
        for r in range(RANKS)
    ]
    try:
        for p in procs:
            assert p.wait(timeout=300) == 0
    finally:  # a rank that failed leaves the other waiting in a collective
        for p in procs:
            p.kill()
            p.wait()
    return [torch.load(d / f"rank{r}.pt") for r in range(RANKS)]


@pytest.mark.parametrize("name", sorted(scorers.SCORERS))
def test_every_rank_scores_and_keeps_what_one_rank_with_every_head_does(ranks, name):
    with torch.no_grad():
        reference = scorers.get(name).score(inputs(name))
    for rank in ranks:
        got = rank[name]
        assert torch.equal(got, ranks[0][name])  # the ranks agree bit for bit: they keep the same positions
        finite = torch.isfinite(reference)
        assert torch.equal(finite, torch.isfinite(got))
        torch.testing.assert_close(got[finite].double(), reference[finite].double(), rtol=1e-5, atol=1e-7)
        assert torch.equal(scorers.select(got, KEEP), scorers.select(reference, KEEP))


def test_a_rank_alone_would_keep_other_positions(ranks):
    """Without the reduction each rank's own heads choose: the test above would fail without it."""
    with torch.no_grad():
        alone = [scorers.get("memory").score(inputs("memory", rank)) for rank in range(RANKS)]
    assert not torch.equal(scorers.select(alone[0], KEEP), scorers.select(alone[1], KEEP))


@pytest.mark.parametrize("how", BLOCK_SCORING, ids="-".join)
def test_every_rank_ranks_memory_blocks_as_one_rank_with_every_head_does(ranks, how):
    reference = score_blocks(*blocks(), *how)
    for rank in ranks:
        assert torch.equal(rank[how], ranks[0][how])
        torch.testing.assert_close(rank[how], reference, rtol=1e-5, atol=1e-7)
        assert top_blocks(rank[how], TOP_K) == top_blocks(reference, TOP_K)


@pytest.mark.parametrize("name", sorted(KEEP_SELECTIONS))
def test_every_rank_recomputes_the_rows_one_rank_with_every_head_would(ranks, name):
    reference = keep_select.SELECTORS[name]().select(layer_view(), KEEP_SELECTIONS[name])
    assert 0 < int(reference.sum()) < PLACED  # a choice, not all or nothing
    for rank in ranks:
        assert torch.equal(rank[name], reference)
    torch.testing.assert_close(
        ranks[0]["turn_attention"], keep_select.turn_attention(layer_view()), rtol=1e-5, atol=1e-7
    )


def test_every_rank_gets_the_least_and_the_greatest_of_each_value(ranks):
    for rank in ranks:
        assert rank["rank_range"] == ([0, 5, -3, 2**62], [1, 5, 0, 2**62 + 1])
