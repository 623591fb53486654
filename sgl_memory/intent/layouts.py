"""Layouts: how a pruning decision is realised in a request's slot-map row.

`dead_slot` (IntentKV 3.4): dropped positions of the row point at the sentinel slot; kept KV rows,
their RoPE phases and slot ids stay where they are, so the row can still be inserted into the radix
tree and a later turn that shares the prefix reuses it. Attention leaves the sentinel out of the
index list it builds. Token ids and the sequence length do not change.

`compact` (the published StreamingLLM / SnapKV / H2O path): kept rows are copied to fresh slots at
contiguous positions 0..K-1 with their keys re-rotated, and the request continues at position K.
Its KV no longer matches its tokens' positions, so the request is kept out of the radix tree.
"""

from __future__ import annotations

import torch

from sgl_memory.core import kv_rows
from sgl_memory.core.mechanism import RowEdit
from sgl_memory.core.rope import Rope

LAYOUTS = ("dead_slot", "compact")


def freeable(dropped_slots: torch.Tensor, kept_slots: torch.Tensor, sentinel: int) -> torch.Tensor:
    """Alias-aware free (IntentKV appendix H): of the slots at dropped positions outside the
    radix-protected prefix, only those that are neither the sentinel nor still referenced at a kept
    position go back to the allocator, each once."""
    slots = dropped_slots[dropped_slots != sentinel]
    slots = slots[~torch.isin(slots, kept_slots)]
    return torch.unique(slots)


def apply_dead_slot(row: torch.Tensor, kept: torch.Tensor, length: int, protected: int, sentinel: int, free) -> RowEdit:
    """row: the request's req_to_token row (a view, edited in place); kept: kept positions < length."""
    mask = torch.ones(length, dtype=torch.bool)
    mask[kept] = False
    dropped = mask.nonzero().flatten()
    slots = row[:length].to(torch.int64)
    private = dropped[dropped >= protected]
    to_free = freeable(slots[private], slots[kept], sentinel)
    row[dropped] = sentinel
    if to_free.numel():
        free(to_free)
    return RowEdit(dropped, int(to_free.numel()))


def apply_compact(
    row: torch.Tensor,
    kept: torch.Tensor,
    length: int,
    protected: int,
    sentinel: int,
    alloc,
    free,
    k_buffers,
    v_buffers,
    rope: Rope,
) -> RowEdit | None:
    """Re-pack the kept rows into fresh slots at positions 0..K-1. None when the pool is full."""
    k = kept.numel()
    fresh = alloc(k)
    if fresh is None:
        return None
    fresh = fresh.to(torch.int64)
    slots = row[:length].to(torch.int64)
    src = slots[kept]
    delta = torch.arange(k) - kept
    for k_buf, v_buf in zip(k_buffers, v_buffers):
        # re-rotated as values and stored back in the pool's format (a packed row gets a new scale)
        k_buf[fresh] = kv_rows.convert(rope.rotate(kv_rows.values(k_buf[src]), delta), k_buf.dtype)
        v_buf[fresh] = v_buf[src]
    private = slots[protected:length]
    to_free = torch.unique(private[private != sentinel])
    if to_free.numel():
        free(to_free)
    row[:k] = fresh.to(row.dtype)
    row[k:length] = sentinel
    return RowEdit(torch.arange(k, length), int(to_free.numel()), position_shift=k - length, private=True)
