"""Holds: KV brought back for a waiting request stays in the tree until the request runs.

A mechanism that restores or matches KV for a request still in the scheduler's waiting queue
(persistence) holds the path for it (KVHost.hold): the path is locked against eviction until the
request's prefill is scheduled (the scheduler locks its prefix then), it is dropped, or nothing
can run while requests wait. The prefill hook (admission.py) puts held requests first and lets go
of the holds of the requests that left the queue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang.srt.mem_cache.radix_cache import TreeNode

from sgl_memory.core import prometheus

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

HELD_TOKENS = prometheus.gauge(
    "held_tokens", "KV tokens held in the tree for requests waiting to run (restored or matched)"
)


class Holds:
    """The tree's holds for waiting requests, each a locked path and its length in tokens, and the
    `held_tokens` gauge over them."""

    def __init__(self, lock: Callable[[TreeNode], Any], unlock: Callable[[TreeNode], Any]):
        self._lock, self._unlock = lock, unlock  # the tree's inc_lock_ref and dec_lock_ref
        self._holds: dict[Req, tuple[TreeNode, int]] = {}  # waiting request -> (node held for it, tokens)

    def hold(self, req: Req, node: TreeNode, tokens: int) -> None:
        self.release(req)
        self._lock(node)
        self._holds[req] = (node, tokens)
        HELD_TOKENS.set(self.held_tokens())

    def release(self, req: Req) -> None:
        held = self._holds.pop(req, None)
        if held is not None:
            self._unlock(held[0])
            HELD_TOKENS.set(self.held_tokens())

    def clear(self) -> None:
        """Every hold gone without unlocking: flush_cache runs with no request waiting, and the
        nodes are gone with the tree."""
        self._holds.clear()

    def held_tokens(self) -> int:
        return sum(tokens for _, tokens in self._holds.values())

    def held_first(self, waiting: list[Req]) -> list[Req]:
        """The waiting queue with the requests the tree holds KV for first, each part in its order:
        their prefill is only their new tokens, and a request that must prefill its whole history
        ahead of them (first come, first served) would need the room their holds keep and evict
        what was brought back for them."""
        if not self._holds:
            return waiting
        return [r for r in waiting if r in self._holds] + [r for r in waiting if r not in self._holds]

    def after_prefill(self, scheduler: Scheduler, scheduled: bool, idle: bool) -> None:
        """After the scheduler formed a prefill batch (or found none): a held request that left the
        queue holds its prefix through the scheduler's own lock now, or was aborted. When nothing
        runs and nothing was scheduled while requests wait, every hold is let go: a hold must never
        keep the pool from the requests that could run (they find the held KV evictable, and a held
        request its KV, if still there, by its own match)."""
        if not self._holds:
            return
        waiting = set(scheduler.waiting_queue)
        for req in [r for r in self._holds if r not in waiting or (idle and not scheduled)]:
            self.release(req)
