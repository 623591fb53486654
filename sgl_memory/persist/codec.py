"""KV as a session's blocks and back: each block holds its layers' keys and values stacked,
quantized (quant.py) or as a pool holds them (bf16 / fp32 values, fp8 bytes, packed int8 rows), and
a record is built from the blocks of a path. KV comes in and goes out in the pool's own format
(core/kv_rows.py): a block stored in it is copied, any other is converted.
"""

from __future__ import annotations

from typing import Any

import torch

from sgl_memory.core import kv_rows
from sgl_memory.persist.quant import BITS, GROUP, RAW, Quantized, dequantize, quantize
from sgl_memory.persist.records import CacheSpec, SessionRecord


class BlockCodec:
    """Encodes KV into blocks of `block_size` tokens in the store's quantization, and decodes them."""

    def __init__(self, spec: CacheSpec, quant: str, kivi: bool, block_size: int) -> None:
        self.spec, self.quant, self.kivi, self.block_size = spec, quant, kivi, block_size

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Blocks of [layers, tokens, kv_heads, head_dim] KV that starts at a block boundary."""
        blocks = []
        for start in range(0, keys.shape[1], self.block_size):
            stop = start + self.block_size
            block = self.encode_tensor("k", keys[:, start:stop], 1 if self.kivi else -1)
            block.update(self.encode_tensor("v", values[:, start:stop], -1))
            blocks.append(block)
        return blocks

    def record(self, token_ids: list[int], text: str, keys: torch.Tensor, values: torch.Tensor) -> SessionRecord:
        return SessionRecord(list(token_ids), text, self.encode(keys, values), self.quant, self.kivi, self.block_size)

    def continued(
        self,
        previous: SessionRecord | None,
        token_ids: list[int],
        start: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        **key: Any,
    ) -> SessionRecord:
        """The record of a path whose KV from token `start` (a block boundary) on is `keys` and
        `values` and before it the previous record's (None: start is 0). The blocks before `start`
        stay in the chunks they are in on disk: the next write writes the rest. `key`: the path's
        extra_key, branches and live mask."""
        kept = start // self.block_size
        previous = previous if start else None
        old = previous.blocks[:kept] if previous is not None else []
        record = SessionRecord(
            token_ids, "", old + self.encode(keys, values), self.quant, self.kivi, self.block_size, **key
        )
        if previous is not None:
            record.generation, record.chunks, record.dirty = (
                previous.generation,
                previous.chunks,
                min(previous.dirty, kept),
            )
        return record

    def encode_tensor(self, name: str, x: torch.Tensor, axis: int) -> dict[str, torch.Tensor]:
        """`x` (a block's keys or values, or KV state of a head) in the store's quantization, grouped
        along `axis`: the tensors it is stored as, named after `name`."""
        if self.quant in RAW:
            return {name: kv_rows.convert(x, RAW[self.quant]).contiguous()}
        q = quantize(kv_rows.values(x), BITS[self.quant], axis=axis)
        return {
            f"{name}.codes": q.codes.contiguous(),
            f"{name}.scales": q.scales.contiguous(),
            f"{name}.biases": q.biases.contiguous(),
        }

    def decode(
        self, record: SessionRecord, start: int = 0, stop: int | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [layers, stop - start, kv_heads, head_dim] of tokens start .. stop - 1 in a
        pool of `dtype`'s format (packed int8: head_dim + 2 bytes a row); only the blocks that hold
        them are decoded."""
        n = len(record.token_ids)
        stop = n if stop is None else stop
        size = record.block_size
        first, last = start // size, -(-stop // size)
        # every block is decoded straight into one buffer (no per-block tensors to concatenate)
        width = kv_rows.row_bytes(self.spec.head_dim, dtype) // dtype.itemsize
        shape = (self.spec.layers, min(last * size, n) - first * size, self.spec.kv_heads, width)
        keys, values = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        for b in range(first, last):
            at, length = (b - first) * size, min(size, n - b * size)
            part = (*shape[:1], length, self.spec.kv_heads, self.spec.head_dim)  # the values' shape
            self.decode_tensor(
                record.blocks[b], "k", part, 1 if record.kivi else 3, record.quant, dtype, keys[:, at : at + length]
            )
            self.decode_tensor(record.blocks[b], "v", part, 3, record.quant, dtype, values[:, at : at + length])
        cut = slice(start - first * size, stop - first * size)
        return keys[:, cut], values[:, cut]

    def decode_tensor(
        self,
        block: dict[str, torch.Tensor],
        name: str,
        shape: tuple[int, ...],
        axis: int,
        quant: str,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The tensor `name` of `block` (values of `shape`, stored in `quant`) in `dtype`'s format
        (into `out` if given)."""
        if quant in RAW:
            x = kv_rows.convert(block[name], dtype)
            return x if out is None else out.copy_(x)
        q = Quantized(
            block[f"{name}.codes"], block[f"{name}.scales"], block[f"{name}.biases"], shape, BITS[quant], axis, GROUP
        )
        if dtype == kv_rows.PACKED:  # a packed row's scale is its head's: from the values, not the groups
            x = kv_rows.encode(dequantize(q, torch.float32))
            return x if out is None else out.copy_(x)
        return dequantize(q, dtype, out)
