"""The on-disk session KV store: per (tenant, session, model) a head file and the chunk files it names.

A session's KV (keys and values of every layer along its token path) is cut into fixed-size blocks,
the unit the later KV-memory retrieval shares; each block holds its layers stacked, quantized
(quant.py) or as bf16 / fp32 values. The blocks lie in chunk files (safetensors), each a run of
blocks written once and never changed; the head file (safetensors) holds the rest and is replaced
by each turn's write with a single atomic rename. Its metadata carries what a loader must check
before trusting it: format version, model id and config hash, the cache spec, session and tenant,
token ids, the rendered prompt text, quantization, its generation, the chunks (name, first block,
blocks, sha256), and a sha256 over every tensor of the head and the metadata itself.

A full block is stored once however many sessions hold it: the store's copy is named by its
checksum and each session's head names a hard link to it (shared.py), so sessions that share a
prefix in the radix tree (a tool prefix, a sub-agent's parent context) store its KV once. A turn
writes its new full blocks (linking the copies the store has), its partial last block as a chunk of
its own, and a head that names them after the chunks it keeps; a later chunk's blocks stand for an
earlier one's. So a turn's write follows its new tokens, not the session's history (a 16k-token
history in Q8 is 100 MB: rewritten and hashed every turn, it cost more than the turn's own
prefill). A head of format 1 (before chunks) holds its blocks itself and reads as before.

File names are hashes of the ids, so no id can name a path outside the store directory.

Several servers may share one store (replicas behind a router, one taking over another's sessions).
A reader needs no lock: a file is written under a temporary name and renamed over the old one, and
a reader takes the whole file in one read of one open file, so it sees the old file or the new one
(safetensors' own reader opens the path a second time to map its data: a rename between the two
opens gave it one file's header and the other's bytes). Chunks are written before the head that
names them; the chunks a new head no longer names are removed after its rename, so a reader that
finds a chunk of the head it read gone reads the new head again. Writers of one session are ordered by its generation: a
writer says which generation its record continues, and the rename happens under an exclusive lock
on the session's directory only if the file is still at that generation (compare-and-swap). So a
session's file is one linear history: two servers that both continue generation 5 cannot both
store a generation 6; the second is refused (WriteConflict) and must re-read the session.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from sgl_memory.persist.codec import BlockCodec
from sgl_memory.persist.header import generation_of, head_metadata
from sgl_memory.persist.layout import StoreLayout
from sgl_memory.persist.reads import CheckedReader
from sgl_memory.persist.records import ANY_NAMESPACE, CacheSpec, Chunk, SessionRecord, StoreError, WriteConflict
from sgl_memory.persist.atomic import AtomicWriter

# the record types are the store's own: its callers import them from here
__all__ = ["ANY_NAMESPACE", "CacheSpec", "Chunk", "SessionFiles", "SessionRecord", "StoreError", "WriteConflict"]


class SessionFiles:
    """A server's session store (see the module's docstring), its jobs each in a piece of its own:
    the files' names, sizes and quota (layout.py), blocks encoded and decoded (codec.py), the
    atomic write (atomic.py) and the checked read (reads.py)."""

    def __init__(
        self, root: str | os.PathLike, spec: CacheSpec, quant: str = "q4", kivi: bool = False, block_size: int = 256
    ) -> None:
        self.root = Path(root).expanduser()
        self.spec, self.quant, self.kivi, self.block_size = spec, quant, kivi, block_size
        self.layout = StoreLayout(self.root, spec)
        self.codec = BlockCodec(spec, quant, kivi, block_size)
        self.writer = AtomicWriter(self.layout, self.codec, spec)
        self.reader = CheckedReader(self.layout, self.codec, spec)
        self.removed_partial = self.layout.remove_partial_writes()

    # --- files on disk -----------------------------------------------------------------------------

    @property
    def disk_bytes(self) -> int:
        """Bytes of the session files, as of the last enforce_quota."""
        return self.layout.disk_bytes

    def enforce_quota(self, quota_bytes: int) -> list[Path]:
        return self.layout.enforce_quota(quota_bytes)

    def files(self, tenant: str | None, session_id: str) -> list[Path]:
        return self.layout.files(tenant, session_id)

    def size(self, tenant: str | None, session_id: str) -> int:
        return self.layout.size(tenant, session_id)

    def path(self, tenant: str | None, session_id: str) -> Path:
        return self.layout.path(tenant, session_id)

    # --- encoding ------------------------------------------------------------------------------

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        return self.codec.encode(keys, values)

    def record(self, token_ids: list[int], text: str, keys: torch.Tensor, values: torch.Tensor) -> SessionRecord:
        return self.codec.record(token_ids, text, keys, values)

    def continued(
        self,
        previous: SessionRecord | None,
        token_ids: list[int],
        start: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        **key: Any,
    ) -> SessionRecord:
        return self.codec.continued(previous, token_ids, start, keys, values, **key)

    def decode(
        self, record: SessionRecord, start: int = 0, stop: int | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec.decode(record, start, stop, dtype)

    # --- write and read --------------------------------------------------------------------------

    def generation(self, tenant: str | None, session_id: str) -> int:
        """The generation of the session's file: 0 when it has none, -1 when it cannot be read.
        Reads the file's header only."""
        return generation_of(head_metadata(self.path(tenant, session_id)))

    def write(self, tenant: str | None, session_id: str, record: SessionRecord, base: int | None = None) -> Path:
        return self.writer.write(tenant, session_id, record, base)

    def read(self, tenant: str | None, session_id: str) -> SessionRecord | None:
        return self.reader.read(tenant, session_id)
