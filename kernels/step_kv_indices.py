"""A decode step's KV index lists when each request reads only some of its positions (SentenceKV).

SGLang's Triton and FlashInfer decode kernels read each request's KV through `kv_indptr` [bs + 1]
and `kv_indices` (slots, concatenated). A step whose reads are a mask over a request's positions
(core/decode.py: the always-read positions, the retrieved sentences, the generated tokens) needs
the lists of the masked slots instead of the whole slot-map row. One program per request walks its
row in blocks, keeps the slots whose position is read, below the request's length and not the
sentinel (a pruned position), and writes them in position order at its offset. The offsets come
from a cumulative sum on the device: no host synchronisation, so the step stays capturable.

Per layer, a backend would build one list per layer (the reads differ by layer); SGLang's GPU
backends take one list per forward, so this kernel is not wired into them yet (sentencekv refuses
a GPU backend at start-up). It is tested against `step_kv_indices_reference` under TRITON_INTERPRET.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _gather_reads(
    req_to_token, rows, seq_lens, reads, indptr, out, sentinel, row_stride, reads_stride, BLOCK: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64)  # offsets in int64: a large slot map overflows int32
    row = tl.load(rows + i).to(tl.int64)
    length = tl.load(seq_lens + i)
    at = tl.load(indptr + i)
    offs = tl.arange(0, BLOCK)
    for block in range(0, length, BLOCK):
        pos = block + offs
        inside = pos < length
        slot = tl.load(req_to_token + row * row_stride + pos, mask=inside, other=sentinel)
        read = tl.load(reads + i * reads_stride + pos, mask=inside, other=0)
        keep = ((read != 0) & (slot != sentinel)).to(tl.int32)
        rank = tl.cumsum(keep, axis=0) - keep
        tl.store(out + at + rank, slot, mask=keep > 0)
        at += tl.sum(keep, axis=0)


def read_counts(req_to_token, rows, seq_lens, reads, sentinel: int) -> torch.Tensor:
    """[bs + 1] int32: where each request's list starts, computed on the device."""
    width = reads.shape[1]
    slots = req_to_token[rows.long(), :width]
    inside = torch.arange(width, device=reads.device)[None, :] < seq_lens[:, None]
    counts = (reads & inside & (slots != sentinel)).sum(1)
    indptr = torch.zeros(rows.numel() + 1, dtype=torch.int32, device=reads.device)
    indptr[1:] = torch.cumsum(counts, 0)
    return indptr


def step_kv_indices(req_to_token, rows, seq_lens, reads, sentinel: int, out: torch.Tensor) -> torch.Tensor:
    """Write the read slots of each request into `out` (at least bs * reads.shape[1] long, the
    slot-map dtype); returns kv_indptr. reads [bs, width >= max seq_len] bool: the positions read."""
    indptr = read_counts(req_to_token, rows, seq_lens, reads, sentinel)
    _gather_reads[(rows.numel(),)](
        req_to_token, rows, seq_lens, reads, indptr, out, sentinel, req_to_token.stride(0), reads.stride(0), BLOCK=BLOCK
    )
    return indptr


def step_kv_indices_reference(req_to_token, rows, seq_lens, reads, sentinel: int):
    """The same contract, one request at a time: (kv_indptr, the lists concatenated)."""
    lists, indptr = [], [0]
    for row, length, mask in zip(rows.tolist(), seq_lens.tolist(), reads):
        slots = req_to_token[row, :length]
        picked = slots[mask[:length] & (slots != sentinel)]
        lists.append(picked)
        indptr.append(indptr[-1] + picked.numel())
    return torch.tensor(indptr, dtype=torch.int32), torch.cat(lists)
