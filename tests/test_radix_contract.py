"""SGLang's radix-cache contract, held against our backend and SGLang's own RadixCache alike.

Expected values come from brute-force references over the inserted sequences (longest common
prefix, first-writer-wins slot ownership), not from either implementation.
"""

from __future__ import annotations

import random

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sgl_memory.radix_cache import SglMemoryRadixCache


class RecordingAllocator:
    """Stands in for the KV allocator: records every slot the tree frees."""

    device = "cpu"

    def __init__(self):
        self.freed: list[int] = []

    def free_segment(self, indices, start_pos=0):
        self.freed.extend(int(i) for i in indices)


def make_cache(cls, page_size=1):
    alloc = RecordingAllocator()
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page_size)
    return cls(params), alloc


CLASSES = [SglMemoryRadixCache, RadixCache]


def insert(cache, tokens, slots, extra_key=None):
    return cache.insert(
        InsertParams(key=RadixKey(list(tokens), extra_key), value=torch.tensor(slots, dtype=torch.int64))
    )


def match(cache, tokens, extra_key=None):
    res = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens), extra_key)))
    return res.device_prefix_len, res.last_device_node


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("cls", CLASSES)
def test_insert_and_match_against_brute_force(cls):
    rng = random.Random(0)
    cache, _ = make_cache(cls)
    inserted: list[tuple[list[int], list[int]]] = []
    next_slot = 1
    for _ in range(60):
        if inserted and rng.random() < 0.6:  # branch off an existing sequence to force splits
            base = rng.choice(inserted)[0]
            seq = base[: rng.randint(0, len(base))] + [rng.randint(0, 5) for _ in range(rng.randint(1, 8))]
        else:
            seq = [rng.randint(0, 5) for _ in range(rng.randint(1, 12))]
        slots = list(range(next_slot, next_slot + len(seq)))
        next_slot += len(seq)
        prefix_len = insert(cache, seq, slots).prefix_len
        assert prefix_len == max((lcp(seq, s) for s, _ in inserted), default=0)
        inserted.append((seq, slots))

    for _ in range(200):
        query = [rng.randint(0, 5) for _ in range(rng.randint(0, 14))]
        n, node = match(cache, query)
        assert n == max((lcp(query, s) for s, _ in inserted), default=0)
        # first writer wins: slot i belongs to the earliest sequence that reached position i
        expected = []
        for i in range(n):
            expected.append(next(sl[i] for s, sl in inserted if lcp(query, s) > i))
        assert cache.path_device_indices(node).tolist() == expected
    assert cache.total_size() == len({tuple(s[: i + 1]) for s, _ in inserted for i in range(len(s))})


@pytest.mark.parametrize("cls", CLASSES)
def test_match_inside_a_node_splits_it_without_changing_size(cls):
    cache, _ = make_cache(cls)
    insert(cache, [1, 2, 3, 4], [10, 11, 12, 13])
    n, node = match(cache, [1, 2, 9])
    assert n == 2
    assert list(node.key.token_ids) == [1, 2]
    assert len(node.children) == 1
    assert cache.total_size() == 4
    assert match(cache, [1, 2, 3, 4])[0] == 4


@pytest.mark.parametrize("cls", CLASSES)
def test_page_alignment(cls):
    cache, _ = make_cache(cls, page_size=4)
    insert(cache, list(range(10)), list(range(100, 110)))
    assert cache.total_size() == 8  # the partial page is not cached
    assert match(cache, list(range(10)))[0] == 8
    assert match(cache, [0, 1, 2, 3, 4, 5, 99])[0] == 4  # a match never ends inside a page


@pytest.mark.parametrize("cls", CLASSES)
def test_extra_key_isolates_namespaces(cls):
    cache, _ = make_cache(cls)
    insert(cache, [1, 2, 3], [1, 2, 3], extra_key="tenant-a")
    assert match(cache, [1, 2, 3], extra_key="tenant-b")[0] == 0
    assert match(cache, [1, 2, 3])[0] == 0
    assert match(cache, [1, 2, 3], extra_key="tenant-a")[0] == 3


@pytest.mark.parametrize("cls", CLASSES)
def test_lock_protects_from_eviction_and_eviction_frees_exactly_the_evicted_slots(cls):
    rng = random.Random(1)
    cache, alloc = make_cache(cls)
    seqs = {}
    next_slot = 1
    for k in range(12):
        seq = [k % 3] + [rng.randint(0, 50) for _ in range(rng.randint(1, 6))]
        slots = list(range(next_slot, next_slot + len(seq)))
        next_slot += len(seq)
        r = insert(cache, seq, slots)
        alloc.free_segment(slots[: r.prefix_len])  # what the scheduler does with duplicates
        seqs[tuple(seq)] = slots
    owned_before = set(cache.all_values_flatten().tolist())
    alloc.freed.clear()

    protected_seq = list(next(iter(seqs)))
    _, node = match(cache, protected_seq)
    lock = cache.lock(node)
    protected_slots = set(cache.path_device_indices(node).tolist())
    assert cache.protected_size() == len(protected_slots)

    evicted = cache.evict(EvictParams(num_tokens=10**6)).num_tokens_evicted
    owned_after = set(cache.all_values_flatten().tolist())
    assert owned_after == protected_slots  # everything unlocked went, the locked path stayed
    assert len(alloc.freed) == len(set(alloc.freed)) == evicted  # no slot freed twice
    assert set(alloc.freed) == owned_before - protected_slots  # exactly the evicted slots
    assert cache.evictable_size() == 0

    cache.unlock(lock)
    alloc.freed.clear()
    cache.evict(EvictParams(num_tokens=10**6))
    assert set(alloc.freed) == protected_slots
    assert cache.total_size() == 0


def test_evict_respects_num_tokens():
    cache, alloc = make_cache(SglMemoryRadixCache)
    for k in range(5):
        insert(cache, [100 + k] * 4, list(range(10 * k, 10 * k + 4)))
    evicted = cache.evict(EvictParams(num_tokens=5)).num_tokens_evicted
    assert 5 <= evicted <= 8  # whole leaves are evicted, so it may overshoot by less than one leaf
    assert cache.total_size() == 20 - evicted
    assert len(alloc.freed) == evicted
