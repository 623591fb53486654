"""Eviction by next use and holds for waiting requests, on the engine's radix tree (no server).

References: SGLang's own RadixCache under its LRU policy (a tree nobody gave an expectation must
evict in the same order), and a brute-force order of the sessions by the next use each was given.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sgl_memory.engine.radix_cache import SglMemoryRadixCache
from test_radix_contract import RecordingAllocator
from sgl_memory.persist.next_use import NextUse
from sgl_memory.persist.session import Session
from sgl_memory.persist.settings import AgentHints, PersistConfig


def make(cls=SglMemoryRadixCache, policy="lru"):
    alloc = RecordingAllocator()
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1, eviction_policy=policy
    )
    return cls(params), alloc


def insert(cache, tokens, first_slot):
    cache.insert(InsertParams(key=RadixKey(list(tokens)), value=torch.arange(first_slot, first_slot + len(tokens))))
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens)))).last_device_node


SHARED = [1, 2, 3, 4]  # a system prompt every session starts with
SESSIONS = {name: SHARED + [10 * (i + 1) + k for k in range(6)] for i, name in enumerate("abcd")}


def evicted_order(cache, alloc) -> list[str]:
    """Evict one token at a time; the sessions in the order their own tokens left, then 'shared'."""
    slot_of = {}
    for i, name in enumerate(SESSIONS):
        slot_of.update({100 * (i + 1) + k: name for k in range(len(SHARED), len(SESSIONS[name]))})
    order = []
    while cache.evictable_size():
        cache.evict(EvictParams(num_tokens=1))
        for slot in alloc.freed:
            name = slot_of.get(slot, "shared")
            if name not in order:
                order.append(name)
        alloc.freed.clear()
    return order


def fill(cache):
    nodes = {}
    for i, (name, tokens) in enumerate(SESSIONS.items()):
        nodes[name] = insert(cache, tokens, 100 * (i + 1))
        time.sleep(0.002)  # distinct last-use times: a, then b, c, d
    return nodes


def test_a_tree_given_no_expectation_evicts_as_sglangs_lru():
    ours, our_alloc = make()
    theirs, their_alloc = make(RadixCache)
    fill(ours)
    fill(theirs)
    insert(ours, SESSIONS["a"], 100)  # a used again: last
    insert(theirs, SESSIONS["a"], 100)
    assert evicted_order(ours, our_alloc) == evicted_order(theirs, their_alloc) == ["b", "c", "d", "a", "shared"]


def test_idle_sessions_leave_by_furthest_next_use_and_a_done_one_first():
    cache, alloc = make()
    nodes = fill(cache)
    now = time.monotonic()
    expected = {"a": now + 100.0, "b": now + 1.0, "c": math.inf, "d": now + 30.0}
    for name, when in expected.items():
        cache.host.expect(nodes[name], lambda t, when=when: when)
    brute_force = sorted(expected, key=lambda n: -expected[n])  # furthest next use first
    assert evicted_order(cache, alloc) == brute_force + ["shared"] == ["c", "a", "d", "b", "shared"]


def test_another_policy_chosen_by_the_operator_is_kept():
    cache, alloc = make(policy="fifo")
    nodes = fill(cache)
    cache.host.expect(nodes["a"], lambda t: 0.0)  # would be last under next use
    # fifo: by creation, a's node first (the shared prefix was split off it later, by b's insert)
    assert evicted_order(cache, alloc) == ["a", "b", "c", "d", "shared"]


class Req:
    """A scheduler request as the tree sees one: hashable by identity."""


def test_a_held_path_is_not_evicted_until_its_request_leaves_the_queue():
    cache, alloc = make()
    nodes = fill(cache)
    waiting, running = Req(), Req()
    cache.host.hold(waiting, nodes["a"], len(SESSIONS["a"]))
    cache.host.hold(running, nodes["b"], len(SESSIONS["b"]))
    assert cache.host.held_tokens() == 20
    scheduler = SimpleNamespace(waiting_queue=[waiting])
    cache.holds.after_prefill(scheduler, scheduled=True, idle=False)  # `running` left the queue: its hold goes
    assert cache.host.held_tokens() == 10
    order = evicted_order(cache, alloc)
    assert "a" not in order and "b" in order
    # nothing ran and nothing could be scheduled while it waits: every hold goes
    cache.holds.after_prefill(scheduler, scheduled=False, idle=True)
    assert cache.host.held_tokens() == 0 and evicted_order(cache, alloc) == ["a", "shared"]


def predictor(**config) -> NextUse:
    return NextUse(PersistConfig(enabled=True, **config), SimpleNamespace())  # the predictor's state only: no tree


def test_without_hints_the_default_orders_by_last_use_and_learns_nothing_into_it():
    m = predictor()
    s = Session(None, "s")
    for _ in range(2):
        m.finished(s, None)
        m.came_back(s)
    m.finished(s, None)
    assert m.next_use(s, s.finished_at + 3) == pytest.approx(
        s.finished_at + 6
    )  # as far ahead as its last use is behind
    m.finished(s, AgentHints(expected_tool_duration_ms=2000))
    assert m.next_use(s, s.finished_at) == pytest.approx(s.finished_at + 2)  # a hint still counts


def test_next_use_from_hints_learned_gaps_and_last_use():
    m = predictor(max_keep_ms=5000, eviction="learned")
    s = Session(None, "s")
    m.finished(s, None)
    t = s.finished_at
    assert m.next_use(s, t + 3) == pytest.approx(t + 6)  # nothing known: as far ahead as its last use is behind
    m.came_back(s)  # back after a gap: learned
    gap = s.gap
    assert s.finished_at is None and m.next_use(s, time.monotonic()) == pytest.approx(time.monotonic(), abs=0.1)
    m.finished(s, None)
    assert m.next_use(s, s.finished_at) == pytest.approx(s.finished_at + gap)
    m.finished(s, AgentHints(expected_tool_duration_ms=2000))
    t = s.finished_at
    assert m.next_use(s, t) == pytest.approx(t + 2)
    assert m.next_use(s, t + 5) == pytest.approx(t + 8)  # 3 s overdue: read as 3 s further out
    m.finished(s, AgentHints(cache_ttl_ms=60_000, expected_tool_duration_ms=10_000))
    t = s.finished_at
    assert m.next_use(s, t + 1) == t + 1  # kept: next use is now ...
    assert m.next_use(s, t + 6) == pytest.approx(t + 10)  # ... for max_keep_ms only
    m.finished(s, AgentHints(done=True))
    assert m.next_use(s, s.finished_at + 1) == math.inf
    other = Session(None, "o")  # a session never seen back uses the server's gaps
    m.finished(other, None)
    assert m.next_use(other, other.finished_at) == pytest.approx(other.finished_at + m.gap)


def test_a_demoted_session_leaves_the_pool_and_then_host_memory_first_and_is_forgotten_when_back():
    """`demote` (kv_hints): its next use is as far as a done session's, until a turn of it comes back;
    the warm tier then drops its stored form before a less recently used session's."""
    from sgl_memory.core.sessions import SessionRegistry
    from sgl_memory.persist.session import Sessions
    from sgl_memory.persist.warm import WarmTier

    m = predictor()
    s = Session(None, "s")
    m.finished(s, AgentHints(demote=True, expected_tool_duration_ms=1000))
    assert m.next_use(s, s.finished_at) == math.inf
    m.came_back(s)
    m.finished(s, None)
    assert m.next_use(s, s.finished_at + 1) == pytest.approx(s.finished_at + 2)  # last use order again

    sessions = Sessions(SessionRegistry(), "persist")
    old, demoted = (sessions.get(None, name, create=True) for name in ("old", "demoted"))
    for session, hint in ((old, None), (demoted, AgentHints(demote=True))):
        session.record, session.on_disk = SimpleNamespace(nbytes=lambda: 100), True
        m.finished(session, hint)
    assert [x.session_id for x in sessions.all()] == ["old", "demoted"]  # old is the least recently used
    WarmTier(PersistConfig(warm_bytes=150), sessions).trim()
    assert demoted.record is None and old.record is not None


def test_a_prefetch_of_a_session_without_a_file_brings_back_nothing_and_the_scheduler_goes_on():
    """A session expected back whose stored form is neither in host memory nor on disk (its turn
    still being written, or the quota dropped its file): the prefetch restores nothing. Found by
    bench/agent_traces.py's kv_hints replay, where it stopped the scheduler."""
    from sgl_memory.persist.prefetch import Prefetch

    tree = SimpleNamespace(
        page_size=1,
        sentinel=None,
        tp_size=1,
        key=lambda tokens, *rest: tokens,
        match=lambda key: SimpleNamespace(device_prefix_len=0),
        room=lambda: 1000,
    )
    files = SimpleNamespace(read=lambda tenant, session_id: None)
    config = PersistConfig(enabled=True, prefetch_ms=1000)
    prefetch = Prefetch(config, tree, files, predictor())
    s = Session(None, "s", tokens=[1, 2, 3, 4], extra_key=None)
    s.finished_at, s.expected_at = time.monotonic(), time.monotonic()
    prefetch.watch(s)
    prefetch.run()
    assert s.prefetched == 0
