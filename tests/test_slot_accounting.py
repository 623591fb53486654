"""Slot accounting of the dead-slot substrate, as a randomized property test.

The real radix tree (ours), SGLang's real token allocator and req_to_token pool, and the real
pruner (random scorer, random budgets) go through the scheduler's sequence of calls: match + lock,
prefill, the prefill checkpoint (where pruning happens), decode steps, and release (checkpoint,
free_kv_row, unlock, on_release), with evictions in between, for requests that share prefixes.
After every step the test checks, from the raw allocator and tree state rather than from the
tree's own counters:
- every slot is exactly one of free / held by the tree / private to a running request / the sentinel;
- the tree's evictable + protected sizes equal the real slots it holds (+ the sentinel), so
  SGLang's idle leak check (available + evictable + protected == total) holds;
- every running request still reads, at each live position, the KV written for that token there.

The second simulation runs all three mechanisms in one tree: sessions whose paths persistence
restores (from its host-memory tier, with their live masks) after eviction, and memory-mode
requests whose blocks KV memory places before the prompt.
"""

from __future__ import annotations

import json
import random
from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey

from sgl_memory.core.composition import Composition
from sgl_memory.engine.admission import ADMITTED
from sgl_memory.core.config import plain
from sgl_memory.intent.settings import IntentConfig
from sgl_memory.memart.manager import MemArtManager
from sgl_memory.memart.queries import Probe
from sgl_memory.memart.settings import MemArtConfig
from sgl_memory.persist.manager import SessionPersistence
from sgl_memory.persist.settings import PersistConfig
from sgl_memory.persist.store import CacheSpec
from sgl_memory.core.request import of_request
from sgl_memory.core.rope import Rope
from sgl_memory.core.spans import RoleMarkers
from sgl_memory.engine import integrity
from sgl_memory.engine.radix_cache import SglMemoryRadixCache

POOL = 400
ROWS = 6
CONTEXT = 128


class FakeKvPool:
    """Two layers of [slots, 1 head, 2]: V holds (token, position) of what was written in a slot."""

    layer_num = 2

    def __init__(self, size):
        self.k = [torch.zeros(size + 1, 1, 2) for _ in range(self.layer_num)]
        self.v = [torch.zeros(size + 1, 1, 2) for _ in range(self.layer_num)]

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


class FakeReq:
    def __init__(self, rid, tokens, budget, **field):
        self.rid = rid
        self.origin_input_ids = self.origin_input_ids_unpadded = array("q", tokens)  # as SGLang's Req holds them
        self.seq = array("q", tokens)  # tokens with KV written
        self.output_ids: list[int] = []
        self.kv = ReqKvInfo()
        self.extra_key = self.cache_salt = self.priority = None
        self.lock = self.last_node = None
        self.customized_info = None
        self.time_stats = None  # SGLang's clock of the request: never stamped here
        self.skip_radix_cache_insert = False
        self.return_logprob = False
        self.logprob_start_len = -1  # SGLang's value without log-probabilities
        self.cached_tokens = 0
        self.done = False
        spec = {"budget": budget, "scorer": "random", **field}

        class SP:
            custom_params = {"sgl_memory": json.dumps(spec)}

        self.sampling_params = SP()

    def finished(self):
        return self.done

    @property
    def full_untruncated_fill_ids(self):
        return self.seq


class Sim:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.kv = FakeKvPool(POOL)
        self.alloc = TokenToKVPoolAllocator(POOL, torch.float32, "cpu", self.kv, need_sort=False)
        self.rtt = ReqToTokenPool(ROWS, CONTEXT, "cpu", False)
        config = plain(intent=IntentConfig(enabled=True, query_tail=2, session_prefix_tokens=4))
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.rtt, token_to_kv_pool_allocator=self.alloc, page_size=1
        )
        self.tree = SglMemoryRadixCache(params, config)
        self.pruner = self.tree.composition.get("intent")
        self.pruner.planner.markers = RoleMarkers(None, {})
        self.free_rows = list(range(ROWS))
        self.running: list[FakeReq] = []
        self.bases = [[self.rng.randint(0, 6) for _ in range(24)] for _ in range(3)]
        self.next_rid = 0
        self.pruned = 0
        self.reused = 0  # requests that matched into a pruned path of their own session
        self.copied = 0  # kept positions of a shared path an event copied into its branch's own slots

    def prompt(self) -> tuple[list[int], int]:
        """A prompt and the shared prefix it starts from."""
        base = self.rng.randrange(len(self.bases))
        tail = [self.rng.randint(0, 6) for _ in range(self.rng.randint(1, 10))]
        return self.bases[base][: self.rng.randint(2, len(self.bases[base]))] + tail, base

    def request(self, rid, tokens, base):
        return FakeReq(rid, tokens, budget=self.rng.choice((2, 5, 9, 14)))

    def row(self, req):
        return self.rtt.req_to_token[req.kv.req_pool_idx]

    def write(self, req, start, slots):
        self.row(req)[start : start + len(slots)] = slots.to(torch.int32)
        for i, s in enumerate(slots.tolist()):
            for v in self.kv.v:
                v[s, 0] = torch.tensor([req.seq[start + i], start + i], dtype=torch.float32)

    def take(self, n):
        slots = self.alloc.alloc(n)
        if slots is None:
            self.tree.evict(EvictParams(num_tokens=n))
            slots = self.alloc.alloc(n)
        return slots

    def start(self):
        if not self.free_rows:
            return
        self.prefill(self.admitted())

    def admitted(self):
        req = self.request(f"r{self.next_rid}", *self.prompt())
        self.next_rid += 1
        self.tree.admit(None, req, of_request(req))  # the scheduler admits before it matches
        return req

    def prefill(self, req) -> bool:
        tokens = req.seq = array("q", req.origin_input_ids)  # a mechanism may rewrite them
        match = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1], req.extra_key), req=req))
        prefix = self.tree.path_device_indices(match.last_device_node)
        assert len(prefix) == match.device_prefix_len <= len(tokens) - 1
        req.lock = self.tree.lock(match.last_device_node)
        new = self.take(len(tokens) - len(prefix))
        if new is None:
            self.tree.unlock(req.lock)
            return False
        req.kv.req_pool_idx = self.free_rows.pop()
        self.row(req)[: len(prefix)] = prefix.to(torch.int32)
        self.write(req, len(prefix), new)
        req.kv.cache_protected_len = len(prefix)
        req.kv.kv_allocated_len = len(tokens)
        self.reused += int(bool(self.pruner.plans.get(req.rid).branches))
        req.output_ids.append(self.rng.randint(0, 6))  # the prefill's sampled token
        req.prefilled_row = self.row(req)[: len(tokens)].clone()  # as the mechanisms' checkpoint sees it
        self.tree.checkpoint(req, up_to=len(tokens))
        self.pruned += self.pruner.plans.get(req.rid).events
        self.copied += self.pruner.plans.get(req.rid).copied
        self.running.append(req)
        return True

    def decode(self, req):
        slot = self.take(1)
        if slot is None:
            return
        req.seq.append(req.output_ids[-1])
        self.write(req, len(req.seq) - 1, slot)
        req.kv.kv_allocated_len += 1
        req.output_ids.append(self.rng.randint(0, 6))

    def finish(self, req):
        """SGLang's release_kv_cache: a request barred from the tree is not inserted."""
        req.done = True
        checkpoint = not req.skip_radix_cache_insert
        if checkpoint:
            self.tree.checkpoint(req, up_to=len(req.seq))
        self.tree.free_kv_row(req.kv, [(req.kv.cache_protected_len, len(req.seq))])
        self.tree.unlock(req.lock)
        self.tree.on_release(req, checkpointed=checkpoint)
        self.free_rows.append(req.kv.req_pool_idx)
        self.running.remove(req)

    def step(self):
        action = self.rng.random()
        if action < 0.35 or not self.running:
            self.start()
        elif action < 0.75:
            self.decode(self.rng.choice(self.running))
        elif action < 0.95:
            self.finish(self.rng.choice(self.running))
        else:
            self.tree.evict(EvictParams(num_tokens=self.rng.randint(1, 40)))

    def run(self, steps: int) -> None:
        """Random steps, then every running request finished; the invariants checked after each."""
        for _ in range(steps):
            self.step()
            self.check()
        while self.running:
            self.finish(self.running[0])
            self.check()

    def check(self):
        sentinel = self.tree.dead_slots.sentinel
        free = torch.cat([self.alloc.free_pages, self.alloc.release_pages]).tolist()
        assert len(free) == len(set(free)), "a slot is free twice"
        assert sentinel not in free, "the sentinel was freed"
        tree_slots = (
            [s for s in self.tree.all_values_flatten().tolist() if s != sentinel]
            if self.tree.root_node.children
            else []
        )
        assert len(tree_slots) == len(set(tree_slots)), "two tree nodes own one slot"
        private = []
        for req in self.running:
            row = self.row(req)[req.kv.cache_protected_len : len(req.seq)].tolist()
            private += [s for s in row if s != sentinel]
        private += self.reserved()
        owners = free + tree_slots + private + [sentinel]
        assert sorted(owners) == list(range(1, POOL + 1)), "a slot is lost or owned twice"
        assert self.tree.evictable_size() + self.tree.protected_size() == len(tree_slots) + 1
        assert (
            self.alloc.available_size() + self.tree.evictable_size() + self.tree.protected_size() + len(private) == POOL
        )
        self.check_pruned_paths(self.tree.root_node, branched=False)
        # the server's own integrity check (engine/integrity.py) agrees with the one above
        assert integrity.check(self.tree, [r.kv for r in self.running]) == []
        for req in self.running:
            row = self.row(req)[: len(req.seq)].long()
            live = (row != sentinel).nonzero().flatten()
            got = self.kv.v[0][row[live], 0]
            want = torch.stack([torch.tensor([float(req.seq[p]), float(p)]) for p in live.tolist()])
            placed = live < self.placed_end(req)  # memory blocks: their tokens' KV, from where it was made
            got[placed, 1] = want[placed, 1]
            assert torch.equal(got, want), f"{req.rid} reads KV that is not its own"

    def placed_end(self, req) -> int:
        return 0

    def reserved(self) -> list[int]:
        """Slots taken for a restore being unpacked: its own until it lands in the tree."""
        return []

    def check_pruned_paths(self, node, branched: bool):
        """A sentinel entry sits only at or after a branch key (intent/paths.py): a path that a
        plain prefill could have made never leads to pruned KV."""
        for child in node.children.values():
            ids, values = list(child.key.token_ids), child.value.tolist()
            branch = 0 if branched else next((i for i, t in enumerate(ids) if t < 0), len(ids))
            assert self.tree.dead_slots.sentinel not in values[:branch], "pruned KV on a plain path"
            self.check_pruned_paths(child, branch < len(ids))


@pytest.mark.parametrize("seed", range(6))
def test_random_prune_evict_finish_cycles_conserve_slots(seed):
    sim = Sim(seed)
    sim.run(400)
    assert sim.pruned > 10, "the run must actually prune"
    assert sim.reused > 0, "some request must match into its session's pruned path"
    assert sim.copied > 0, "some event must prune positions of the path it matched"
    assert integrity.request_state(sim.tree, set()) == []  # every request ended: so did its state
    sim.tree.evict(EvictParams(num_tokens=POOL))
    sim.check()
    assert sim.alloc.available_size() == POOL - 1  # everything back but the sentinel


def test_the_integrity_check_finds_each_kind_of_fault():
    """integrity.check, which the tests run on every server after each module (and a debug setting
    before every batch), names each fault planted in a tree that was whole: a slot the tree holds
    also on the free list, a slot nobody owns, a running row pointing at a free slot, a tree size
    count that its nodes do not add up to."""
    sim = Sim(0)
    for _ in range(120):
        sim.step()
    while not any(r.kv.cache_protected_len for r in sim.running):  # a request reading a path of the tree
        sim.start()
    owners = [r.kv for r in sim.running]
    assert integrity.check(sim.tree, owners) == []
    tree_slot = int(next(s for s in sim.tree.all_values_flatten().tolist() if s != sim.tree.dead_slots.sentinel))
    sim.alloc.free_pages = torch.cat([sim.alloc.free_pages, torch.tensor([tree_slot])])
    assert any("held by both the tree and the free list" in p for p in integrity.check(sim.tree, owners))
    sim.alloc.free_pages = sim.alloc.free_pages[:-1]
    lost, sim.alloc.free_pages = int(sim.alloc.free_pages[0]), sim.alloc.free_pages[1:]
    assert any(p.startswith("1 page(s) owned by nobody") for p in integrity.check(sim.tree, owners))
    sim.alloc.free_pages = torch.cat([torch.tensor([lost]), sim.alloc.free_pages])
    req = next(r for r in sim.running if r.kv.cache_protected_len)
    at = 0  # in its prefix: the tree's, not its own
    held, sim.row(req)[at] = int(sim.row(req)[at]), lost
    found = integrity.check(sim.tree, owners)
    assert any("position(s) point at a page nobody owns" in p for p in found), found
    sim.row(req)[at] = held
    sim.tree.evictable_size_ += 1
    assert any(p.startswith("the tree counts") for p in integrity.check(sim.tree, owners))
    sim.tree.evictable_size_ -= 1
    assert integrity.check(sim.tree, owners) == []


def test_the_debug_setting_stops_the_scheduler_at_the_first_fault(monkeypatch):
    """SGLMEMORY_CHECK_INTEGRITY=1: the prefill hook (engine/admission.py) checks the tree before
    every batch, with SGLang's own list of the requests holding rows, and raises at a fault."""
    from types import SimpleNamespace

    from sgl_memory.engine import admission

    sim = Sim(1)
    for _ in range(60):
        sim.step()
    checker = SimpleNamespace(_requests_owning_rows=lambda: list(sim.running))
    scheduler = SimpleNamespace(tree_cache=sim.tree, invariant_checker=checker, waiting_queue=[])
    batch = SimpleNamespace(is_empty=lambda: not sim.running)
    formed = SimpleNamespace(batch_to_run=None, running_batch=batch)
    monkeypatch.setattr(admission, "CHECK_EVERY_STEP", True)
    assert admission.prefill_hook(lambda *a, **k: formed, scheduler, batch) is formed
    sim.alloc.free_pages = sim.alloc.free_pages[1:]  # a slot nobody owns
    with pytest.raises(RuntimeError, match=r"SGLMEMORY_CHECK_INTEGRITY: .*owned by nobody"):
        admission.prefill_hook(lambda *a, **k: formed, scheduler, batch)


class Chars:
    """A tokenizer of one character per token, for persistence's text match."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 97 for c in text]


class AllSim(Sim):
    """Intent, persistence and KV memory in one tree, as the server builds them (by order), over
    sessions named after the shared prefixes: record turns, memory-mode turns with a hand-made
    query pass, restores of evicted paths from the host-memory tier."""

    def __init__(self, seed, store):
        super().__init__(seed)
        spec = CacheSpec("toy", "cfg", layers=2, kv_heads=1, head_dim=2, dtype="float32", page_size=1)
        persist = SessionPersistence(PersistConfig(enabled=True, dir=str(store), quant="bf16"), self.tree.host, spec)
        persist.text.tokenizer = Chars()
        memory = MemArtManager(
            MemArtConfig(enabled=True, block_size=4, top_k=3), self.tree.host, Rope(head_dim=2, theta=10000.0)
        )
        memory.roles.markers = RoleMarkers(None, {})
        self.tree.composition = Composition([*self.tree.composition.mechanisms, persist, memory], self.tree.requests)
        self.persist, self.memory = persist, memory
        self.placed = self.restored = self.recorded_dead = 0
        self.waiting: list[FakeReq] = []
        self.last: dict[int, list[int]] = {}  # session -> its last finished record turn's tokens

    def prompt(self) -> tuple[list[int], int]:
        """Half the time a session's next turn: its last turn and a few new tokens."""
        tokens, base = super().prompt()
        if base in self.last and self.rng.random() < 0.5 and len(self.last[base]) < CONTEXT - 20:
            tokens = self.last[base] + tokens[-self.rng.randint(1, 6) :]
        return tokens, base

    def finish(self, req):
        row = self.row(req)[: len(req.origin_input_ids)].clone()
        state, turn = (
            self.memory.turns.get(req.rid),
            self.persist.turns.get(req.rid),
        )  # the request's state ends with it
        super().finish(req)
        if state.mode == "record":
            self.last[int(turn.session_id[1:])] = list(req.seq)
        self.check_recorded(req, state, row)

    def check_recorded(self, req, state, row) -> None:
        """The turn memory recorded is the prompt from where the session's pool left off as the
        prefill left it: positions this request's pruning dropped included (copied before pruning;
        only positions already dead in the prefix it matched have no KV to copy), each with the KV
        written for its token at its position."""
        pool = self.memory.pools.session(state.owner, create=False)
        pool.ingest(4)
        start, n, sentinel = state.prompt_kv_start, len(req.origin_input_ids), self.tree.dead_slots.sentinel
        had_kv = [p for p in range(start, n) if int(req.prefilled_row[p]) != sentinel]
        if not had_kv:
            return
        newest = [b for b in pool.blocks.values() if b.turns() == {pool.turns - 1}]
        tokens = [t for b in newest for t in b.tokens][: len(had_kv)]
        values = torch.cat([b.values for b in newest], 1)[0, : len(had_kv), 0]  # layer 0: (token, position)
        assert tokens == [req.origin_input_ids[p] for p in had_kv]
        assert torch.equal(values[:, 0], torch.tensor(tokens, dtype=torch.float32))
        assert torch.equal(values[:, 1], torch.tensor(had_kv, dtype=torch.float32))
        self.recorded_dead += sum(int(row[p]) == sentinel for p in had_kv)

    def step(self):
        if self.rng.random() < 0.05:  # pressure: most of the tree goes, stored sessions come back
            self.tree.evict(EvictParams(num_tokens=POOL))
        else:
            super().step()

    def request(self, rid, tokens, base):
        field = {"session_id": f"s{base}"}
        if self.rng.random() < 0.3:  # a memory-mode turn: its query pass ran first
            probe = Probe(
                ("", f"s{base}"),
                list(range(len(tokens))),
                self.memory.layers,
                len(tokens),
                0,
                rows={0: torch.randn(len(tokens), 1, 2)},
            )
            self.memory.probe_passes.probes[rid] = probe
            field["memory"] = {"mode": "retrieve", "probe": rid}
        return FakeReq(rid, tokens, budget=self.rng.choice((2, 5, 9, 14)), **field)

    def start(self):
        """As the scheduler's step does: a request arrives and is admitted into the queue; the
        mechanisms see the queue (persistence places what it unpacked since the last step, and holds
        back the requests whose KV is still being unpacked); the first request not held back runs
        (one a step: the sim's batch), or leaves the queue when the pool has no room for it."""
        if len(self.waiting) < 3:
            self.waiting.append(self.admitted())
        scheduler = SimpleNamespace(waiting_queue=self.waiting)
        held_back = set(self.tree.composition.before_prefill(scheduler, scheduler.waiting_queue, bool(self.running)))
        self.persist.restorer._unpacker.settle()  # so that the run does not depend on the thread's timing
        ready = self.tree.holds.held_first([r for r in self.waiting if r not in held_back])
        if ready and self.free_rows:
            req = ready[0]
            self.waiting.remove(req)
            if self.prefill(req):
                self.placed += bool((placed := self.memory.turns.get(req.rid)) and placed.retrieved_blocks)
                self.restored += bool((turn := self.persist.turns.get(req.rid)) and turn.restored_tokens)
            else:
                self.tree.on_drop(req)  # as SGLang's release of a request aborted in its queue
        self.tree.holds.after_prefill(scheduler, scheduled=bool(ready), idle=not self.running)

    def reserved(self) -> list[int]:
        return [s for job in self.persist.restorer._unpacker._jobs.values() for s in job.context[1].slots.tolist()]

    def run(self, steps: int) -> None:
        super().run(steps)
        for req in self.waiting:  # the server stops: the queue is dropped
            self.tree.on_drop(req)
        self.waiting.clear()

    def placed_end(self, req) -> int:
        state = self.memory.turns.get(req.rid)
        return state.memory_end if state is not None else 0


@pytest.mark.parametrize("seed", range(4))
def test_all_mechanisms_together_conserve_slots_and_read_their_own_kv(seed, tmp_path):
    sim = AllSim(seed, tmp_path)
    sim.run(400)
    assert sim.pruned > 10 and sim.placed > 3 and sim.restored > 3, (sim.pruned, sim.placed, sim.restored)
    assert sim.recorded_dead > 0, "memory must have recorded positions that pruning dropped"
    for m in sim.tree.composition.mechanisms:
        assert m.drain(30)
    assert integrity.request_state(sim.tree, set()) == []  # every request ended: so did its state
    sim.tree.evict(EvictParams(num_tokens=POOL))
    sim.check()
    assert sim.alloc.available_size() == POOL - 1


def test_a_request_aborted_while_queued_leaves_no_state_behind(tmp_path):
    """SGLang releases a request aborted in its waiting queue through
    Scheduler._release_aborted_request, never through the tree, so on_release does not run for it.
    What admission kept for it (intent's query capture, a memory probe) must go with it (the
    dropped hook); a request that holds a KV row is left to the tree's release."""
    from types import SimpleNamespace

    from sgl_memory.engine import admission

    sim = AllSim(0, tmp_path)
    scheduler = SimpleNamespace(tree_cache=sim.tree)
    held = lambda: (len(sim.memory.probe_passes.running.probing), len(sim.pruner.captures))  # noqa: E731
    queued = []
    for i in range(6):
        tokens, base = sim.prompt()
        field = {"session_id": f"s{base}"}
        if i % 2:
            field["memory"] = {"mode": "probe", "probe": f"p{i}"}
        req = FakeReq(f"q{i}", tokens + [1] * 12, budget=2, **field)
        sim.tree.admit(None, req, of_request(req))  # as admission.admit_hook does
        ADMITTED.set(req, True)
        queued.append(req)
    assert held() == (3, 3)
    running = queued.pop()
    running.kv.req_pool_idx = 0  # it got a row: the tree releases it
    for req in queued:
        admission.dropped_hook(None, scheduler, req)
    assert held() == (1, 0)
    admission.dropped_hook(None, scheduler, running)
    assert held() == (1, 0)
    # the request that holds a row is the only one whose state is left, and the leak check says so
    assert integrity.request_state(sim.tree, {running.rid}) == []
    assert any(repr(running.rid) in p for p in integrity.request_state(sim.tree, set()))
