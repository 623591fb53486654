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

from sgl_memory.engine.radix_cache import SglMemoryRadixCache


class RecordingAllocator:
    """Stands in for the KV allocator: records every slot the tree frees."""

    device = "cpu"

    def __init__(self):
        self.freed: list[int] = []

    def free_segment(self, indices, start_pos=0):
        self.freed.extend(int(i) for i in indices)


def make_cache(cls, page_size=1):
    alloc = RecordingAllocator()
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page_size
    )
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


# --- every mode against plain RadixCache, on SGLang's real allocators ------------------------------

POOL_TOKENS = 96


class TinyKvPool:
    """Two layers of [slots, 1 head, 4]: what the tree's mechanisms read off a KV pool."""

    layer_num = 2
    start_layer = 0

    def __init__(self, size):
        self.k = [torch.zeros(size, 1, 4) for _ in range(self.layer_num)]
        self.v = [torch.zeros(size, 1, 4) for _ in range(self.layer_num)]

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


def real_allocator(page_size):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    pool = TinyKvPool(POOL_TOKENS + page_size)
    if page_size == 1:
        return TokenToKVPoolAllocator(POOL_TOKENS, torch.float32, "cpu", pool, need_sort=False)
    return PagedTokenToKVPoolAllocator(POOL_TOKENS, page_size, torch.float32, "cpu", pool, need_sort=False)


def mode_config(mode, tmp_path):
    from sgl_memory.core.config import plain
    from sgl_memory.intent.settings import IntentConfig
    from sgl_memory.persist.settings import PersistConfig
    from sgl_memory.memart.settings import MemArtConfig

    return {
        "off": plain(),
        "intent": plain(intent=IntentConfig(enabled=True)),
        "persist": plain(persist=PersistConfig(enabled=True, dir=str(tmp_path / "store"))),
        "memory": plain(memory=MemArtConfig(enabled=True)),
    }[mode]


def tree_context(tmp_path):
    """What the tree reads of SGLang's TreeCacheBuildContext to build its mechanisms."""
    from types import SimpleNamespace

    from transformers import Qwen2Config

    hf = Qwen2Config(hidden_size=64, num_attention_heads=16, num_key_value_heads=1, num_hidden_layers=2)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf),
        tp_rank=0,
        tp_size=1,
        server_args=SimpleNamespace(model_path=str(tmp_path), served_model_name="contract"),
    )


class CountingClock:
    """Distinct, increasing access times, so LRU eviction orders both trees' leaves the same way."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        self.now += 1.0
        return self.now

    def perf_counter(self):
        return self.now


MODES = [("off", 1), ("off", 4), ("intent", 1), ("persist", 1), ("persist", 4), ("memory", 1)]


@pytest.mark.parametrize("mode,page_size", MODES, ids=[f"{m}-page{p}" for m, p in MODES])
def test_every_mode_keeps_the_plain_radix_cache_contract(mode, page_size, tmp_path, monkeypatch):
    """Random insert / match (with splits) / lock / unlock / evict (half of them inside a deferred free
    group, as SGLang's result processing opens one) with extra keys, applied to plain RadixCache and
    to our tree in one mode, each on its own real SGLang allocator: after every step both hold the
    same tokens in the same slots (by allocation order), report the same sizes, and account for every
    slot of the pool; every eviction frees as many tokens as plain RadixCache's."""
    from sglang.srt.mem_cache import radix_cache as sglang_radix

    monkeypatch.setattr(sglang_radix, "time", CountingClock())
    trees, allocators = [], []
    for cls in (RadixCache, SglMemoryRadixCache):
        allocator = real_allocator(page_size)
        params = CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=page_size
        )
        tree = cls(params) if cls is RadixCache else cls(params, mode_config(mode, tmp_path), tree_context(tmp_path))
        trees.append(tree)
        allocators.append(allocator)
    plain, ours = trees
    held_by_ours = 1 if ours.host.sentinel is not None else 0  # the pruning sentinel is a real slot
    logical = [{}, {}]  # slot -> allocation order, per tree: slots differ, allocation order must not
    rng = random.Random(hash((mode, page_size)) & 0xFFFF)
    inserted: list[list[int]] = []
    locks: list[list] = []
    counter = 0

    def check():
        assert ours.total_size() == plain.total_size()
        assert ours.evictable_size() == plain.evictable_size()
        assert ours.protected_size() - held_by_ours == plain.protected_size()
        held = [
            sorted(logical[i][s] for s in (t.all_values_flatten().tolist() if t.total_size() else []))
            for i, t in enumerate(trees)
        ]
        assert held[1] == held[0]
        for tree, allocator in zip(trees, allocators):
            assert allocator.available_size() + tree.evictable_size() + tree.protected_size() == POOL_TOKENS

    for _ in range(300):
        op = rng.random()
        extra = rng.choice([None, None, "a", "b"])
        if op < 0.4:
            if inserted and rng.random() < 0.6:
                base = rng.choice(inserted)
                seq = base[: rng.randint(0, len(base)) // page_size * page_size]
            else:
                seq = []
            seq = seq + [rng.randint(0, 4) for _ in range(page_size * rng.randint(1, 3))]
            if any(a.available_size() < len(seq) for a in allocators):
                for tree in trees:
                    tree.evict(EvictParams(num_tokens=len(seq)))
            results = []
            for i, (tree, allocator) in enumerate(zip(trees, allocators)):
                slots = allocator.alloc(len(seq))
                assert slots is not None
                for j, s in enumerate(slots.tolist()):
                    logical[i][s] = counter + j
                result = tree.insert(InsertParams(key=RadixKey(seq, extra), value=slots.to(torch.int64)))
                allocator.free(slots[: result.prefix_len])  # the scheduler frees what the tree already held
                results.append(result.prefix_len)
            counter += len(seq)
            assert results[1] == results[0]
            inserted.append(seq)
        elif op < 0.65:
            query = (rng.choice(inserted)[: rng.randint(0, 12)] if inserted else []) + [rng.randint(0, 4)]
            found = [tree.match_prefix(MatchPrefixParams(key=RadixKey(query, extra))) for tree in trees]
            assert found[1].device_prefix_len == found[0].device_prefix_len
            paths = [
                [logical[i][s] for s in t.path_device_indices(f.last_device_node).tolist()]
                for i, (t, f) in enumerate(zip(trees, found))
            ]
            assert paths[1] == paths[0]
            if rng.random() < 0.5 and found[0].device_prefix_len:
                locks.append([(t, f.last_device_node) for t, f in zip(trees, found)])
                for tree, node in locks[-1]:
                    tree.inc_lock_ref(node)
        elif op < 0.75 and locks:
            for tree, node in locks.pop(rng.randrange(len(locks))):
                tree.dec_lock_ref(node)
        else:
            want = rng.randint(1, 3 * page_size)
            grouped = rng.random() < 0.5
            evicted = []
            for tree, allocator in zip(trees, allocators):
                if grouped:
                    allocator.free_group_begin()
                evicted.append(tree.evict(EvictParams(num_tokens=want)).num_tokens_evicted)
                if grouped:
                    allocator.free_group_end()
            assert evicted[1] == evicted[0]
        check()


def test_fresh_slots_come_from_eviction_inside_a_free_group(tmp_path):
    """The tree's alloc_slots on a full pool inside a deferred free group (intent's compression event runs
    in SGLang's result processing, which opens one): the slots eviction frees are handed out at
    once, the group still ends where its caller ends it, and every slot of the pool is accounted
    for (held by the caller, the tree, or free)."""
    allocator = real_allocator(1)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=1)
    tree = SglMemoryRadixCache(params, mode_config("intent", tmp_path), tree_context(tmp_path))
    held = 1  # the pruning sentinel
    for first in range(3):  # three evictable paths fill the pool
        n = allocator.available_size() if first == 2 else (POOL_TOKENS - held) // 3
        tree.insert(InsertParams(key=RadixKey([first] + [9] * (n - 1)), value=allocator.alloc(n).to(torch.int64)))
    assert allocator.available_size() == 0
    allocator.free_group_begin()
    slots = tree.host.alloc_slots(40)
    assert slots is not None and len(set(slots.tolist())) == 40
    assert allocator.free_group is not None  # still open: its caller ends it
    allocator.free_group_end()
    assert allocator.available_size() + tree.evictable_size() + tree.protected_size() + 40 == POOL_TOKENS


def test_sentinel_safe_allocator_forwards_each_free_variant():
    """free_full / free_segment / their batched forms reach the same variant of the real allocator
    (an SWA allocator's free_full must not free the SWA slot), with the sentinel's entries cut out
    and each remaining run of a segment at its own start position."""
    from types import SimpleNamespace

    from sgl_memory.engine.dead_slots import SentinelSafeAllocator

    calls = []

    class Recorder:
        def free(self, index):
            calls.append(("free", index.tolist(), None))

        def free_full(self, index):
            calls.append(("free_full", index.tolist(), None))

        def free_segment(self, index, *, start_pos):
            calls.append(("free_segment", index.tolist(), start_pos))

        def free_full_segment(self, index, *, start_pos):
            calls.append(("free_full_segment", index.tolist(), start_pos))

        def free_segments(self, segments):
            calls.append(("free_segments", [(i.tolist(), p) for i, p in segments], None))

        def free_full_segments(self, segments):
            calls.append(("free_full_segments", [(i.tolist(), p) for i, p in segments], None))

    view = SentinelSafeAllocator(Recorder(), SimpleNamespace(sentinel=7))
    row = torch.tensor([3, 4, 7, 7, 5, 7, 6])  # positions 10..16 of a row; 7 is the sentinel
    view.free(row)
    view.free_full(row)
    view.free_segment(row, start_pos=10)
    view.free_full_segment(row, start_pos=10)
    view.free_segments([(row, 10), (torch.tensor([8, 9]), 20)])
    view.free_full_segments([(torch.tensor([7, 9]), 30)])
    assert calls == [
        ("free", [3, 4, 5, 6], None),
        ("free_full", [3, 4, 5, 6], None),
        ("free_segment", [3, 4], 10),
        ("free_segment", [5], 14),
        ("free_segment", [6], 16),
        ("free_full_segment", [3, 4], 10),
        ("free_full_segment", [5], 14),
        ("free_full_segment", [6], 16),
        ("free_segments", [([3, 4], 10), ([5], 14), ([6], 16), ([8, 9], 20)], None),
        ("free_full_segments", [([9], 31)], None),
    ]
    assert view.real_freed == 4 * 5 + 2 + 1


def test_the_tree_applies_the_composition_rules_to_rows_and_paths():
    """Composition is by rule, not by order (core/composition.py, tests/test_composition.py): the
    tree asks its composition, so two mechanisms that both edit a request's row at its checkpoint,
    or both branch its path, stop the tree naming both (the second's edit would silently replace
    the first's), and the one that does is handed on."""
    from test_composition import fake

    from sgl_memory.core.composition import Composition

    cache, _ = make_cache(SglMemoryRadixCache)
    req = object()
    cache.composition = Composition(
        [fake("a", on_checkpoint="row edit"), fake("b"), fake("c", on_checkpoint="another")]
    )
    with pytest.raises(RuntimeError, match="^a and c each edits the request's row"):
        cache.checkpoint(req, up_to=0)
    ids = lambda ids: ids  # noqa: E731
    cache.composition = Composition(
        [fake("a", branches=((0, 1),), branch_ids=ids), fake("b", branches=((2, 3),), branch_ids=ids)]
    )
    with pytest.raises(RuntimeError, match="^a and b each branches the request's path"):
        cache.host.branches(req)
    with pytest.raises(RuntimeError, match="^a and b each branches the request's path"):
        cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3]), req=req))
    cache.composition = Composition([fake("a"), fake("b", branches=((2, 3),))])
    assert cache.host.branches(req) == ((2, 3),)
    cache.composition = Composition([])
    assert cache.host.branches(req) == ()
