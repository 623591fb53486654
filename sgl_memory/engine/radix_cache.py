"""The `sgl_memory` radix-cache backend: SGLang's Python RadixCache, the base of our memory features.

With every memory feature off it is SGLang's RadixCache unchanged (tests/test_radix_contract.py holds
it to that). `SglMemoryRadixCache` holds SGLang's overrides (and a request's admission and drop,
which admission.py hands it), each handing its part to the object that owns it:

- the dead-slot substrate (dead_slots.py, IntentKV 3.4), with intent pruning on: the sentinel slot,
  the sentinel-safe allocator view every free goes through, and the sentinel entries of node
  values, kept out of the evictable and protected sizes the scheduler reads;
- the holds for waiting requests (holds.py), let go when a request is released;
- the memory mechanisms (core/mechanism.py), built from the config into one `Composition`
  (core/composition.py, where the order of their hooks and the rules that combine their answers
  are written). The tree is its only owner: it admits a request through it (admission.py), gives
  it each match, checkpoint and release, and drains it before flush_cache empties the tree. The
  compression event runs in `checkpoint` at the end of a request's prefill, before its row is
  inserted, so the tree stores the pruned row and the next turn reuses it. The engine's other hooks
  call the composition itself (`tree.composition`; the forward hooks through runtime.composition()),
  and the mechanisms reach the tree only through its KV host (tree_host.py). The tree knows no
  mechanism by name.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import DecLockRefParams, DecLockRefResult, EvictParams, EvictResult
from sglang.srt.mem_cache.base_prefix_cache import IncLockRefResult, InsertParams, InsertResult, MatchPrefixParams
from sglang.srt.mem_cache.base_prefix_cache import MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_memory.core import composition, mechanism, prometheus
from sgl_memory.core.composition import Composition
from sgl_memory.core.config import MemoryConfig, from_env, plain
from sgl_memory.core.requests import RequestStore
from sgl_memory.core.kvhost import Branches
from sgl_memory.core.sessions import SessionRegistry
from sgl_memory.core.tree_fill import with_branches
from sgl_memory.engine import runtime
from sgl_memory.engine.dead_slots import DeadSlots
from sgl_memory.engine.holds import Holds
from sgl_memory.engine.tree_host import TreeHost

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    from sgl_memory.core.request import MemorySpec

logger = logging.getLogger(__name__)

BACKEND_NAME = "sgl_memory"


class SglMemoryRadixCache(RadixCache):
    """SGLang's RadixCache with the mechanisms' composition, the dead-slot substrate and the holds
    for waiting requests: its overrides of SGLang's methods, and a request's admission and drop,
    which the engine's hooks (admission.py) hand it."""

    token_to_kv_pool_allocator: Any  # SGLang's allocator, or its sentinel-safe view (dead_slots.py)

    def __init__(
        self, params: CacheInitParams, config: MemoryConfig | None = None, ctx: TreeCacheBuildContext | None = None
    ):
        # before RadixCache.__init__: it resets the tree, and our reset empties these
        self.dead_slots = DeadSlots(self)
        self.holds = Holds(self.inc_lock_ref, self.dec_lock_ref)
        self.composition = Composition([])
        self.sessions = SessionRegistry()  # every mechanism's per-session state, one each
        self.requests = RequestStore()  # every mechanism's per-request state, ended by the composition
        self.tp_size = ctx.tp_size if ctx is not None else 1
        self.host = TreeHost(self)  # what the mechanisms get of the tree (core/kvhost.py)
        # the scheduler that serves from this tree (its first admission says): room() leaves what it counts on
        self.scheduler: Scheduler | None = None
        # time.monotonic() of the last eviction that freed slots (None: none yet): how the
        # mechanisms tell a pool under pressure (TreeHost.evicted_within)
        self.last_eviction: float | None = None
        super().__init__(params)
        self.memory_config = config or plain()  # no config: no mechanism (the server passes its own)
        if self.disable:
            return
        composition.check(self.memory_config, self.tp_size, self.page_size)
        classes = [mechanism.REGISTRY[name] for name in mechanism.enabled(self.memory_config)]
        if any(cls.needs_sentinel for cls in classes):  # before they are built: they read it
            self.token_to_kv_pool_allocator = self.dead_slots.install(self.token_to_kv_pool_allocator)
        built = [cls.build(self.memory_config.section(cls.name), self.host, ctx) for cls in classes]
        self.composition = Composition(built, self.requests)
        runtime.bind(self)

    def reset(self) -> None:
        self.composition.drain()  # flush_cache: captured turns reach their stores before the tree empties
        super().reset()
        self.dead_slots.reset()
        self.holds.clear()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        self.dead_slots.retake_sentinel()
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

    def _insert_cache(self, req: Req, token_ids: Any, **kwargs: Any) -> tuple[RadixKey, torch.Tensor, int]:
        return super()._insert_cache(req, with_branches(token_ids, self.composition.branches(req)), **kwargs)

    # --- a request's life: admission (admission.py), checkpoint, release -------------------------

    def admit(self, scheduler: Scheduler, req: Req, spec: MemorySpec) -> None:
        self.scheduler = scheduler
        if spec.readonly:
            req.skip_radix_cache_insert = True  # no checkpoint: no event, and nothing of it stays in the tree
        self.composition.admit(scheduler, req, spec)

    def checkpoint(self, req: Req, *, up_to: int) -> None:
        edit = self.composition.checkpoint(req, self.host)
        if edit is not None and edit.private:
            # compact: the re-packed row is private to the request and stays out of the tree
            req.skip_radix_cache_insert = True
            return
        if self.dead_slots.diverges(req, up_to, self.composition.branches(req)):
            # the tree holds this pruned key with other positions dead (another request of the
            # session, e.g. a retry of an earlier turn, pruned the same tokens differently): the
            # insert would replace this row's live KV by that request's sentinel entries
            req.skip_radix_cache_insert = True
            return
        # the pruned row goes in as the session's branch; checkpoint rewrites the row from the
        # tree past the protected prefix, which the event moved back to its first drop
        super().checkpoint(req, up_to=up_to)

    def on_drop(self, req: Req) -> None:
        """A request aborted before it held a KV row (admission.dropped_hook), which the tree never
        releases: its hold goes, and each mechanism drops what its admission made."""
        self.holds.release(req)
        self.composition.drop(req)

    def on_release(self, req: Req, *, checkpointed: bool) -> None:
        self.holds.release(req)
        super().on_release(req, checkpointed=checkpointed)
        self.composition.release(req)

    # --- the sentinel entries of node values (dead_slots.py) --------------------------------------

    def insert(self, params: InsertParams) -> InsertResult:
        result = super().insert(params)
        self.dead_slots.inserted(result.last_device_node)
        return result

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        new_node = super()._split_node(key, child, split_len)
        self.dead_slots.split(child, new_node)
        # the first part of a split node carries no next use: the split is another key's match or
        # insert, which shares it; it is ordered by last use until a path's release tags it again
        return new_node

    def _delete_leaf(self, node: TreeNode) -> None:
        super()._delete_leaf(node)
        self.dead_slots.deleted(node)

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        self.dead_slots.move(node, from_lock=0, sign=+1)
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode, params: DecLockRefParams | None = None) -> DecLockRefResult:
        self.dead_slots.move(node, from_lock=1, sign=-1)
        return super().dec_lock_ref(node, params)

    def evictable_size(self) -> int:
        return self.evictable_size_ - self.dead_slots.evictable

    def protected_size(self) -> int:
        return self.protected_size_ - self.dead_slots.protected + self.dead_slots.held()

    def evict(self, params: EvictParams) -> EvictResult:
        """Sentinel entries free nothing: evicts until the real slots asked for are freed."""
        result = self.dead_slots.evict(params, super().evict)
        if result.num_tokens_evicted:
            self.last_eviction = time.monotonic()
        return result


def find_branches(root: TreeNode, key: RadixKey, ids_of: Callable[[np.ndarray], np.ndarray]) -> Branches:
    """The branches on `key`'s path in the tree below `root` (tree_fill.py): where the tree holds
    the branch id (`ids_of`: token ids, int64, to the id each takes at a branch) of the key's
    token. At a node boundary with both a plain child and a branch child the walk takes the
    branch: it is the request's own continuation. Read-only (it reads TreeNode.children and each
    child's key): no split, no access-time update."""
    n = len(key)
    ids = np.asarray(key.token_ids[:n], dtype=np.int64)
    branched = ids_of(ids)
    node, pos, found = root, 0, list[tuple[int, int]]()
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
    """The KV pool came up with fewer tokens than --max-total-tokens asked for: the server does not start."""


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


def build(ctx: TreeCacheBuildContext) -> SglMemoryRadixCache:
    """Factory for `register_radix_cache_backend` (receives SGLang's TreeCacheBuildContext)."""
    prometheus.enable(ctx.server_args)
    check_pool_size(ctx.params.token_to_kv_pool_allocator, ctx.server_args)
    cache = SglMemoryRadixCache(ctx.params, from_env(), ctx)
    logger.info("sgl-memory radix cache active (page_size=%d)", cache.page_size)
    return cache
