"""A session's write: its new full blocks each linked to the store's one copy of it (shared.py), its
last, partial block as a chunk file of its own, and a head that names its chunks, each written under
a temporary name, fsynced and renamed into place; the head's rename happens under the session
directory's lock only while the file is still at the generation the write continues
(compare-and-swap, WriteConflict otherwise). Why, and what readers rely on: store.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from sgl_memory.persist.codec import BlockCodec
from sgl_memory.persist.header import FORMAT_VERSION, checksum, generation_of, head_metadata, named_chunks
from sgl_memory.persist.layout import StoreLayout
from sgl_memory.persist.quant import RAW
from sgl_memory.persist.records import CacheSpec, Chunk, SessionRecord, WriteConflict
from sgl_memory.persist.shared import CHUNK_SUFFIX, link_block


class AtomicWriter:
    """Writes a session's record as its chunks and head, atomically and one generation at a time."""

    def __init__(self, layout: StoreLayout, codec: BlockCodec, spec: CacheSpec) -> None:
        self.layout, self.codec, self.spec = layout, codec, spec

    def write(self, tenant: str | None, session_id: str, record: SessionRecord, base: int | None = None) -> Path:
        """Store the record as the session's head and chunks: each full block from `record.dirty` on
        as a link to the store's copy of it, the last block when it is partial as a new chunk of the
        session's, the blocks before `record.dirty` in the chunks the record names. `base`: the
        generation the record continues (0: the session had no file); if another writer stored a
        different one since, nothing is written and WriteConflict says so. None: replace whatever is
        there (and write every block). A file that is missing (removed for the quota) or unreadable
        never blocks a write. The record's `generation`, `chunks` and `dirty` become the new head's."""
        path = self.layout.path(tenant, session_id)
        generation = (base if base is not None else max(0, generation_of(head_metadata(path)))) + 1
        n = len(record.blocks)
        full = len(record.token_ids) // record.block_size  # the blocks before a partial last one
        start = min(record.dirty, n) if base is not None else 0
        kept = [c for c in record.chunks if c.first < start]  # a chunk from `start` on is superseded
        if start and (not kept or kept[0].first or any(not (path.parent / c.name).exists() for c in kept)):
            start, kept = 0, []  # blocks before `start` in no chunk: a format-1 head's, or removed (the quota)
        path.parent.mkdir(parents=True, exist_ok=True)
        made: list[Path] = []  # the files this write made, removed again if it fails
        try:
            written = [self._link_block(path, record.blocks, b, made) for b in range(start, full)]
            if max(start, full) < n:
                written.append(self._write_chunk(path, generation, record.blocks, max(start, full), n))
                made.append(path.parent / written[-1].name)
            chunks = (*kept, *written)
            tensors = {"token_ids": torch.tensor(record.token_ids, dtype=torch.int64)}
            if record.live is not None:
                tensors["live"] = record.live.to(torch.uint8)
            layout = {}
            for name, t in record.state.items():
                kind = record.state_kv.get(name)
                if (
                    kind is None or record.quant in RAW
                ):  # unquantized: KV state stored as held (memory keys are float32)
                    tensors[f"s.{name}"] = t.contiguous()
                    continue
                axis = 1 if kind == "k" and record.kivi else 3
                encoded = self.codec.encode_tensor(kind, t, axis)
                tensors.update({f"q.{name}.{part.split('.', 1)[1]}": x for part, x in encoded.items()})
                layout[name] = {
                    "kind": kind,
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "axis": axis,
                }
            meta = {
                "format_version": str(FORMAT_VERSION),
                "tenant": tenant or "",
                "session_id": session_id,
                "spec": json.dumps(asdict(self.spec)),
                "quant": record.quant,
                "kivi": str(record.kivi),
                "block_size": str(record.block_size),
                "tokens": str(len(record.token_ids)),
                "text": record.text,
                "extra_key": json.dumps(record.extra_key),
                "branches": json.dumps(record.branches),
                "state_kv": json.dumps(layout),
                "generation": str(generation),
                "chunks": json.dumps([[c.name, c.first, c.count, c.digest] for c in chunks]),
            }
            meta["checksum"] = checksum(tensors, meta)
            replaced = self._replace(path, tensors, meta, base)
        except BaseException:
            for file in made:
                file.unlink(missing_ok=True)
            raise
        named = {c.name for c in chunks}
        for name in replaced - named:  # the replaced head's chunks the new one does not name
            (path.parent / name).unlink(missing_ok=True)
        record.generation, record.chunks, record.dirty = generation, chunks, n
        return path

    def _link_block(self, head: Path, blocks: list[dict[str, torch.Tensor]], b: int, made: list[Path]) -> Chunk:
        """Full block `b` as the session's link to the store's copy of it (written now if there is none)."""
        tensors, meta = self._chunk(blocks, b, b + 1)
        link, new = link_block(head, meta["checksum"], lambda: self._save(head.parent, tensors, meta))
        if new:
            made.append(link)
        return Chunk(link.name, b, 1, meta["checksum"])

    def _write_chunk(
        self, head: Path, generation: int, blocks: list[dict[str, torch.Tensor]], first: int, stop: int
    ) -> Chunk:
        """Blocks first .. stop - 1 as a chunk file of the session, named after this writer."""
        tensors, meta = self._chunk(blocks, first, stop)
        name = f"{head.stem}.w{os.getpid()}-{generation}-{os.urandom(4).hex()}{CHUNK_SUFFIX}"
        os.replace(self._save(head.parent, tensors, meta), head.parent / name)  # a name no other writer has
        return Chunk(name, first, stop - first, meta["checksum"])

    @staticmethod
    def _chunk(blocks: list[dict[str, torch.Tensor]], first: int, stop: int) -> tuple[dict, dict[str, str]]:
        """A chunk file's tensors and metadata (its checksum included) for blocks first .. stop - 1."""
        tensors = {f"b{b}.{name}": t for b in range(first, stop) for name, t in blocks[b].items()}
        meta = {"format_version": str(FORMAT_VERSION), "first": str(first), "count": str(stop - first)}
        meta["checksum"] = checksum(tensors, meta)
        return tensors, meta

    def _save(self, directory: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
        """The tensors as a safetensors file on disk under a temporary name (this writer's), returned."""
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"w{os.getpid()}-", suffix=".tmp")
        os.close(fd)
        try:
            try:
                save_file(tensors, tmp, metadata=meta)
            except SafetensorError as exc:  # how safetensors reports a failed write (ENOSPC, EFBIG, ...)
                raise OSError(str(exc)) from exc
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return tmp

    def _replace(
        self, path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str], base: int | None
    ) -> set[str]:
        """Write the head and rename it over the session's if the file is still at generation
        `base`; returns the names of the chunks the replaced head named."""
        tmp = self._save(path.parent, tensors, meta)
        try:
            # the lock covers the check and the rename only (the slow part, writing, is done); it
            # is the directory's, so there is no lock file to leave behind, and the kernel drops it
            # with a writer that dies holding it
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX)
                old = head_metadata(path)  # unreadable: replaced; its chunks cannot be told from others'
                current = generation_of(old)
                if base is not None and current > 0 and current != base:
                    raise WriteConflict(
                        f"{path.name}: another server stored generation {current} of the session; "
                        f"this write continues generation {base}"
                    )
                os.replace(tmp, path)  # readers see the old file or the new one, never a torn one
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return {c.name for c in named_chunks(old)} if old else set()
