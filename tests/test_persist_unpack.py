"""A restore unpacked off the scheduler's step: slots reserved by the scheduler, written by another
thread, inserted at a later step; the unpack thread's jobs.

References: the slots the raw allocator hands out and takes back, the KV read back from the pool at
the slots the tree's own prefix match returns, and the thread each piece of work ran on.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from sgl_memory.core import tree_fill
from sgl_memory.core.config import plain
from sgl_memory.engine.radix_cache import SglMemoryRadixCache
from sgl_memory.persist.unpack import Unpacker
from test_slot_accounting import FakeKvPool

POOL = 64


def tree():
    pool = FakeKvPool(POOL)
    alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", pool, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1)
    return SglMemoryRadixCache(params, plain()), pool, alloc


def kv_of(tokens):
    """[layers, n, 1 head, 2]: (token, position) at each position, as the fake pool's V holds them."""
    one = torch.tensor([[float(t), float(p)] for p, t in enumerate(tokens)]).unsqueeze(1)
    return torch.stack([one, one]), torch.stack([one, one])


def read_back(cache, pool, tokens):
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens))))
    slots = cache.path_device_indices(match.last_device_node)[: match.device_prefix_len]
    return match.device_prefix_len, pool.v[0][slots.long(), 0]


def test_a_restore_reserved_here_written_on_another_thread_lands_with_its_kv():
    cache, pool, alloc = tree()
    shared, tokens = [1, 2, 3, 4], [1, 2, 3, 4, 9, 8, 7, 6, 5]
    keys, values = kv_of(shared)
    host = cache.host
    assert tree_fill.place(host, RadixKey(shared), host.match(RadixKey(shared)), keys, values)
    key = RadixKey(list(tokens))
    match = host.match(key)
    reserved = tree_fill.reserve(host, key, match)
    assert match.device_prefix_len == 4 and len(reserved.slots) == 5
    assert alloc.available_size() == POOL - 9  # the reserved slots are taken ...
    assert read_back(cache, pool, tokens)[0] == 4  # ... and not in the tree yet
    keys, values = kv_of(tokens)
    writer = threading.Thread(target=tree_fill.write, args=(host, reserved, keys[:, 4:], values[:, 4:]))
    writer.start()
    writer.join()
    tree_fill.insert(host, reserved)
    found, kv = read_back(cache, pool, tokens)
    assert found == 9 and torch.equal(kv, values[0, :, 0])
    assert cache.protected_size() == 0  # the matched part was locked only while the restore ran


def test_a_second_restore_of_a_path_that_landed_first_gives_its_slots_back():
    cache, pool, alloc = tree()
    tokens = list(range(10, 20))
    keys, values = kv_of(tokens)
    key, host = RadixKey(tokens), cache.host
    first, second = (tree_fill.reserve(host, key, host.match(key)) for _ in range(2))
    for reserved in (first, second):
        tree_fill.write(host, reserved, keys, values)
    tree_fill.insert(host, first)
    tree_fill.insert(host, second)
    assert alloc.available_size() == POOL - 10 and cache.evictable_size() == 10
    assert torch.equal(read_back(cache, pool, tokens)[1], values[0, :, 0])
    abandoned = tree_fill.reserve(host, RadixKey(tokens + [1, 2]), host.match(RadixKey(tokens + [1, 2])))
    tree_fill.release(host, abandoned)
    assert alloc.available_size() == POOL - 10 and cache.protected_size() == 0


def test_jobs_run_off_the_callers_thread_land_in_order_and_an_abandoned_one_ends_first():
    unpacker = Unpacker()
    ran, gate = [], threading.Event()

    def work(name, block=False):
        def run():
            if block:
                gate.wait(10)
            ran.append((name, threading.current_thread().name))
            return {"dequantize": 1.0}

        return run

    unpacker.start("a", 100, "ctx-a", work("a"))
    unpacker.start("b", 50, "ctx-b", work("b"))
    assert unpacker.running("a") and unpacker.tokens() == 150
    assert unpacker.settle(10)
    assert [(j.owner, j.context, j.future.result()) for j in unpacker.finished()] == [
        ("a", "ctx-a", {"dequantize": 1.0}),
        ("b", "ctx-b", {"dequantize": 1.0}),
    ]
    assert {thread for _, thread in ran} == {"sgl-memory-unpack_0"} and unpacker.tokens() == 0
    unpacker.start("c", 10, "ctx-c", work("c", block=True))
    threading.Timer(0.2, gate.set).start()
    t0 = time.monotonic()
    job = unpacker.abandon("c")  # its slots go back only once it stopped writing them
    assert job.context == "ctx-c" and ran[-1][0] == "c" and time.monotonic() - t0 > 0.1
    assert not unpacker.running("c") and unpacker.finished() == []

    def broken():
        raise ValueError("damaged block")

    unpacker.start("d", 1, None, broken)
    unpacker.settle(10)
    (job,) = unpacker.finished()
    with pytest.raises(ValueError, match="damaged block"):
        job.future.result()
