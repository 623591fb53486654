"""The KV host (core/kvhost.py) over the engine's radix tree: what the mechanisms get in
`Mechanism.build` and at each checkpoint instead of the tree itself.

Every member reads the tree as it is now (its sentinel is retaken after a reset, its composition
may be rebuilt), so one `TreeHost` serves the tree's whole life; core/tree_fill.py keys its
reservations by it.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from sglang.srt.distributed import get_tp_group
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sgl_memory.core.kvhost import Branches, KVPool
from sgl_memory.core.mechanism import Mechanism
from sgl_memory.core.requests import RequestStore
from sgl_memory.core.sessions import SessionKey, SessionRegistry
from sgl_memory.core.tree_fill import with_branches
from sgl_memory.engine import next_use
from sgl_memory.engine.committed import committed_tokens

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from sgl_memory.engine.radix_cache import SglMemoryRadixCache


class TreeHost:
    """core.kvhost.KVHost implemented over one SglMemoryRadixCache: slots, keys, matches and
    inserts through the tree, the pool through its allocator, holds through its `Holds`, and the
    session state and forward answers of the other mechanisms through its composition."""

    def __init__(self, tree: SglMemoryRadixCache):
        self._tree = tree

    # --- what the tree is ---------------------------------------------------------------------

    @property
    def sessions(self) -> SessionRegistry:
        return self._tree.sessions

    @property
    def requests(self) -> RequestStore:
        return self._tree.requests

    @property
    def disable(self) -> bool:
        return self._tree.disable

    @property
    def page_size(self) -> int:
        return self._tree.page_size

    @property
    def tp_size(self) -> int:
        return self._tree.tp_size

    @property
    def sentinel(self) -> int | None:
        return self._tree.dead_slots.sentinel

    # --- the pool and the tensor-parallel group -------------------------------------------------

    @property
    def pool(self) -> KVPool:
        return self._tree.token_to_kv_pool_allocator.get_kvcache()

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

    def rank_range(self, values: Sequence[int]) -> tuple[list[int], list[int]]:
        values = [int(v) for v in values]
        if self.tp_size == 1:
            return values, values
        # one collective for both ends: the least of -v is minus the greatest of v
        both = torch.tensor(values + [-v for v in values], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
        n = len(values)
        return both[:n].tolist(), (-both[n:]).tolist()

    # --- rows, keys, paths, slots ---------------------------------------------------------------

    def row(self, req: Req) -> torch.Tensor:
        return self._tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx]

    def slot_map(self) -> torch.Tensor:
        return self._tree.req_to_token_pool.req_to_token

    def key(
        self, tokens: Sequence[int], extra_key: str | None, cache_salt: str | None = None, branches: Branches = ()
    ) -> RadixKey:
        return RadixKey(with_branches(array("q", tokens), branches), extra_key, cache_salt=cache_salt)

    def match(self, key: RadixKey) -> MatchResult:
        return self._tree.match_prefix(MatchPrefixParams(key=key))

    def insert_path(self, key: RadixKey, slots: torch.Tensor) -> int:
        return self._tree.insert(InsertParams(key=key, value=slots)).prefix_len

    def path_slots(self, node: TreeNode) -> torch.Tensor:
        return self._tree.path_device_indices(node)

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        allocator = self._tree.token_to_kv_pool_allocator
        if n == 0:
            return torch.zeros(0, dtype=torch.int64)
        if allocator.available_size() < n:
            self._tree.evict(EvictParams(num_tokens=n - allocator.available_size()))
            # SGLang holds the frees of a batch's result processing in a free group until it ends, and
            # intent's compression event runs inside one: what eviction just freed would not count
            # until then (on a full pool every event failed). Ending the group and opening a new one
            # hands them back now; the group's caller still ends it.
            if allocator.available_size() < n and getattr(allocator, "free_group", None) is not None:
                allocator.free_group_end()
                allocator.free_group_begin()
        return allocator.alloc(n) if allocator.available_size() >= n else None

    def free_real(self, slots: torch.Tensor) -> None:
        (self._tree.dead_slots.allocator or self._tree.token_to_kv_pool_allocator).free(slots)

    def inc_lock_ref(self, node: TreeNode) -> Any:
        return self._tree.inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> Any:
        return self._tree.dec_lock_ref(node)

    # --- holds and room -------------------------------------------------------------------------

    def hold(self, req: Req, node: TreeNode, tokens: int) -> None:
        self._tree.holds.hold(req, node, tokens)

    def held_tokens(self) -> int:
        return self._tree.holds.held_tokens()

    @property
    def pool_tokens(self) -> int:
        return self._tree.token_to_kv_pool_allocator.size

    def room(self) -> int:
        free = self._tree.token_to_kv_pool_allocator.available_size() + self._tree.evictable_size()
        scheduler = self._tree.scheduler
        return free - (committed_tokens(scheduler) if scheduler is not None else 0)

    def evicted_within(self, seconds: float) -> bool:
        last = self._tree.last_eviction
        evicted = last is not None and time.monotonic() - last <= seconds
        # each rank reads its own clock: the greatest answer is every rank's, so all prune alike
        return bool(self.rank_range([evicted])[1][0])

    def expect(self, node: TreeNode, when: Callable[[float], float]) -> None:
        next_use.expect(self._tree, node, when)

    # --- the other mechanisms' answers, through the composition ---------------------------------

    def branches(self, req: Req) -> Branches:
        """Where the request's key in the tree takes branch ids instead of its tokens (tree_fill.py);
        () for a plain path."""
        return self._tree.composition.branches(req)

    def export_session(
        self, key: SessionKey, skip: Mechanism | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        return self._tree.composition.export_session(key, skip)

    def import_session(self, key: SessionKey, tensors: dict[str, torch.Tensor]) -> None:
        self._tree.composition.import_session(key, tensors)

    def position_shift(self, rid: str) -> int:
        return self._tree.composition.position_shift(rid)

    def placed_kv(self, req: Req) -> Any:
        return self._tree.composition.placed_kv(req)
