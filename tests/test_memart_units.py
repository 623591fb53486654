"""MemArt pieces without a server: the AABB bound, retrieval against a brute-force reference for
every normalisation x aggregation, re-rotated blocks against keys rotated by transformers' own RoPE
at the new positions, the session pool (blocks, capacity, eviction), the request field."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

from sgl_memory.core.request import SpecError, parse
from sgl_memory.kernels.aabb_score import aabb_scores
from sgl_memory.core.spans import RoleMarkers, find_spans
from sgl_memory.memart.blocks import BlockIndex, pieces
from sgl_memory.memart.pool import MemArtPool
from sgl_memory.memart.placement import assemble, choose
from sgl_memory.memart.queries import probe_end, scoring_positions
from sgl_memory.memart.retrieval import aabb_logits, block_scores, exact_logits, score_blocks, top_blocks
from sgl_memory.core.rope import Rope

# --- the AABB bound ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_aabb_score_bounds_every_key_of_its_block(seed):
    g = torch.Generator().manual_seed(seed)
    L, T, H, Hkv, D, N, size = 3, 7, 6, 2, 32, 9, 16
    keys = torch.randn(L, N, size, Hkv, D, generator=g) * torch.rand(1, 1, 1, 1, D, generator=g) * 4
    q = torch.randn(L, T, H, D, generator=g)
    bound = aabb_scores(q, keys.amin(dim=2), keys.amax(dim=2))  # [L, T, H, N]
    kv_head = torch.arange(H) // (H // Hkv)
    dots = torch.einsum("lthd,lnshd->lthns", q, keys[:, :, :, kv_head])  # every key of every block
    assert (bound >= dots.amax(-1) - 1e-4).all()
    # tight for a one-key block: the box is the key itself
    one = keys[:, :, :1]
    assert torch.allclose(
        aabb_scores(q, one.amin(2), one.amax(2)), torch.einsum("lthd,lnhd->lthn", q, one[:, :, 0, kv_head]), atol=1e-4
    )


# --- retrieval vs brute force ------------------------------------------------------------------


def brute_force_top(q, keys, lengths, scoring, norm, agg, k, c=60.0):
    """MemArt Eq. 3-4 and Table 1 written out with loops over every key of every block (`exact`: the
    best key's logit; `aabb`: the bound from the element-wise min and max); layers and heads averaged.
    Block n holds keys[:, n, :lengths[n]]."""
    L, T, H, D = q.shape
    N, group = keys.shape[1], H // keys.shape[3]
    total = [0.0] * N
    for layer in range(L):
        for head in range(H):
            per_block = [[] for _ in range(N)]
            for t in range(T):
                qv = [float(x) for x in q[layer, t, head]]
                row = []
                for n in range(N):
                    ks = [[float(x) for x in keys[layer, n, s, head // group]] for s in range(lengths[n])]
                    if scoring == "exact":
                        best = max(sum(a * b for a, b in zip(qv, kv)) for kv in ks)
                    else:
                        lo = [min(kv[i] for kv in ks) for i in range(D)]
                        hi = [max(kv[i] for kv in ks) for i in range(D)]
                        best = sum(max(qv[i] * hi[i], qv[i] * lo[i]) for i in range(D))
                    row.append(best / math.sqrt(D))
                if norm == "softmax":
                    z = sum(math.exp(x) for x in row)
                    normed = [math.exp(x) / z for x in row]
                else:
                    order = sorted(range(N), key=lambda n: -row[n])
                    rank = {n: r + 1 for r, n in enumerate(order)}
                    normed = [1.0 / (rank[n] + c) for n in range(N)]
                for n in range(N):
                    per_block[n].append(normed[n])
            for n in range(N):
                total[n] += (sum(per_block[n]) if agg == "sum" else max(per_block[n])) / (L * H)
    return sorted(range(N), key=lambda n: -total[n])[:k], total


def flat_index(keys, lengths, order=None):
    """A BlockIndex over blocks n of keys[:, n, :lengths[n]], their rows stored one after another
    in `order` (a pool's rows are in the order they were appended, not the blocks')."""
    order = list(range(keys.shape[1])) if order is None else order
    parts, rows, at = [], {}, 0
    for n in order:
        parts.append(keys[:, n, : lengths[n]])
        rows[n] = [at + min(s, lengths[n] - 1) for s in range(max(lengths))]
        at += lengths[n]
    return BlockIndex(
        list(range(keys.shape[1])), torch.cat(parts, 1), torch.tensor([rows[n] for n in range(keys.shape[1])])
    )


@pytest.mark.parametrize("scoring", ["exact", "aabb"])
@pytest.mark.parametrize("norm", ["softmax", "rr"])
@pytest.mark.parametrize("agg", ["sum", "max"])
@pytest.mark.parametrize("seed", range(2))
def test_retrieval_equals_brute_force(scoring, norm, agg, seed):
    g = torch.Generator().manual_seed(seed)
    L, T, H, Hkv, D, N = 2, 4, 4, 2, 8, 11
    keys = torch.randn(L, N, 5, Hkv, D, generator=g) * 3
    lengths = torch.randint(1, 6, (N,), generator=g).tolist()  # short blocks too
    q = torch.randn(L, T, H, D, generator=g) * 3
    want, total = brute_force_top(q, keys, lengths, scoring, norm, agg, 4)
    index = flat_index(keys, lengths, torch.randperm(N, generator=g).tolist())
    logits = exact_logits(q, index) if scoring == "exact" else aabb_logits(q, *index.boxes())
    scores = block_scores(logits, norm, agg, 60.0)
    assert torch.allclose(scores.double(), torch.tensor(total, dtype=torch.float64), rtol=1e-4, atol=1e-7)
    assert top_blocks(scores, 4) == want
    # the server's pass over slices of the prompt tokens (one token per slice at a 1-byte cap)
    for cap in (1, 1 << 30):
        sliced = score_blocks(q, index, scoring, norm, agg, 60.0, cap_bytes=cap)
        assert torch.allclose(sliced.double(), torch.tensor(total, dtype=torch.float64), rtol=1e-4, atol=1e-7)


SCAN_RSS = """
import resource, sys, torch
from sgl_memory.memart.blocks import BlockIndex
from sgl_memory.memart.retrieval import score_blocks
torch.set_num_threads(1)
L, T, H, Hkv, D, N, S = 12, 512, 14, 2, 64, 1024, 16  # the default model's scoring layers, a 512-token turn
q, keys = torch.randn(L, T, H, D), torch.randn(L, N * S, Hkv, D, dtype=torch.bfloat16)
index = BlockIndex(list(range(N)), keys, torch.arange(N * S).view(N, S))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
score_blocks(q, index, sys.argv[1], "softmax", "max")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.parametrize("scoring", ["exact", "aabb"])
def test_scoring_a_long_turn_against_a_large_pool_stays_under_the_scan_cap(scoring):
    """A 512-token turn against 1024 blocks: unsliced, the logits and their softmax are 0.7 GB and
    the exact scan's products 1.4 GB (a 1.5k-token turn drove the scheduler to 6.8 GB, and the
    kernel killed it); sliced, the peak resident memory grows by less than the cap plus the inputs'
    copies (float32 view of q, one block chunk)."""
    import subprocess
    import sys

    from sgl_memory.memart.retrieval import SCAN_BYTES

    out = subprocess.run([sys.executable, "-c", SCAN_RSS, scoring], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    grown = int(out.stdout.strip().splitlines()[-1])
    assert grown < SCAN_BYTES + (128 << 20), f"peak RSS grew by {grown / 2**20:.0f} MiB"


def test_index_pads_short_blocks_without_changing_their_scores():
    memory = MemArtPool(capacity=100, score_layers=1)
    keys = turn(memory, 10, 0).to(torch.bfloat16)  # blocks of 4, 4 and 2 tokens
    index = memory.index()
    assert index.block_keys().shape == (1, 3, 4, 1, 8) and index.ids == [0, 1, 2]
    q = torch.randn(1, 3, 2, 8)
    want = torch.einsum("thd,nhd->thn", q[0], keys[0, 8:10].float()).amax(-1) / math.sqrt(8)
    assert torch.allclose(exact_logits(q, index)[0, ..., 2], want, atol=1e-5)
    lo, hi = index.boxes()
    assert torch.equal(lo[0, 2], keys[0, 8:10].amin(0)) and torch.equal(hi[0, 2], keys[0, 8:10].amax(0))


def test_text_scoring_positions_leave_out_the_chat_markup():
    from transformers import AutoTokenizer

    from sgl_memory import models

    tok = AutoTokenizer.from_pretrained(models.model_dir("smollm2-135m-instruct"))
    ids = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Pepper?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    markers = RoleMarkers.from_tokenizer(tok, "chatml")
    spans = find_spans(ids, markers, len(ids))
    text = scoring_positions(ids, spans, "text", markers, tok)
    assert tok.decode([ids[i] for i in text]).split() == ["Where", "is", "Pepper?"]
    # an assistant turn after the question (a readonly request scoring an answer) does not score
    answered = ids + tok("Pepper is in the attic.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert scoring_positions(answered, find_spans(answered, markers, len(answered)), "text", markers, tok) == text
    assert scoring_positions(ids, spans, "query", markers, tok) == list(range(spans.query_start, len(ids)))
    assert scoring_positions(ids, spans, "all", markers, tok) == list(range(len(ids)))
    # the probe computes the prompt an ordinary request ends with, and no further
    answered_spans = find_spans(answered, markers, len(answered))
    assert (
        probe_end(ids, spans, "text", markers, tok)
        == probe_end(answered, answered_spans, "text", markers, tok)
        == len(ids)
    )
    assert probe_end(answered, answered_spans, "all", markers, tok) == len(answered)


# --- decoupled positions -----------------------------------------------------------------------


def hf_rope(raw: torch.Tensor, positions: torch.Tensor, config) -> torch.Tensor:
    """transformers' Qwen2 RoPE applied to pre-RoPE keys [n, heads, dim] at these positions."""
    cos, sin = Qwen2RotaryEmbedding(config)(raw, positions[None])
    k = raw.transpose(0, 1)[None].float()  # [1, heads, n, dim]
    _, rotated = apply_rotary_pos_emb(k, k, cos, sin)
    return rotated[0].transpose(0, 1)


# Tolerances, of the largest magnitude: bf16, the two roundings (cached key, placed key) each at
# most half an ulp of 2^-8 relative; float32, the reference's own float32 angles (position x
# frequency rounded at 2^-24 relative: about 3e-4 rad at position 5000).
REROTATION_TOL = {torch.bfloat16: 2**-7, torch.float32: 2**-10}


@pytest.mark.parametrize("dtype", list(REROTATION_TOL))
def test_rerotated_blocks_equal_keys_computed_at_the_new_positions(dtype):
    """Keys cached at scattered positions (in the pool's dtype: bf16 or float32, as the launcher
    picks), stored as cached with their positions -> two blocks placed at 0..M-1, each key rotated
    by the distance it moves."""
    config = Qwen2Config(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=2, rope_theta=1e6, max_position_embeddings=32768
    )
    rope = Rope(head_dim=64, theta=1e6)
    torch.manual_seed(0)
    L, n, h, d = 2, 24, 2, 64
    raw = torch.randn(L, n, h, d) * 3  # pre-RoPE keys
    old = torch.cat([torch.arange(5000, 5012), torch.arange(17, 29)])  # two turns far apart
    cached = torch.stack([hf_rope(raw[layer], old, config) for layer in range(L)]).to(dtype)

    memory = MemArtPool(capacity=100, rope=rope)
    memory.add_turn(list(range(12)), cached[:, :12], cached[:, :12], block_size=12, positions=old[:12])
    memory.add_turn(list(range(12, 24)), cached[:, 12:], cached[:, 12:], block_size=12, positions=old[12:])
    blocks = memory.take([1, 0])
    placed, _ = assemble(blocks, rope)
    assert placed.dtype == dtype
    want = torch.stack([hf_rope(raw[layer], torch.arange(n), config) for layer in range(L)])
    err = (placed.float() - want).abs().max()
    assert err <= REROTATION_TOL[dtype] * want.abs().max(), float(err)
    # after a system message of 100 tokens: positions 100..100+M-1
    moved, _ = assemble(blocks, rope, at=100)
    want = torch.stack([hf_rope(raw[layer], torch.arange(100, 100 + n), config) for layer in range(L)])
    assert (moved.float() - want).abs().max() <= REROTATION_TOL[dtype] * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_keys_placed_at_their_own_positions_are_the_cached_keys(dtype):
    """Blocks keep the keys as cached, in the pool's dtype: placed where they were computed, they
    come back bit for bit in either dtype, and so does a merged block's subset of them."""
    rope = Rope(head_dim=64, theta=1e6)
    cached = (torch.randn(3, 40, 2, 64) * 5).to(dtype)
    memory = MemArtPool(capacity=100, rope=rope)
    memory.add_turn(list(range(40)), cached, cached, block_size=16, positions=torch.arange(40))
    placed, values = assemble(memory.take([0, 1, 2]), rope)
    assert placed.dtype == dtype and torch.equal(values, cached) and torch.equal(placed, cached)
    assert memory.blocks[0].keys.dtype == dtype
    merging = MemArtPool(capacity=1, eviction="merge", block_size=16, rope=rope)
    merging.add_turn(list(range(32)), cached[:, 8:40], cached[:, 8:40], block_size=16, positions=torch.arange(8, 40))
    (block,) = merging.blocks.values()
    kept = torch.tensor([offset for _, offset in block.origin]) + 8
    placed, _ = assemble([block], rope, at=int(kept[0]))
    assert torch.equal(placed[:, 0], cached[:, int(kept[0])])  # the first kept key did not move


# The index's keys: the rotation removed in float64 from the cached keys and rounded once into the
# pool's dtype; against transformers' pre-RoPE keys: bf16, the cached key's rounding and this one;
# float32, the reference's own float32 angles (REROTATION_TOL).
FREE_TOL = {torch.bfloat16: 2**-7, torch.float32: 2**-10}


@pytest.mark.parametrize("dtype", list(FREE_TOL))
def test_the_index_holds_the_scoring_layers_keys_without_their_rotation(dtype):
    config = Qwen2Config(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=2, rope_theta=1e6, max_position_embeddings=32768
    )
    rope = Rope(head_dim=64, theta=1e6)
    raw = torch.randn(4, 30, 2, 64) * 3
    positions = torch.arange(3000, 3030)
    cached = torch.stack([hf_rope(raw[layer], positions, config) for layer in range(4)]).to(dtype)
    memory = MemArtPool(capacity=100, rope=rope, score_layers=2)
    memory.add_turn(list(range(30)), cached, cached, block_size=16, positions=positions)
    index = memory.index()
    free = index.block_keys()  # [2 layers, 2 blocks, 16, 2, 64]
    assert free.dtype == dtype and free.shape[0] == 2
    got = torch.cat([free[:, 0], free[:, 1, :14]], 1).float()
    err = (got - raw[:2]).abs().max()
    assert err <= FREE_TOL[dtype] * raw[:2].abs().max(), float(err)


# --- the session pool --------------------------------------------------------------------------


def turn(memory, n, seed, size=4):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, n, 1, 8, generator=g)
    memory.add_turn(list(range(seed * 100, seed * 100 + n)), keys, keys.to(torch.bfloat16), size)
    return keys


def test_turns_become_blocks_with_their_aabbs_and_metadata():
    memory = MemArtPool(capacity=100)
    keys = turn(memory, 10, 0).to(torch.bfloat16)  # kept in the pool's dtype, the values'
    turn(memory, 3, 1)
    index = memory.index()
    ids, (lo, hi) = index.ids, index.boxes()
    assert ids == [0, 1, 2, 3] and [len(memory.blocks[i].tokens) for i in ids] == [4, 4, 2, 3]
    assert [memory.blocks[i].spans() for i in ids] == [[[0, 0, 4]], [[0, 4, 4]], [[0, 8, 2]], [[1, 0, 3]]]
    assert torch.equal(lo[:, 1], keys[:, 4:8].amin(1)) and torch.equal(hi[:, 2], keys[:, 8:10].amax(1))
    assert memory.blocks[3].tokens == [100, 101, 102] and torch.equal(memory.blocks[1].keys, keys[:, 4:8])


def test_a_retrieval_ingests_the_turns_a_slow_worker_has_not_added():
    """Issue 13: under load a memory-mode request retrieved before its session's turns were in the
    pool (it waited 30 s, then went on without them). Now the retrieval adds them itself, in order,
    after the turn the worker is adding."""
    import threading

    memory = MemArtPool(capacity=100, rope=Rope(head_dim=8, theta=1e4))
    started, release = threading.Event(), threading.Event()
    unrotate = memory.store.free_keys

    def slow(keys, positions):  # the worker's un-rotation, stalled
        started.set()
        release.wait(5)
        return unrotate(keys, positions)

    memory.store.free_keys = slow
    keys = torch.randn(2, 8, 1, 8)
    for t in range(3):
        memory.submit(list(range(t * 10, t * 10 + 8)), torch.arange(8), keys, keys.to(torch.bfloat16))
    worker = threading.Thread(target=memory.ingest, args=(4,))
    worker.start()
    assert started.wait(5)
    threading.Timer(0.3, release.set).start()
    memory.ingest(4)  # the retrieval: blocks until the worker's turn is in, adds the rest
    worker.join(5)
    assert [memory.blocks[i].turns() for i in sorted(memory.blocks)] == [{0}, {0}, {1}, {1}, {2}, {2}]
    assert [memory.blocks[i].tokens[0] for i in sorted(memory.blocks)] == [0, 4, 10, 14, 20, 24]
    assert not memory.busy()


def distinct_turns(memory, count, n, size, dim=16, seed=0):
    """Turns of n tokens: n - 1 recurring ones (ids 0..n-2 in every turn, random keys) and one rare
    (id 1000 + turn) whose key is a strong distinct direction: what a question about that turn hits."""
    g = torch.Generator().manual_seed(seed)
    rare_keys = []
    for t in range(count):
        keys = torch.randn(2, n, 1, dim, generator=g)
        at = int(torch.randint(n, (1,), generator=g))
        keys[:, at] = 0
        keys[:, at, 0, t % dim] = 8.0 * (1 if t < dim else -1)
        tokens = list(range(n - 1))
        tokens.insert(at, 1000 + t)
        memory.add_turn(tokens, keys, keys.to(torch.bfloat16), size)
        rare_keys.append(keys[:, at, 0].clone())
    return rare_keys


def test_merging_keeps_a_full_pool_at_its_capacity_and_every_turn_retrievable_by_its_rare_tokens():
    """Eviction `merge` at 6x over capacity: the pool holds `capacity` blocks (their bytes), each a
    chronological subsequence of the session's tokens with those tokens' own keys and boxes, together
    standing for every token of the session (nothing dropped). A query on the key of a turn's one
    rare token still finds that turn (brute-force exact top-1), where dropping (lru) has lost most."""
    size, capacity, count, n = 4, 8, 16, 12  # 48 blocks' worth of turns
    merged, dropped = MemArtPool(capacity=capacity, eviction="merge", block_size=size), MemArtPool(capacity=capacity)
    rare = distinct_turns(merged, count, n, size)
    distinct_turns(dropped, count, n, size)
    assert len(merged.blocks) == capacity and merged.evictor.merged > 0 and merged.evictor.evicted == 0
    assert merged.bytes == sum(b.nbytes() for b in merged.blocks.values()) + merged.store.score.nbytes()
    assert sum(b.covers for b in merged.blocks.values()) == count * n
    assert +merged.store.counts == Counter(t for b in merged.blocks.values() for t in b.tokens)
    seen = [o for b in merged.blocks.values() for o in b.origin]
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    # spread evenly: no block stands for more than twice its share (folding the least recently used
    # block again and again made one block stand for nearly the whole session)
    covers = [b.covers for b in merged.blocks.values()]
    assert max(covers) <= 2 * count * n / capacity, covers

    def found(memory, t):
        index = memory.index()
        q = rare[t].view(2, 1, 1, -1)
        best = index.ids[int(exact_logits(q, index).mean(dim=(0, 1, 2)).argmax())]
        return t in memory.blocks[best].turns()

    assert all(found(merged, t) for t in range(count))
    assert sum(found(dropped, t) for t in range(count)) <= count // 2


@pytest.mark.parametrize("eviction", ["lru", "merge"])
def test_the_index_rows_stay_each_blocks_keys_through_appends_evictions_and_repacking(eviction):
    """Random turns into a small pool: after every turn, each block's rows in the index are its
    own keys with the rotation removed (computed again here from the block's keys and positions),
    the live rows are the blocks' tokens, and the buffer holds at most 1.3x the live rows plus the
    last turn (it grows by an eighth and is repacked once an eighth of it is dead)."""
    g = torch.Generator().manual_seed(7)
    rope = Rope(head_dim=8, theta=1e4)
    memory = MemArtPool(capacity=12, eviction=eviction, block_size=4, rope=rope, score_layers=1)
    at, repackings, repack = 0, [], memory.store.score.repack
    memory.store.score.repack = lambda blocks: (repackings.append(len(blocks)), repack(blocks))
    for t in range(60):
        n = int(torch.randint(1, 15, (1,), generator=g))
        keys = torch.randn(2, n, 1, 8, generator=g).to(torch.bfloat16)
        memory.add_turn(list(range(n)), keys, keys, 4, positions=torch.arange(at, at + n))
        at += n
        live = sum(len(b.tokens) for b in memory.blocks.values())
        assert memory.store.score.used - memory.store.score.dead == live
        assert memory.store.score.buffer.shape[1] <= 1.3 * live + n
        for block in memory.blocks.values():
            want = rope.rotate_layers(block.keys[:1], -block.positions)
            assert torch.equal(memory.store.score.rows(block), want)
    assert len(repackings) > 5


def test_a_merge_keeps_the_rarest_tokens_of_the_two_blocks_with_their_keys():
    """Brute force on two blocks: the kept tokens are the block_size rarest in the pool (the larger
    key norm among equals), in order, with their own keys, values, index rows and origins."""
    size = 4
    pool = MemArtPool(capacity=1, eviction="merge", block_size=size)
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 2 * size, 1, 8, generator=g)
    tokens = [7, 1, 7, 2, 7, 7, 3, 9]  # 7 recurs; 1, 2, 3, 9 occur once
    pool.add_turn(tokens, keys, keys.to(torch.bfloat16), size)
    (block,) = pool.blocks.values()
    assert block.tokens == [1, 2, 3, 9] and block.origin == [(0, 1), (0, 3), (0, 6), (0, 7)]
    kept = keys[:, [1, 3, 6, 7]].to(torch.bfloat16)
    assert (
        torch.equal(block.keys, kept)
        and torch.equal(block.values, kept)
        and torch.equal(pool.store.score.rows(block), kept)
    )
    assert block.spans() == [[0, 1, 1], [0, 3, 1], [0, 6, 2]] and block.covers == 2 * size
    # ties on rarity: the larger key norm
    norm_pool = MemArtPool(capacity=1, eviction="merge", block_size=size)
    norm_pool.add_turn(list(range(2 * size)), keys, keys.to(torch.bfloat16), size)
    strength = keys.to(torch.bfloat16).float().norm(dim=-1).mean(dim=(0, 2))
    want = sorted(sorted(range(2 * size), key=lambda i: -strength[i])[:size])
    assert next(iter(norm_pool.blocks.values())).tokens == want
    # under tensor parallelism (norm_ties off) each rank holds other heads' keys: every rank keeps
    # the same tokens, the earlier ones among equals, whatever its keys
    for rank_keys in (keys, torch.randn(2, 2 * size, 1, 8, generator=g)):
        rank = MemArtPool(capacity=1, eviction="merge", block_size=size, norm_ties=False)
        rank.add_turn(list(range(2 * size)), rank_keys, rank_keys.to(torch.bfloat16), size)
        assert next(iter(rank.blocks.values())).tokens == list(range(size))
    assert want != list(range(size))  # the keys above break those ties otherwise
    # one block left over capacity (trim by bytes): merging cannot shrink it, it is dropped
    single = MemArtPool(capacity=4, eviction="merge", block_size=size)
    single.add_turn(tokens[:size], keys[:, :size], keys[:, :size].to(torch.bfloat16), size)
    single.trim(0)
    assert not single.blocks and single.evictor.evicted == 1 and single.bytes == 0


def same_blocks(a: MemArtPool, b: MemArtPool, made: bool = True) -> None:
    assert (
        list(a.blocks) == list(b.blocks) and a.store.held == b.store.held and +a.store.counts == +b.store.counts
    )  # the index's spare rows may differ
    for i, x in a.blocks.items():
        y = b.blocks[i]
        assert (x.tokens, x.origin, x.used, x.covers) == (y.tokens, y.origin, y.used, y.covers)
        assert x.made == y.made or not made
        for name in ("keys", "values", "positions"):
            assert torch.equal(getattr(x, name), getattr(y, name)) and getattr(x, name).dtype == getattr(y, name).dtype
        assert torch.equal(a.store.score.rows(x), b.store.score.rows(y))


def test_an_exported_pool_loads_into_one_that_retrieves_the_same_blocks():
    """What persistence stores of a session's memory: a pool rebuilt from its export has the same
    blocks (tokens, keys, positions, values, index rows, origins, recency, coverage) and counters,
    so a retrieval from it scores, picks and places exactly what the original would, and a merging
    pool goes on merging as the original does; its index is recomputed, not stored."""
    memory = MemArtPool(capacity=6)
    for seed in range(3):
        turn(memory, 10, seed)  # 9 blocks made, 3 evicted
    memory.take([5])
    memory.path = [1, 2, 3]
    exported = memory.export()
    assert not {"lo", "hi", "free"} & set(exported)
    loaded = MemArtPool(capacity=6)
    loaded.load(exported)
    counters = (loaded.turns, loaded.store.clock, loaded.store.next_id, loaded.evictor.evicted, loaded.path)
    assert counters == (3, 1, 9, 3, [1, 2, 3])
    same_blocks(memory, loaded)
    q = torch.randn(2, 5, 2, 8)
    want, got = memory.index(), loaded.index()
    assert want.ids == got.ids
    for scoring in ("exact", "aabb"):
        assert torch.equal(
            score_blocks(q, want, scoring, "softmax", "max", 60.0),
            score_blocks(q, got, scoring, "softmax", "max", 60.0),
        )
    merging = MemArtPool(capacity=3, eviction="merge", block_size=4)
    distinct_turns(merging, 4, 6, 4, dim=8)  # the dim of turn()'s keys: one pool, one key shape
    again = MemArtPool(capacity=3, eviction="merge", block_size=4)
    again.load(merging.export())
    same_blocks(merging, again)
    for pool in (merging, again):
        turn(pool, 6, 9)
    same_blocks(merging, again, made=False)  # the new turn's wall time differs
    empty = MemArtPool(capacity=6)
    empty.load(MemArtPool(capacity=6).export())
    assert not empty.blocks and empty.turns == 0


def test_a_pool_written_before_per_token_origins_loads():
    """Session files of the previous format hold a turn and offset per block, no coverage."""
    memory = MemArtPool(capacity=6)
    turn(memory, 10, 0)
    old = memory.export()
    old["turn"], old["offset"] = torch.tensor([0, 0, 0]), torch.tensor([0, 4, 8])
    del old["origin"], old["covers"]
    loaded = MemArtPool(capacity=6)
    loaded.load(old)
    same_blocks(memory, loaded)


def test_a_pool_written_with_position_free_float32_keys_loads():
    """Session files written before blocks kept their cached keys hold position-free float32 keys
    and no positions: the same keys at position 0, in the pool's dtype once loaded."""
    rope = Rope(head_dim=8, theta=1e4)
    memory = MemArtPool(capacity=6, rope=rope)
    keys = torch.randn(2, 10, 1, 8)
    memory.add_turn(list(range(10)), keys, keys.to(torch.bfloat16), 4)
    old = memory.export()
    old["keys"] = keys  # the old format's float32 keys
    del old["positions"]
    loaded = MemArtPool(capacity=6, rope=rope)
    loaded.load(old)
    same_blocks(memory, loaded)
    placed, _ = assemble(loaded.take([0, 1, 2]), rope, at=50)
    want = rope.rotate_layers(keys.double(), torch.arange(50, 60)).to(torch.bfloat16)
    assert (placed.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()


@pytest.mark.parametrize("eviction, survivors", [("fifo", [2, 3, 4, 5]), ("lru", [0, 3, 4, 5])])
def test_capacity_evicts_by_policy(eviction, survivors):
    memory = MemArtPool(capacity=4, eviction=eviction)
    turn(memory, 12, 0)  # blocks 0, 1, 2
    memory.take([0])  # block 0 retrieved: LRU keeps it
    turn(memory, 12, 1)  # blocks 3, 4, 5: two must go
    assert sorted(memory.blocks) == survivors and memory.evictor.evicted == 2
    assert memory.index().ids == survivors


# --- the request field -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"memory": {"mode": "retrieve"}}, "needs sgl_memory.session_id"),
        ({"session_id": "s", "memory": {"mode": "recall"}}, "mode 'recall' is unknown"),
        ({"session_id": "s", "memory": {"top_k": 0}}, "top_k must be an integer"),
        ({"session_id": "s", "memory": {"norm": "l2"}}, "norm 'l2' is unknown"),
        ({"session_id": "s", "memory": {"store": "no"}}, "store must be true or false"),
        ({"session_id": "s", "memory": {"probe": "x"}}, "unknown field(s) probe"),
        ({"session_id": "s", "memory": []}, "memory must be an object"),
        ({"session_id": "s", "memory": {"unit": "sentence"}}, "unit 'sentence' is unknown"),
        ({"session_id": "s", "memory": {"placed_tokens": -1}}, "placed_tokens must be an integer"),
        ({"session_id": "s", "memory": {"placed_tokens": True}}, "placed_tokens must be an integer"),
    ],
)
def test_bad_memory_fields_are_refused(raw, needle):
    with pytest.raises(SpecError, match=None) as exc:
        parse(raw)
    assert needle in str(exc.value)


def test_memory_field_defaults():
    memory = parse({"session_id": "s", "memory": {"mode": "retrieve", "top_k": 8}}).part("memory")
    assert memory.top_k == 8 and memory.store and memory.norm is None and memory.probe is None
    probe = parse({"session_id": "s", "memory": {"mode": "probe", "probe": "p"}}, internal=True)
    assert probe.part("memory").probe == "p" and probe.owner == "memory" and probe.transient and probe.reads_only


# --- blocks cut at lines, and the header blocks placed with a chosen one ------------------------

NL = 99  # the line-end token of these tests


@pytest.mark.parametrize("seed", range(6))
def test_pieces_end_at_block_size_and_after_every_line_end(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = [NL if x < 0.15 else int(x * 50) for x in torch.rand(90, generator=g).tolist()]
    got = pieces(tokens, 8, frozenset({NL}))
    assert [t for s, e in got for t in tokens[s:e]] == tokens and got[0][0] == 0
    for (s, e), (s2, _) in zip(got, got[1:]):
        assert e == s2
    for s, e in got:
        assert 1 <= e - s <= 8 and NL not in tokens[s : e - 1]  # a line end only as a block's last token
        full = e - s == 8 or tokens[e - 1] == NL or e == len(tokens)
        assert full, (s, e)  # a block ends early only at a line end (or the turn's end)
    assert pieces(tokens, 8) == [(s, min(s + 8, 90)) for s in range(0, 90, 8)]


def test_the_first_block_of_a_turn_and_of_a_line():
    memory = MemArtPool(capacity=100, line_ends=frozenset({NL}))
    keys = torch.randn(2, 30, 1, 8)
    # turn 0: a 3-token line, a 12-token line, a 5-token line (blocks of at most 4); turn 1: 10 tokens
    tokens = [1, 2, NL] + list(range(10, 21)) + [NL] + list(range(30, 35))
    memory.add_turn(tokens, keys[:, :20], keys[:, :20].to(torch.bfloat16), 4)
    memory.add_turn(list(range(40, 50)), keys[:, 20:], keys[:, 20:].to(torch.bfloat16), 4)
    spans = {b.id: (b.origin[0][1], len(b.tokens)) for b in memory.blocks.values()}
    assert [spans[i] for i in range(9)] == [(0, 3), (3, 4), (7, 4), (11, 4), (15, 4), (19, 1), (0, 4), (4, 4), (8, 2)]
    assert [memory.first_of(i, "turn") for i in range(9)] == [0] * 6 + [6] * 3
    assert [memory.first_of(i, "line") for i in range(9)] == [0, 1, 1, 1, 4, 4, 6, 6, 6]
    del memory.blocks[2]  # evicted on the way back: no header
    assert memory.first_of(3, "line") is None and memory.first_of(3, "turn") is None
    assert MemArtPool(capacity=1).first_of(0, "turn") is None
    plain = MemArtPool(capacity=100)
    plain.add_turn(tokens[:20], keys[:, :20], keys[:, :20].to(torch.bfloat16), 4)
    assert plain.first_of(3, "line") is None and plain.first_of(3, "turn") == 0  # lines are known where cut at them


def test_chosen_blocks_come_with_their_headers_within_the_budget():
    memory = MemArtPool(capacity=100, line_ends=frozenset({NL}))
    keys = torch.randn(2, 30, 1, 8)
    tokens = [1, 2, NL] + list(range(10, 21)) + [NL] + list(range(30, 35))  # blocks 0-5 as above
    memory.add_turn(tokens, keys[:, :20], keys[:, :20].to(torch.bfloat16), 4)
    memory.add_turn(list(range(40, 50)), keys[:, 20:], keys[:, 20:].to(torch.bfloat16), 4)  # blocks 6-8
    assert choose(memory, [3, 8], "none", None) == [3, 8]
    assert choose(memory, [3, 8], "turn", None) == [3, 0, 8, 6]
    assert choose(memory, [3, 8], "line", None) == [3, 1, 8, 6]
    assert choose(memory, [3, 8], "turn_line", None) == [3, 0, 1, 8, 6]
    assert choose(memory, [1, 3], "turn_line", None) == [1, 0, 3]  # a header chosen already is not placed twice
    # the budget counts the headers: block 3 (4 tokens) with block 0 (3) fits 7, not 6; block 8 (2) with 6 (4)
    assert choose(memory, [3, 8], "turn", 7) == [3, 0]
    assert choose(memory, [3, 8], "turn", 6) == [8, 6]
    del memory.blocks[0]
    assert choose(memory, [3], "turn", None) == [3]  # its turn's start was evicted: no header


@pytest.mark.parametrize("seed", range(6))
def test_a_blocks_line_is_every_block_of_the_line_it_is_in(seed):
    """MemArtPool.line against a reference that numbers each token's line from the turn's tokens
    (a line ends after a line-end token and at the turn's end), random turns and block sizes; a
    block evicted on the way splits its line, and without known lines a block is its own line."""
    g = torch.Generator().manual_seed(seed)
    size = int(torch.randint(2, 7, (1,), generator=g))
    memory = MemArtPool(capacity=1000, line_ends=frozenset({NL}))
    turns = []
    for _ in range(3):
        n = int(torch.randint(5, 40, (1,), generator=g))
        tokens = [NL if x < 0.12 else 1 + int(x * 50) for x in torch.rand(n, generator=g).tolist()]
        keys = torch.randn(1, n, 1, 4, generator=g)
        memory.add_turn(tokens, keys, keys, size)
        turns.append(tokens)
    line_of = {}  # (turn, offset) -> (turn, line number)
    for t, tokens in enumerate(turns):
        number = 0
        for o, token in enumerate(tokens):
            line_of[t, o] = (t, number)
            number += token == NL
    expected = {
        b.id: [c.id for c in memory.blocks.values() if line_of[c.origin[0]] == line_of[b.origin[0]]]
        for b in memory.blocks.values()
    }
    assert {b: memory.line(b) for b in memory.blocks} == expected
    gone = sorted(memory.blocks)[len(memory.blocks) // 2]
    del memory.blocks[gone]
    for b in memory.blocks:
        whole = expected[b]
        left = [c for c in whole if c < gone] if gone in whole and b < gone else None
        right = [c for c in whole if c > gone] if gone in whole and b > gone else None
        assert memory.line(b) == (left or right or whole)
    plain = MemArtPool(capacity=100)
    plain.add_turn(turns[0], torch.zeros(1, len(turns[0]), 1, 4), torch.zeros(1, len(turns[0]), 1, 4), size)
    assert all(plain.line(b) == [b] for b in plain.blocks)


def test_a_chosen_block_brings_its_line_and_its_headers_lines_within_the_budget():
    memory = MemArtPool(capacity=100, line_ends=frozenset({NL}))
    keys = torch.randn(2, 30, 1, 8)
    tokens = [1, 2, NL] + list(range(10, 21)) + [NL] + list(range(30, 35))  # lines: blocks [0], [1, 2, 3], [4, 5]
    memory.add_turn(tokens, keys[:, :20], keys[:, :20].to(torch.bfloat16), 4)
    memory.add_turn(list(range(40, 50)), keys[:, 20:], keys[:, 20:].to(torch.bfloat16), 4)  # one line: blocks 6-8
    assert choose(memory, [2, 8], "none", None, "line") == [1, 2, 3, 6, 7, 8]
    assert choose(memory, [5], "turn", None, "line") == [4, 5, 0]
    assert choose(memory, [8, 3], "turn", None, "line") == [6, 7, 8, 1, 2, 3, 0]
    # a header is the first block of its turn, not its whole line: the turn's start says the date
    memory.add_turn([1, 2, 3, 4, 5, 6, NL, 7], keys[:, :8], keys[:, :8].to(torch.bfloat16), 4)  # blocks 9, 10 | 11
    assert choose(memory, [11], "turn", None, "line") == [11, 9]
    # the budget counts whole lines: line [1, 2, 3] is 12 tokens, [4, 5] 5, [0] 3
    assert choose(memory, [2, 5, 0], "none", 8, "line") == [
        2,
        0,
    ]  # [1, 2, 3] passes 8: block 2 alone; then [4, 5] does not fit
    assert choose(memory, [5, 0, 2], "none", 8, "line") == [4, 5, 0]
    assert choose(memory, [2, 5, 0], "none", 12, "line") == [1, 2, 3]
    assert choose(memory, [2], "none", None, "block") == [2]
    # a line longer than the whole budget goes as its block alone: line [1, 2, 3] (12 tokens) in 10
    assert choose(memory, [2, 5], "none", 10, "line") == [2, 4, 5]
    assert choose(memory, [5, 2], "none", 10, "line") == [4, 5, 2]
    assert choose(memory, [5, 2], "none", 6, "line") == [4, 5]  # its block fits no more


def test_a_placed_line_is_one_segment_for_the_repair():
    """With whole lines placed, KEEP's segments are the lines (lengths counted from the tokens),
    blocks of one line that are not neighbours stay apart, and without lines every block is one."""
    memory = MemArtPool(capacity=100, line_ends=frozenset({NL}))
    keys = torch.randn(2, 30, 1, 8)
    tokens = [1, 2, NL] + list(range(10, 21)) + [NL] + list(range(30, 35))  # lines: blocks [0], [1, 2, 3], [4, 5]
    memory.add_turn(tokens, keys[:, :20], keys[:, :20].to(torch.bfloat16), 4)
    memory.add_turn(list(range(40, 50)), keys[:, 20:], keys[:, 20:].to(torch.bfloat16), 4)  # one line: blocks 6-8
    placed = memory.take([0, 1, 2, 3, 4, 6, 7, 8])
    assert memory.segments(placed, {}, lines=True) == [3, 12, 4, 10]
    assert memory.segments(placed, {}) == [len(b.tokens) for b in placed]
    assert memory.segments(memory.take([1, 3, 5]), {}, lines=True) == [4, 4, 1]  # 1 and 3 are not neighbours
