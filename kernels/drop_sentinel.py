"""Leave the sentinel slot out of a batch's flattened KV index lists (GPU attention metadata).

SGLang's Triton and FlashInfer backends build, per forward, `kv_indptr` [bs + 1] and `kv_indices`
(each request's slot-map row, concatenated). With intent pruning, rows contain the sentinel slot at
pruned positions; attention must not read it. Dropping it keeps each request's live slots in order
and moves `kv_indptr` to the live counts, in place and without a host synchronisation, so the
step stays capturable in a CUDA graph: the new indptr is a gather from a running count of live
entries (rows are contiguous, so entry i of indptr becomes the number of live slots before it),
and one program per request copies its live slots into place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _live_rows(old_indptr, src, new_indptr, dst, sentinel, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.load(old_indptr + row)
    end = tl.load(old_indptr + row + 1)
    out = tl.load(new_indptr + row)
    offs = tl.arange(0, BLOCK)
    for block in range(start, end, BLOCK):
        pos = block + offs
        idx = tl.load(src + pos, mask=pos < end, other=sentinel)
        keep = (idx != sentinel).to(tl.int32)
        rank = tl.cumsum(keep, axis=0) - keep  # exclusive prefix sum: where each kept slot goes
        tl.store(dst + out + rank, idx, mask=keep > 0)
        out += tl.sum(keep, axis=0)


def live_indptr(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sentinel: int) -> torch.Tensor:
    live = torch.zeros(kv_indices.numel() + 1, dtype=torch.int64, device=kv_indices.device)
    live[1:] = torch.cumsum(kv_indices != sentinel, 0)
    return live[kv_indptr.long()].to(kv_indptr.dtype)


def drop_sentinel_(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sentinel: int) -> None:
    """In place: kv_indices[new_indptr[i]:new_indptr[i+1]] = request i's live slots, kv_indptr = new_indptr."""
    new_indptr = live_indptr(kv_indptr, kv_indices, sentinel)
    src = kv_indices.clone()  # rows move towards the front; reading a copy keeps programs independent
    bs = kv_indptr.numel() - 1
    _live_rows[(bs,)](kv_indptr, src, new_indptr, kv_indices, sentinel, BLOCK=BLOCK)
    kv_indptr.copy_(new_indptr)


def drop_sentinel_reference(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sentinel: int):
    """The same contract, one request at a time: (new_indptr, live indices concatenated)."""
    rows, indptr = [], [0]
    for i in range(kv_indptr.numel() - 1):
        seg = kv_indices[int(kv_indptr[i]) : int(kv_indptr[i + 1])]
        rows.append(seg[seg != sentinel])
        indptr.append(indptr[-1] + rows[-1].numel())
    return torch.tensor(indptr, dtype=kv_indptr.dtype), torch.cat(rows) if rows else kv_indices[:0]
