"""The tree's dead-slot substrate (IntentKV 3.4): the sentinel slot, the sentinel-safe view of the
KV allocator, and the count of sentinel entries in the tree's node values.

With intent pruning on (a mechanism that `needs_sentinel`):

- a sentinel KV slot is taken from the allocator at start-up and never given back; pruned positions
  of a request's row point at it, and node values inserted from pruned rows contain it;
- every free the tree issues goes through `SentinelSafeAllocator`, which drops sentinel entries, so
  checkpoint, evict and release never free the sentinel (and never free a pruned slot twice: the
  pruned slot was freed once, when its position was redirected);
- evictable / protected sizes count real slots only: the scheduler's admission and SGLang's idle
  leak check (available + evictable + protected == total) read them.

The tree's overrides (radix_cache.py) call `DeadSlots` at each point where a node's value enters,
leaves or changes sides between evictable and protected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sgl_memory.core.kvhost import Branches
from sgl_memory.core.side_tables import SideTable
from sgl_memory.core.tree_fill import with_branches

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

logger = logging.getLogger(__name__)

# per tree node: its value's sentinel entries (counted once per value), and whether the node is in
# the dead-entry accounting (an insert creates at most one node, its last one; splits re-divide it)
DEAD: SideTable[tuple[torch.Tensor, int]] = SideTable("dead entries")
COUNTED: SideTable[bool] = SideTable("counted")


class SentinelSafeAllocator:
    """The tree's view of the KV allocator: every free variant skips the sentinel slot and goes to
    the same variant of the real allocator (SWA allocators give `free_full` and `free_segment` their
    own meaning), and `real_freed` counts the real slots given back, which is how eviction measures
    its progress: inside a free group (`free_group_begin`) the allocator's available size does not
    move until the group ends."""

    def __init__(self, inner: BaseTokenToKVPoolAllocator, dead: DeadSlots):
        self._inner = inner
        self._dead = dead
        self.real_freed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _real(self, index: torch.Tensor) -> torch.Tensor:
        sentinel = self._dead.sentinel
        real = index if sentinel is None else index[index != sentinel]
        self.real_freed += real.numel()
        return real

    def _real_runs(self, index: torch.Tensor, start_pos: int) -> list[tuple[torch.Tensor, int]]:
        """A kv-row segment without its sentinel entries, as the runs of real slots between them,
        each with its own start position (a segment is a contiguous stretch of one row)."""
        sentinel = self._dead.sentinel
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

    def free(self, free_index: torch.Tensor) -> None:
        self._inner.free(self._real(free_index))

    def free_full(self, free_index: torch.Tensor) -> None:
        self._inner.free_full(self._real(free_index))

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        for run, pos in self._real_runs(free_index, start_pos):
            self._inner.free_segment(run, start_pos=pos)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        for run, pos in self._real_runs(free_index, start_pos):
            self._inner.free_full_segment(run, start_pos=pos)

    def free_segments(self, segments: list[tuple[torch.Tensor, int]]) -> None:
        self._inner.free_segments([run for index, pos in segments for run in self._real_runs(index, pos)])

    def free_full_segments(self, segments: list[tuple[torch.Tensor, int]]) -> None:
        self._inner.free_full_segments([run for index, pos in segments for run in self._real_runs(index, pos)])


class DeadSlots:
    """One tree's sentinel slot and its sentinel entries, counted by side (evictable, protected).

    Without a sentinel (`install` never called) it counts nothing: every node's entries are 0 and
    the lock-ref walk is skipped, so the plain tree pays no extra walk."""

    def __init__(self, tree: RadixCache):
        self._tree = tree
        self.sentinel: int | None = None
        self.allocator: BaseTokenToKVPoolAllocator | None = None  # the real one, when the tree holds a sentinel
        self.evictable = self.protected = 0  # sentinel entries in evictable and in protected nodes

    # --- the sentinel ---------------------------------------------------------------------------

    def install(self, allocator: BaseTokenToKVPoolAllocator) -> SentinelSafeAllocator:
        """The sentinel-safe view of `allocator` (the tree's allocator from now on), with the
        sentinel taken from it. Before the mechanisms are built: they read the sentinel."""
        self.allocator = allocator
        view = SentinelSafeAllocator(allocator, self)
        self.take_sentinel()
        return view

    def take_sentinel(self) -> None:
        assert self.allocator is not None, "the sentinel is taken from the allocator install() was given"
        slot = self.allocator.alloc(1)
        if slot is None:
            raise RuntimeError("no KV slot free for the intent-pruning sentinel")
        self.sentinel = int(slot[0])
        # V of the sentinel is zero, a second line of defence behind the attention filter.
        pool = self.allocator.get_kvcache()
        for layer in range(pool.layer_num):
            pool.get_key_buffer(layer)[self.sentinel].zero_()
            pool.get_value_buffer(layer)[self.sentinel].zero_()
        logger.info("dead-slot substrate: sentinel KV slot %d", self.sentinel)

    def retake_sentinel(self) -> None:
        """The sentinel again after a reset (flush_cache) let it go, on the tree's next match."""
        if self.allocator is not None and self.sentinel is None:
            self.take_sentinel()

    def reset(self) -> None:
        self.evictable = self.protected = 0
        # flush_cache clears the allocator right after this: the slot is retaken on next use.
        self.sentinel = None

    def diverges(self, req: Req, up_to: int, branches: Branches) -> bool:
        """Whether the tree already holds the request's pruned key past its protected prefix with
        other positions live than the request's row. A pruned key names the session and its
        pruning, not which positions a scorer kept, so two requests can prune one key apart."""
        if not branches:
            return False
        tree = self._tree
        key = RadixKey(
            with_branches(req.full_untruncated_fill_ids[:up_to], branches), req.extra_key, cache_salt=req.cache_salt
        )
        held = RadixCache.match_prefix(tree, MatchPrefixParams(key=key)).last_device_node
        path = tree.path_device_indices(held)
        start = req.kv.cache_protected_len
        if len(path) <= start:
            return False
        row = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx][start : len(path)].to(path.device)
        return bool(((path[start:] == self.sentinel) != (row == self.sentinel)).any())

    # --- accounting of sentinel entries in node values ------------------------------------------

    def counts(self) -> tuple[int, int]:
        """Sentinel entries in the values of evictable and of protected nodes, as counted."""
        return self.evictable, self.protected

    def entries(self, node: TreeNode) -> int:
        """The sentinel entries of a node's value (counted once per value)."""
        if self.sentinel is None or node.value is None or node is self._tree.root_node:
            return 0
        cached = DEAD.get(node)
        if cached is None or cached[0] is not node.value:
            cached = DEAD.set(node, (node.value, int((node.value == self.sentinel).sum())))
        return cached[1]

    def inserted(self, node: TreeNode | None) -> None:
        """An insert ended at `node`: it creates at most one node, its last one; splits only
        re-divide counted nodes."""
        if node is not None and node is not self._tree.root_node and node not in COUNTED:
            COUNTED.set(node, True)
            if node.lock_ref == 0:
                self.evictable += self.entries(node)
            else:
                self.protected += self.entries(node)

    def split(self, child: TreeNode, new_node: TreeNode) -> None:
        if child in COUNTED:
            COUNTED.set(new_node, True)

    def deleted(self, node: TreeNode) -> None:
        """An evicted leaf's entries leave the evictable count."""
        self.evictable -= self.entries(node)

    def move(self, node: TreeNode | None, from_lock: int, sign: int) -> None:
        """Nodes whose lock_ref crosses 0 <-> 1 move between evictable and protected."""
        if self.allocator is None or self._tree.disable:
            return  # no sentinel, no dead entries: the plain tree pays no extra walk
        while node is not None and node is not self._tree.root_node:
            if node.lock_ref == from_lock:
                dead = self.entries(node)
                self.evictable -= sign * dead
                self.protected += sign * dead
            node = node.parent

    def held(self) -> int:
        """Real slots the substrate holds itself: the sentinel, counted as protected."""
        return 1 if self.sentinel is not None else 0

    def evict(self, params: EvictParams, evict: Callable[[EvictParams], EvictResult]) -> EvictResult:
        """Sentinel entries free nothing: keep evicting (`evict`: the tree's own eviction) until the
        real slots asked for are freed. Progress is what the allocator view counts as freed, not the
        allocator's available size, which stays put inside a deferred free group."""
        if self.allocator is None:
            return evict(params)
        view = self._tree.token_to_kv_pool_allocator
        start = view.real_freed
        while view.real_freed - start < params.num_tokens:
            result = evict(EvictParams(num_tokens=params.num_tokens - (view.real_freed - start)))
            if result.num_tokens_evicted == 0:
                break
        return EvictResult(num_tokens_evicted=view.real_freed - start)
