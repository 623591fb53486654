"""Putting a compression event's kept set into the request's slot-map row, by the request's layout:
dead_slot (the pruning made the session's path, a branch of it) or compact (rows re-packed).

The row arithmetic of both layouts is layouts.py's; this is what the event does around it with the
request and the tree: the copies of shared slots, the protected prefix, the branch, the shift.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sgl_memory.core import tree_fill
from sgl_memory.core.kvhost import KVHost, KVPool
from sgl_memory.core.mechanism import RowEdit
from sgl_memory.core.requests import RequestTable
from sgl_memory.core.rope import Rope
from sgl_memory.core.views import RequestView
from sgl_memory.intent.layouts import apply_compact, apply_dead_slot
from sgl_memory.intent.paths import branch_id

if TYPE_CHECKING:
    from sgl_memory.intent.planner import RequestIntent

logger = logging.getLogger(__name__)


class RowLayout:
    """Applies an event's kept positions to the request's row in its layout (dead_slot or compact),
    and keeps what compact needs: the model's RoPE and each compacted request's position shift
    (the `shifts` table, IntentPruner.position_shift)."""

    def __init__(self, shifts: RequestTable[int]):
        self.shifts = shifts
        self.rope: Rope | None = None  # read from the model at the first request that asks for compact

    def load_rope(self, hf_config: object) -> None:
        """The model's RoPE for compact's re-rotation; ValueError for one it cannot re-rotate."""
        self.rope = Rope.from_hf_config(hf_config)

    def apply(
        self,
        req: RequestView,
        state: RequestIntent,
        tree: KVHost,
        row: torch.Tensor,
        kept: torch.Tensor,
        live: torch.Tensor,
        pool: KVPool,
    ) -> RowEdit | None:
        """live: [length] bool, the row's positions that held KV before the event."""
        length = live.numel()
        protected = req.kv.cache_protected_len
        if state.layout == "dead_slot":
            return self._dead_slot(req, state, tree, row, kept, live, protected)
        edit = apply_compact(
            row,
            kept,
            length,
            protected,
            tree.sentinel,
            tree.alloc_slots,
            tree.free_real,
            [pool.get_key_buffer(i) for i in range(pool.layer_num)],
            [pool.get_value_buffer(i) for i in range(pool.layer_num)],
            self.rope,
        )
        if edit is None:
            logger.warning("intent pruning: no free KV slots to compact request %s; left unpruned", req.rid)
            return None
        req.kv.cache_protected_len = 0  # every slot of the re-packed row is the request's own now
        self.shifts.set(req.rid, edit.position_shift)  # the engine runs its positions shifted
        return edit

    def _dead_slot(
        self,
        req: RequestView,
        state: RequestIntent,
        tree: KVHost,
        row: torch.Tensor,
        kept: torch.Tensor,
        live: torch.Tensor,
        protected: int,
    ) -> RowEdit | None:
        """Prune the row and make the pruning the path's: from its first newly dropped position b
        the path is a branch of the session's (intent/paths.py). Kept positions in [b, protected)
        hold slots of the shared path, which other paths still own: their KV is copied into fresh
        slots, so the branch owns every slot it holds and the shared path's stay evictable on
        their own. The next turn's prefill then attends to exactly what this event kept."""
        length = live.numel()
        newly = live.clone()
        newly[kept] = False
        dropped = torch.nonzero(newly).flatten()
        if not dropped.numel():
            return None
        b = int(dropped[0])
        shared = kept[(kept >= b) & (kept < protected)]
        if shared.numel():
            fresh = tree.alloc_slots(shared.numel())  # may evict: the request's own path is locked
            if fresh is None:
                logger.warning(
                    "intent pruning: no free KV slots to copy %d kept positions of request %s; left unpruned",
                    shared.numel(),
                    req.rid,
                )
                return None
            fresh = fresh.to(row.device)
            tree_fill.copy_within(tree, fresh, row[shared].to(torch.int64))
            row[shared] = fresh.to(row.dtype)
        edit = apply_dead_slot(row, kept, length, protected, tree.sentinel, tree.free_real)
        edit.copied = int(shared.numel())
        # from b on the row is the request's own: SGLang's insert frees what the tree already held
        # there, its release what the tree never took
        req.kv.cache_protected_len = min(protected, b)
        state.branches = tuple(x for x in state.branches if x[0] < b) + (
            (b, branch_id(state.namespace, int(req.origin_input_ids[b]))),
        )
        return edit
