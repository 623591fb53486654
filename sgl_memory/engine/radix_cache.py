"""The `sgl_memory` radix-cache backend: SGLang's Python RadixCache, the base of our memory features.

With every memory feature off it is SGLang's RadixCache unchanged (tests/test_radix_contract.py holds
it to that). With intent pruning on, the tree also owns the dead-slot substrate (IntentKV 3.4):

- a sentinel KV slot, taken from the allocator at start-up and never given back; pruned positions
  of a request's row point at it, and node values inserted from pruned rows contain it;
- every free the tree issues goes through `SentinelSafeAllocator`, which drops sentinel entries, so
  checkpoint, evict and release never free the sentinel (and never free a pruned slot twice: the
  pruned slot was freed once, when its position was redirected);
- evictable / protected sizes count real slots only: the scheduler's admission and SGLang's idle
  leak check (available + evictable + protected == total) read them;
- the compression event runs in `checkpoint` at the end of a request's prefill, before its row is
  inserted, so the tree stores the pruned row and the next turn reuses it.

The memory mechanisms (core/mechanism.py) are built by the tree from the config into one
`Composition` (core/composition.py, where the order of their hooks and the rules that combine their
answers are written), and the tree is its only owner: it admits a request through it (admission.py),
gives it each checkpoint and release, and drains it before flush_cache empties the tree. The
engine's forward hooks reach it through runtime.tree(). The tree knows no mechanism by name.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from array import array
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from sglang.srt.distributed import get_tp_group
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.evict_policy import EvictionStrategy, LRUStrategy
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from sgl_memory.core import composition, mechanism, prometheus
from sgl_memory.engine import runtime
from sgl_memory.core.composition import Composition
from sgl_memory.core.config import MemoryConfig, from_env, plain
from sgl_memory.core.mechanism import Mechanism
from sgl_memory.core.requests import RequestStore
from sgl_memory.core.sessions import SessionRegistry
from sgl_memory.core.slots import Slot
from sgl_memory.core.kvhost import Branches
from sgl_memory.core.tree_fill import with_branches

logger = logging.getLogger(__name__)

# per tree node: its value's sentinel entries (counted once per value), and whether the node is in
# the dead-entry accounting (an insert creates at most one node, its last one; splits re-divide it)
DEAD: Slot[tuple[torch.Tensor, int]] = Slot("dead entries")
COUNTED: Slot[bool] = Slot("counted")

# per tree node of a path no other path shares: when its path is next used (Mechanism-given, see `expect`)
NEXT_USE: Slot[Callable[[float], float]] = Slot("next use")

BACKEND_NAME = "sgl_memory"
HELD_TOKENS = prometheus.gauge(
    "held_tokens", "KV tokens held in the tree for requests waiting to run (restored or matched)"
)


class SentinelSafeAllocator:
    """The tree's view of the KV allocator: every free variant skips the sentinel slot and goes to
    the same variant of the real allocator (SWA allocators give `free_full` and `free_segment` their
    own meaning), and `real_freed` counts the real slots given back, which is how eviction measures
    its progress: inside a free group (`free_group_begin`) the allocator's available size does not
    move until the group ends."""

    def __init__(self, inner, tree: SglMemoryRadixCache):
        self._inner = inner
        self._tree = tree
        self.real_freed = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _real(self, index: torch.Tensor) -> torch.Tensor:
        sentinel = self._tree.sentinel
        real = index if sentinel is None else index[index != sentinel]
        self.real_freed += real.numel()
        return real

    def _real_runs(self, index: torch.Tensor, start_pos: int) -> list[tuple[torch.Tensor, int]]:
        """A kv-row segment without its sentinel entries, as the runs of real slots between them,
        each with its own start position (a segment is a contiguous stretch of one row)."""
        sentinel = self._tree.sentinel
        dead = (index == sentinel) if sentinel is not None else None
        if dead is None or not bool(dead.any()):
            self.real_freed += index.numel()
            return [(index, start_pos)] if index.numel() else []
        live = torch.nonzero(~dead).flatten().tolist()
        self.real_freed += len(live)
        runs, first = [], 0
        for k in range(1, len(live) + 1):
            if k == len(live) or live[k] != live[k - 1] + 1:  # a sentinel entry ends the run
                runs.append((index[live[first] : live[k - 1] + 1], start_pos + live[first]))
                first = k
        return runs

    def free(self, free_index):
        self._inner.free(self._real(free_index))

    def free_full(self, free_index):
        self._inner.free_full(self._real(free_index))

    def free_segment(self, free_index, *, start_pos):
        for run, pos in self._real_runs(free_index, start_pos):
            self._inner.free_segment(run, start_pos=pos)

    def free_full_segment(self, free_index, *, start_pos):
        for run, pos in self._real_runs(free_index, start_pos):
            self._inner.free_full_segment(run, start_pos=pos)

    def free_segments(self, segments):
        self._inner.free_segments([run for index, pos in segments for run in self._real_runs(index, pos)])

    def free_full_segments(self, segments):
        self._inner.free_full_segments([run for index, pos in segments for run in self._real_runs(index, pos)])


class NextUseStrategy(EvictionStrategy):
    """Eviction by predicted next use (furthest first), where a mechanism said when a path is next
    used (`SglMemoryRadixCache.expect`); by last use elsewhere. Last use is read as a prediction
    too: a path last used `age` seconds ago is expected back `age` seconds from now, so among
    paths nobody predicted this is SGLang's LRU, and predicted ones sort among them on one scale."""

    def get_priority(self, node) -> float:
        now = time.monotonic()
        when = NEXT_USE.get(node)
        return -(when(now) if when is not None else 2 * now - node.last_access_time)


class SglMemoryRadixCache(RadixCache):
    sentinel: int | None = None
    _allocator = None  # the real allocator, when the tree holds a sentinel (token_to_kv_pool_allocator is the view)

    def __init__(self, params, config: MemoryConfig | None = None, ctx=None):
        self._dead_evictable = self._dead_protected = 0
        self._holds: dict[object, tuple[object, int]] = {}  # waiting request -> (node held for it, tokens)
        self.composition = Composition([])
        self.sessions = SessionRegistry()  # every mechanism's per-session state, one slot each
        self.requests = RequestStore()  # every mechanism's per-request state, ended by the composition
        self.tp_size = ctx.tp_size if ctx is not None else 1
        super().__init__(params)
        self.memory_config = config or plain()  # no config: no mechanism (the server passes its own)
        if self.disable:
            return
        composition.check(self.memory_config, self.tp_size, self.page_size)
        classes = [mechanism.REGISTRY[name] for name in mechanism.enabled(self.memory_config)]
        if any(cls.needs_sentinel for cls in classes):  # before they are built: they read it
            self._allocator = self.token_to_kv_pool_allocator
            self.token_to_kv_pool_allocator = SentinelSafeAllocator(self._allocator, self)
            self._take_sentinel()
        built = [cls.build(self.memory_config.section(cls.name), self, ctx) for cls in classes]
        self.composition = Composition(built, self.requests)
        runtime.bind(self)

    @property
    def mechanisms(self) -> list[Mechanism]:
        return self.composition.mechanisms

    def mechanism(self, name: str) -> Mechanism | None:
        return self.composition.get(name)

    # --- the sentinel ---------------------------------------------------------------------------

    def _take_sentinel(self) -> None:
        slot = self._allocator.alloc(1)
        if slot is None:
            raise RuntimeError("no KV slot free for the intent-pruning sentinel")
        self.sentinel = int(slot[0])
        # V of the sentinel is zero, a second line of defence behind the attention filter.
        pool = self._allocator.get_kvcache()
        for layer in range(pool.layer_num):
            pool.get_key_buffer(layer)[self.sentinel].zero_()
            pool.get_value_buffer(layer)[self.sentinel].zero_()
        logger.info("dead-slot substrate: sentinel KV slot %d", self.sentinel)

    def reset(self):
        self.composition.drain()  # flush_cache: captured turns reach their stores before the tree empties
        super().reset()
        self._dead_evictable = self._dead_protected = 0
        self._holds.clear()  # flush_cache runs with no request waiting: the nodes are gone with the tree
        # flush_cache clears the allocator right after this: the slot is retaken on next use.
        self.sentinel = None

    def match_prefix(self, params):
        if self._allocator is not None and self.sentinel is None:
            self._take_sentinel()
        key = params.key
        # rows a mechanism reads as they are computed are prefilled again, so they are the request's own
        limit = self.composition.match_limit(params.req) if params.req is not None else None
        if limit is not None:
            limit = limit if key.limit is None else min(key.limit, limit)
            key = RadixKey(
                key.token_ids, key.extra_key, is_bigram=key.is_bigram, limit=limit, cache_salt=key.cache_salt
            )
            params = dataclasses.replace(params, key=key)
        owner = self.composition.branch_ids(params.req) if params.req is not None and not self.disable else None
        if owner is None:
            return super().match_prefix(params)
        m, ids_of = owner
        # the request matches its own branches of the path (tree_fill.py), every one of them
        branches = find_branches(self.root_node, key, ids_of)
        key.token_ids = with_branches(key.token_ids, branches)
        result = super().match_prefix(dataclasses.replace(params, key=key))
        m.on_match(params.req, tuple(b for b in branches if b[0] < result.device_prefix_len))
        return result

    def branches(self, req) -> Branches:
        """Where the request's key in the tree takes branch ids instead of its tokens (tree_fill.py);
        () for a plain path."""
        return self.composition.branches(req)

    def _insert_cache(self, req, token_ids, **kwargs):
        return super()._insert_cache(req, with_branches(token_ids, self.branches(req)), **kwargs)

    # --- a request's life: admission (admission.py), checkpoint, release -------------------------

    def admit(self, scheduler, req, spec) -> None:
        if spec.readonly:
            req.skip_radix_cache_insert = True  # no checkpoint: no event, and nothing of it stays in the tree
        self.composition.admit(scheduler, req, spec)

    def checkpoint(self, req, *, up_to: int):
        edit = self.composition.checkpoint(req, self)
        if edit is not None and edit.private:
            # compact: the re-packed row is private to the request and stays out of the tree
            req.skip_radix_cache_insert = True
            return
        if self._diverges(req, up_to):
            # the tree holds this pruned key with other positions dead (another request of the
            # session, e.g. a retry of an earlier turn, pruned the same tokens differently): the
            # insert would replace this row's live KV by that request's sentinel entries
            req.skip_radix_cache_insert = True
            return
        # the pruned row goes in as the session's branch; checkpoint rewrites the row from the
        # tree past the protected prefix, which the event moved back to its first drop
        super().checkpoint(req, up_to=up_to)

    def _diverges(self, req, up_to: int) -> bool:
        """Whether the tree already holds the request's pruned key past its protected prefix with
        other positions live than the request's row. A pruned key names the session and its
        pruning, not which positions a scorer kept, so two requests can prune one key apart."""
        branches = self.branches(req)
        if not branches:
            return False
        key = RadixKey(
            with_branches(req.full_untruncated_fill_ids[:up_to], branches), req.extra_key, cache_salt=req.cache_salt
        )
        held = RadixCache.match_prefix(self, MatchPrefixParams(key=key)).last_device_node
        tree = self.path_device_indices(held)
        start = req.kv.cache_protected_len
        if len(tree) <= start:
            return False
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx][start : len(tree)].to(tree.device)
        return bool(((tree[start:] == self.sentinel) != (row == self.sentinel)).any())

    def on_drop(self, req) -> None:
        self.release_hold(req)
        self.composition.drop(req)

    def on_release(self, req, *, checkpointed: bool) -> None:
        self.release_hold(req)
        super().on_release(req, checkpointed=checkpointed)
        self.composition.release(req)

    def export_session(self, key, skip: Mechanism | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        return self.composition.export_session(key, skip)

    def import_session(self, key, tensors: dict[str, torch.Tensor]) -> None:
        self.composition.import_session(key, tensors)

    def position_shift(self, rid: str) -> int:
        return self.composition.position_shift(rid)

    def placed_kv(self, req):
        return self.composition.placed_kv(req)

    def describe_sessions(self) -> list[dict]:
        """Every session this server holds, least recently used first: its tenant, id and last use,
        and what each mechanism says of its slot (Mechanism.describe_session): sizes, no contents."""
        out = []
        for (tenant, session_id), used, slots in self.sessions.snapshot():
            row = {"tenant": tenant or None, "session_id": session_id, "last_use": round(used, 3)}
            out.append(row | self.composition.describe_session(slots))
        return out

    # --- the scheduler's prefill pass (admission.py's hooks) ---------------------------------------

    def before_prefill(self, scheduler, running: bool) -> list:
        """Before the scheduler forms a prefill batch (each step of its loop, queue empty or not):
        each mechanism's turn at the waiting queue (Mechanism.before_prefill). Returns the requests
        that must not run in this batch."""
        if not self.composition or self.disable:
            return []
        return self.composition.before_prefill(scheduler, scheduler.waiting_queue, running)

    def held_first(self, waiting: list) -> list:
        """The waiting queue with the requests the tree holds KV for first, each part in its order:
        their prefill is only their new tokens, and a request that must prefill its whole history
        ahead of them (first come, first served) would need the room their holds keep and evict
        what was brought back for them."""
        if not self._holds:
            return waiting
        return [r for r in waiting if r in self._holds] + [r for r in waiting if r not in self._holds]

    def after_prefill(self, scheduler, scheduled: bool, idle: bool) -> None:
        """After the scheduler formed a prefill batch (or found none): a held request that left the
        queue holds its prefix through the scheduler's own lock now, or was aborted. When nothing
        runs and nothing was scheduled while requests wait, every hold is let go: a hold must never
        keep the pool from the requests that could run (they find the held KV evictable, and a held
        request its KV, if still there, by its own match)."""
        if not self._holds:
            return
        waiting = set(scheduler.waiting_queue)
        for req in [r for r in self._holds if r not in waiting or (idle and not scheduled)]:
            self.release_hold(req)

    # --- holds: KV brought back for a waiting request stays until the request runs ---------------

    def hold(self, req, node, tokens: int) -> None:
        self.release_hold(req)
        self.inc_lock_ref(node)
        self._holds[req] = (node, tokens)
        HELD_TOKENS.set(self.held_tokens())

    def release_hold(self, req) -> None:
        held = self._holds.pop(req, None)
        if held is not None:
            self.dec_lock_ref(held[0])
            HELD_TOKENS.set(self.held_tokens())

    def held_tokens(self) -> int:
        return sum(tokens for _, tokens in self._holds.values())

    @property
    def pool_tokens(self) -> int:
        return self.token_to_kv_pool_allocator.size

    def room(self) -> int:
        return self.token_to_kv_pool_allocator.available_size() + self.evictable_size()

    # --- eviction by next use ----------------------------------------------------------------------

    def expect(self, node, when: Callable[[float], float]) -> None:
        if not isinstance(self.eviction_strategy, NextUseStrategy):
            if type(self.eviction_strategy) is not LRUStrategy:
                return  # the operator chose another policy (--radix-eviction-policy): it stays
            self.eviction_strategy = NextUseStrategy()
        while node is not None and node is not self.root_node:
            NEXT_USE.set(node, when)
            parent = node.parent
            if parent is None or len(parent.children) > 1:
                break  # the parent is shared with another path: it keeps last-use order
            node = parent

    # --- the KV host (kvhost.py): what the mechanisms may ask of the tree -------------------------

    @property
    def pool(self):
        return self.token_to_kv_pool_allocator.get_kvcache()

    def layers(self) -> range:
        pool = self.pool
        start = getattr(pool, "start_layer", 0) or 0  # pipeline parallelism: this rank's layers
        return range(start, start + pool.layer_num)

    def reduce_heads(self, x: torch.Tensor, op: str = "mean") -> torch.Tensor:
        if self.tp_size == 1:
            return x
        # scores are small host tensors: the group's gloo side, not the accelerator's
        out = x.detach().cpu().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=get_tp_group().cpu_group)
        return out / self.tp_size if op == "mean" else out

    def rank_range(self, values):
        values = [int(v) for v in values]
        if self.tp_size == 1:
            return values, values
        # one collective for both ends: the least of -v is minus the greatest of v
        both = torch.tensor(values + [-v for v in values], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
        n = len(values)
        return both[:n].tolist(), (-both[n:]).tolist()

    def row(self, req) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]

    def slot_map(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    def key(self, tokens, extra_key: str | None, cache_salt=None, branches: Branches = ()) -> RadixKey:
        return RadixKey(with_branches(array("q", tokens), branches), extra_key, cache_salt=cache_salt)

    def match(self, key: RadixKey):
        return self.match_prefix(MatchPrefixParams(key=key))

    def insert_path(self, key: RadixKey, slots: torch.Tensor) -> int:
        return self.insert(InsertParams(key=key, value=slots)).prefix_len

    def path_slots(self, node) -> torch.Tensor:
        return self.path_device_indices(node)

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        allocator = self.token_to_kv_pool_allocator
        if n == 0:
            return torch.zeros(0, dtype=torch.int64)
        if allocator.available_size() < n:
            self.evict(EvictParams(num_tokens=n - allocator.available_size()))
            # SGLang holds the frees of a batch's result processing in a free group until it ends, and
            # intent's compression event runs inside one: what eviction just freed would not count
            # until then (on a full pool every event failed). Ending the group and opening a new one
            # hands them back now; the group's caller still ends it.
            if allocator.available_size() < n and getattr(allocator, "free_group", None) is not None:
                allocator.free_group_end()
                allocator.free_group_begin()
        return allocator.alloc(n) if allocator.available_size() >= n else None

    def free_real(self, slots: torch.Tensor) -> None:
        (self._allocator or self.token_to_kv_pool_allocator).free(slots)

    # --- accounting of sentinel entries in node values ------------------------------------------

    def dead_counts(self) -> tuple[int, int]:
        """Sentinel entries in the values of evictable and of protected nodes, as counted."""
        return self._dead_evictable, self._dead_protected

    def dead_entries(self, node) -> int:
        """The sentinel entries of a node's value (counted once per value)."""
        if self.sentinel is None or node.value is None or node is self.root_node:
            return 0
        cached = DEAD.get(node)
        if cached is None or cached[0] is not node.value:
            cached = DEAD.set(node, (node.value, int((node.value == self.sentinel).sum())))
        return cached[1]

    def insert(self, params):
        result = super().insert(params)
        node = result.last_device_node
        # an insert creates at most one node, its last one; splits only re-divide counted nodes
        if node is not None and node is not self.root_node and node not in COUNTED:
            COUNTED.set(node, True)
            if node.lock_ref == 0:
                self._dead_evictable += self.dead_entries(node)
            else:
                self._dead_protected += self.dead_entries(node)
        return result

    def _split_node(self, key, child, split_len):
        new_node = super()._split_node(key, child, split_len)
        if child in COUNTED:
            COUNTED.set(new_node, True)
        # the first part of a split node carries no next use: the split is another key's match or
        # insert, which shares it; it is ordered by last use until a path's release tags it again
        return new_node

    def _delete_leaf(self, node):
        super()._delete_leaf(node)
        self._dead_evictable -= self.dead_entries(node)

    def inc_lock_ref(self, node):
        self._move_dead(node, from_lock=0, sign=+1)
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node, params=None):
        self._move_dead(node, from_lock=1, sign=-1)
        return super().dec_lock_ref(node, params)

    def _move_dead(self, node, from_lock: int, sign: int) -> None:
        """Nodes whose lock_ref crosses 0 <-> 1 move between evictable and protected."""
        if self._allocator is None or self.disable:
            return  # no sentinel, no dead entries: the plain tree pays no extra walk
        while node is not None and node is not self.root_node:
            if node.lock_ref == from_lock:
                dead = self.dead_entries(node)
                self._dead_evictable -= sign * dead
                self._dead_protected += sign * dead
            node = node.parent

    def evictable_size(self):
        return self.evictable_size_ - self._dead_evictable

    def protected_size(self):
        held = 1 if self.sentinel is not None else 0
        return self.protected_size_ - self._dead_protected + held

    def evict(self, params: EvictParams) -> EvictResult:
        """Sentinel entries free nothing: keep evicting until the real slots asked for are freed.
        Progress is what the allocator view counts as freed, not the allocator's available size,
        which stays put inside a deferred free group."""
        if self._allocator is None:
            return super().evict(params)
        view = self.token_to_kv_pool_allocator
        start = view.real_freed
        while view.real_freed - start < params.num_tokens:
            result = super().evict(EvictParams(num_tokens=params.num_tokens - (view.real_freed - start)))
            if result.num_tokens_evicted == 0:
                break
        return EvictResult(num_tokens_evicted=view.real_freed - start)


def find_branches(root, key: RadixKey, ids_of: Callable[[np.ndarray], np.ndarray]) -> Branches:
    """The branches on `key`'s path in the tree below `root` (tree_fill.py): where the tree holds
    the branch id (`ids_of`: token ids, int64, to the id each takes at a branch) of the key's
    token. At a node boundary with both a plain child and a branch child the walk takes the
    branch: it is the request's own continuation. Read-only (it reads TreeNode.children and each
    child's key): no split, no access-time update."""
    n = len(key)
    ids = np.asarray(key.token_ids[:n], dtype=np.int64)
    branched = ids_of(ids)
    node, pos, found = root, 0, []
    while pos < n:
        probe = RadixKey(array("q", [int(branched[pos])]), key.extra_key, cache_salt=key.cache_salt).child_key()
        child = node.children.get(probe)
        if child is None:
            child = node.children.get(key.child_key_at(pos))
        if child is None:
            break
        held = np.asarray(child.key.token_ids[: len(child.key)], dtype=np.int64)
        m = min(len(held), n - pos)
        plain = held[:m] == ids[pos : pos + m]
        branch = held[:m] == branched[pos : pos + m]
        off = np.flatnonzero(~(plain | branch))
        matched = int(off[0]) if off.size else m
        found.extend((pos + int(i), int(branched[pos + i])) for i in np.flatnonzero(branch[:matched]))
        if matched < len(held):
            break
        node, pos = child, pos + matched
    return tuple(found)


class PoolTooSmall(RuntimeError):
    pass


def check_pool_size(allocator, server_args) -> None:
    """A server asked for a KV pool of --max-total-tokens gets it or does not start. SGLang sizes
    the pool from the memory free at start-up and silently takes less when less is free (a pool
    asked for 3000 tokens came up with 663 under memory pressure), and the server then fails far
    from the cause."""
    asked = getattr(server_args, "max_total_tokens", None)
    if asked and allocator.size < asked - (allocator.page_size - 1):
        raise PoolTooSmall(
            f"the KV pool holds {allocator.size} tokens, fewer than --max-total-tokens {asked}: not enough "
            "memory was free when the pool was sized; free memory, or ask for fewer tokens"
        )


def build(ctx) -> SglMemoryRadixCache:
    """Factory for `register_radix_cache_backend` (receives SGLang's TreeCacheBuildContext)."""
    prometheus.enable(ctx.server_args)
    check_pool_size(ctx.params.token_to_kv_pool_allocator, ctx.server_args)
    cache = SglMemoryRadixCache(ctx.params, from_env(), ctx)
    logger.info("sgl-memory radix cache active (page_size=%d)", cache.page_size)
    return cache
