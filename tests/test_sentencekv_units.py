"""SentenceKV's parts against brute-force references: segmentation, the prefill pool, the sentence
vectors, retrieval, and the decode attention the CPU backend runs over a step's reads (against a
masked softmax attention over exactly those positions)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sgl_memory.core import config, request
from sgl_memory.core.request import SpecError
from sgl_memory.engine.attention.cpu_backend import plan_requests, run_plans, with_step_reads
from sgl_memory.sentencekv.segment import sentence_ids
from sgl_memory.sentencekv.settings import SentenceKVConfig
from sgl_memory.sentencekv.select import SentenceReads, page_table, retrieve, sentence_table, top_tokens


def reference_sentences(tokens, ends, max_sentence):
    out, current, run = [], 0, 0
    for i, t in enumerate(tokens):
        if i and (ends[tokens[i - 1]] or run == max_sentence):
            current, run = current + 1, 0
        out.append(current)
        run += 1
    return out


@pytest.mark.parametrize("max_sentence", [1, 3, 64])
def test_sentences_end_after_a_boundary_token_or_at_the_cap(max_sentence):
    rng = np.random.default_rng(max_sentence)
    ends = rng.random(50) < 0.15
    tokens = rng.integers(0, 50, size=300)
    assert sentence_ids(tokens, ends, max_sentence).tolist() == reference_sentences(tokens, ends, max_sentence)


def test_tokens_outside_the_boundary_table_end_nothing():
    assert sentence_ids(np.array([5, 7, 9]), np.zeros(0, dtype=bool), 2).tolist() == [0, 0, 1]


def test_the_pool_is_the_highest_scores_earlier_first_on_ties():
    scores = torch.tensor([0.5, 0.9, 0.5, 0.1, 0.9, 0.5])
    ranked = sorted(range(6), key=lambda i: (-float(scores[i]), i))
    for size in range(8):
        assert top_tokens(scores, size).tolist() == sorted(ranked[:size])


def make_table(seed=0, pool=40, kv_heads=2, dim=8):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randperm(200, generator=g)[:pool].sort().values
    sentence_of = torch.arange(200) // 23  # sentences of 23 positions
    keys = torch.randn(pool, kv_heads, dim, generator=g)
    return positions, sentence_of, keys, sentence_table(positions, sentence_of, keys)


def test_each_sentence_vector_is_the_mean_of_its_pool_keys():
    positions, sentence_of, keys, table = make_table()
    ids = sorted(set(sentence_of[positions].tolist()))
    assert table.sizes.tolist() == [int((sentence_of[positions] == s).sum()) for s in ids]
    for j, s in enumerate(ids):
        mine = sentence_of[positions] == s
        torch.testing.assert_close(table.vectors[j], keys[mine].mean(0))


def brute_retrieve(positions, sentence_of, keys, q, budget):
    """Sentences by q . mean key summed over heads (GQA), best first, while they fit; a sentence
    longer than the budget is passed over."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    ids = sorted(set(sentence_of[positions].tolist()))
    score, size = {}, {}
    for s in ids:
        mine = keys[sentence_of[positions] == s]
        mean = mine.mean(0)
        score[s] = sum(float(q[h] @ mean[h // (heads // kv_heads)]) for h in range(heads))
        size[s] = mine.shape[0]
    taken, used = [], 0
    for s in sorted((s for s in ids if size[s] <= budget), key=lambda s: (-score[s], s)):
        if used + size[s] > budget:
            break
        taken.append(s)
        used += size[s]
    return [p for p in positions.tolist() if int(sentence_of[p]) in taken], len(taken)


@pytest.mark.parametrize("budget", [0, 5, 12, 25, 1000])
def test_retrieval_takes_the_best_sentences_while_they_fit(budget):
    positions, sentence_of, keys, table = make_table(seed=budget)
    q = torch.randn(4, keys.shape[2], generator=torch.Generator().manual_seed(7))
    got, n = retrieve(table, q, budget)
    assert (got.tolist(), n) == brute_retrieve(positions, sentence_of, keys, q, budget)


@pytest.mark.parametrize("budget", [0, 16, 40, 1000])
def test_page_retrieval_ranks_pages_by_the_bound_of_the_steps_query(budget):
    """Quest: a page's score is sum over heads and channels of max(q * min key, q * max key)."""
    g = torch.Generator().manual_seed(budget)
    positions = torch.arange(3, 120)
    keys = torch.randn(positions.numel(), 2, 8, generator=g)
    pages = torch.arange(200) // 16
    table = page_table(positions, pages, keys)
    q = torch.randn(4, 8, generator=g)
    ids = sorted(set(pages[positions].tolist()))
    score, size = {}, {}
    for p in ids:
        mine = keys[pages[positions] == p]
        lo, hi = mine.min(0).values, mine.max(0).values
        score[p] = sum(float(torch.maximum(q[h] * lo[h // 2], q[h] * hi[h // 2]).sum()) for h in range(4))
        size[p] = mine.shape[0]
    taken, used = [], 0
    for p in sorted(ids, key=lambda p: (-score[p], p)):
        if used + size[p] > budget:
            break
        taken.append(p)
        used += size[p]
    got, n = retrieve(table, q, budget)
    assert n == len(taken) and got.tolist() == [x for x in positions.tolist() if int(pages[x]) in taken]


def masked_attention(q, k_pool, v_pool, slots, scale):
    """Plain softmax attention of one query [H, D] over the pool rows `slots`, GQA by repetition."""
    k, v = k_pool[slots].float(), v_pool[slots].float()
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,nhd->hn", q.float(), k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", weights, v)


class Scripted:
    """Step reads that give fixed positions per layer (the backend's side only)."""

    def __init__(self, per_layer):
        self.per_layer, self.calls = per_layer, []

    def positions(self, layer, q, token, length):
        self.calls.append((layer, token, length))
        return self.per_layer[layer]


def test_a_decode_step_attends_exactly_the_positions_its_reads_give():
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, pool_size = 4, 2, 16, 400
    k_pool, v_pool = (
        torch.randn(pool_size, kv_heads, dim, generator=g),
        torch.randn(pool_size, kv_heads, dim, generator=g),
    )
    req_to_token = torch.zeros(2, 128, dtype=torch.int64)
    req_to_token[0, :90] = torch.randperm(pool_size, generator=g)[:90]
    req_to_token[1, :60] = torch.arange(200, 260)
    sentinel = int(req_to_token[0, 5])  # request 0's position 5 was pruned: never read
    query = torch.randn(2, heads, dim, generator=g)
    plans = plan_requests(req_to_token, [0, 1], [89, 59], [1, 1], sentinel)
    chosen = torch.tensor([0, 1, 5, 17, 18, 19, 40, 41, 88, 89])
    reads = Scripted({3: chosen})
    scale = 1 / math.sqrt(dim)
    out = run_plans(
        with_step_reads(plans, {0: (reads, 0, 90, 42)}, 3, query, req_to_token, sentinel),
        query,
        torch.empty_like(query),
        k_pool,
        v_pool,
        scale,
    )
    assert reads.calls == [(3, 42, 90)]
    kept = [int(req_to_token[0, p]) for p in chosen if int(req_to_token[0, p]) != sentinel]
    torch.testing.assert_close(
        out[0].float(), masked_attention(query[0], k_pool, v_pool, kept, scale), atol=1e-5, rtol=1e-5
    )
    # the request without reads attends its whole row
    torch.testing.assert_close(
        out[1].float(), masked_attention(query[1], k_pool, v_pool, list(range(200, 260)), scale), atol=1e-5, rtol=1e-5
    )


def test_reading_every_position_is_the_full_attention_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    k_pool, v_pool = torch.randn(300, 2, 8, generator=g), torch.randn(300, 2, 8, generator=g)
    req_to_token = torch.arange(300).view(1, 300).clone()
    query = torch.randn(1, 4, 8, generator=g)
    plans = plan_requests(req_to_token, [0], [149], [1])
    full = run_plans(plans, query, torch.empty_like(query), k_pool, v_pool, None)
    every = run_plans(
        with_step_reads(plans, {0: (Scripted({0: torch.arange(150)}), 0, 150, 1)}, 0, query, req_to_token),
        query,
        torch.empty_like(query),
        k_pool,
        v_pool,
        None,
    )
    assert torch.equal(full, every)


def test_a_step_reads_the_always_read_the_retrieved_and_the_generated_positions():
    """Two layers with their own tables and queries: each layer's step reads its own retrieval
    (brute force over its table and the mean of its queries), the always-read and the generated."""
    made = [make_table(seed=s) for s in (1, 2)]
    reads = SentenceReads(
        torch.tensor([0, 1, 198, 199]),
        [t for *_, t in made],
        200,
        budget=10,
        interval=1,
        ends=np.zeros(100, dtype=bool),
    )
    g = torch.Generator().manual_seed(9)
    queries = torch.randn(3, 2, 4, 8, generator=g)  # steps x layers
    for step in range(3):
        for layer, (positions, sentence_of, keys, _) in enumerate(made):
            got = reads.positions(layer, queries[step, layer], 3, 201 + step)
            want, _ = brute_retrieve(positions, sentence_of, keys, queries[: step + 1, layer].mean(0), 10)
            assert got.tolist() == sorted({0, 1, 198, 199, *want}) + list(range(200, 201 + step))
    assert reads.metrics()["decode_steps"] == 3


def test_the_sentence_query_is_the_mean_since_the_last_boundary_and_interval_holds_a_retrieval():
    """Two sentences with opposite mean keys: the retrieval follows the sign of the mean query of
    the queries since the last boundary token (the query cache resets there), and with interval 2
    the step between retrievals reads what the last one chose."""
    keys = torch.tensor([[[1.0, 0.0]], [[-1.0, 0.0]]])
    table = sentence_table(torch.tensor([10, 20]), torch.arange(200), keys)
    ends = np.zeros(10, dtype=bool)
    ends[9] = True  # token 9 ends a sentence
    up, down = torch.tensor([[1.0, 0.0]]), torch.tensor([[-3.0, 0.0]])
    reads = SentenceReads(torch.zeros(0, dtype=torch.long), [table], 100, budget=1, interval=1, ends=ends)
    assert 10 in reads.positions(0, up, 1, 101).tolist()
    assert 20 in reads.positions(0, down, 1, 102).tolist()  # mean of up, down points down
    assert 10 in reads.positions(0, up, 9, 103).tolist()  # boundary: the cache holds `up` alone
    held = SentenceReads(torch.zeros(0, dtype=torch.long), [table], 100, budget=1, interval=2, ends=ends)
    assert 10 in held.positions(0, up, 1, 101).tolist()
    assert 10 in held.positions(0, down * 10, 1, 102).tolist()  # no retrieval on this step
    assert 20 in held.positions(0, down * 10, 1, 103).tolist()
    m = held.metrics()
    assert m["decode_steps"] == 3 and m["retrieved_sentences"] == 1.0


@pytest.mark.parametrize(
    "field, needle",
    [
        ({"budget": 0}, "sgl_memory.sentencekv.budget must be an integer"),
        ({"keep_factor": 0.5}, "sgl_memory.sentencekv.keep_factor must be a number in [1.0"),
        ({"interval": "2"}, "sgl_memory.sentencekv.interval"),
        ({"enabled": 1}, "sgl_memory.sentencekv.enabled must be true or false"),
        ({"boundaries": "."}, "sgl_memory.sentencekv: unknown field(s) boundaries"),
        ({"roles": "chatml"}, "sgl_memory.sentencekv: unknown field(s) roles"),
        ({"system": 1}, "sgl_memory.sentencekv.system must be true or false"),
        ({"selection": "chunks"}, "sgl_memory.sentencekv.selection 'chunks' is unknown; allowed: sentence, page"),
    ],
)
def test_bad_request_values_name_the_field(field, needle):
    with pytest.raises(SpecError) as exc:
        request.parse({"sentencekv": field})
    assert needle in str(exc.value)


def test_the_request_overrides_the_section():
    cfg = config.from_dict({"sentencekv": {"enabled": True, "budget": 100}})
    part = request.parse({"sentencekv": {"budget": 7, "keep_factor": 3}}).part("sentencekv")
    applied = part.over(cfg.of(SentenceKVConfig))
    assert (applied.budget, applied.keep_factor, applied.window, applied.pool) == (7, 3.0, 32, 21)
    with pytest.raises(config.ConfigError, match=r"sentencekv\.keep_factor"):
        config.from_dict({"sentencekv": {"keep_factor": 0.5}})
