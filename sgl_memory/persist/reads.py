"""A session's checked read: its head and chunks taken each in one read of one open file, and
refused (StoreError, saying why) unless the format version, the checksums, the cache spec, the
session and the tenant are the expected ones; a head replaced meanwhile is read again.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors

from sgl_memory.persist.codec import BlockCodec
from sgl_memory.persist.header import READABLE_VERSIONS, checksum, named_chunks, parse_metadata
from sgl_memory.persist.layout import StoreLayout
from sgl_memory.persist.records import ANY_NAMESPACE, CacheSpec, Chunk, SessionRecord, StoreError

READ_ATTEMPTS = 3  # a head replaced between reading it and its chunks is read again


class CheckedReader:
    """Reads a session's record from its head and chunks, refusing a file that must not be used."""

    def __init__(self, layout: StoreLayout, codec: BlockCodec, spec: CacheSpec) -> None:
        self.layout, self.codec, self.spec = layout, codec, spec

    def read(self, tenant: str | None, session_id: str) -> SessionRecord | None:
        """The session's record, or None when it has no file; StoreError when the file must not be used."""
        path = self.layout.path(tenant, session_id)
        for attempt in range(READ_ATTEMPTS):
            try:
                data = path.read_bytes()
                meta, tensors = parse_metadata(data), load_tensors(data)
            except FileNotFoundError:
                return None  # never written, or removed (the quota, also another server's sharing the store)
            except Exception as exc:  # truncated or not a safetensors file at all
                raise StoreError(f"{path.name}: unreadable ({exc})") from None
            self._check(path, meta, tensors, tenant, session_id)
            chunks = named_chunks(meta)
            try:
                blocks = self._read_blocks(path, meta, tensors, chunks)
                break
            except FileNotFoundError:  # a writer replaced the head and removed a chunk it named
                if attempt == READ_ATTEMPTS - 1:
                    raise StoreError(
                        f"{path.name}: a chunk it names is gone (the session is being rewritten)"
                    ) from None
        os.utime(path)  # a read is a use: quota eviction is least recently used
        in_chunks = {b for c in chunks for b in range(c.first, c.first + c.count)}
        dirty = next((b for b in range(len(blocks)) if b not in in_chunks), len(blocks))  # a format-1 head: 0
        state, encoded = {}, {}
        for name, t in tensors.items():
            if name.startswith("s."):
                state[name[2:]] = t
            elif name.startswith("q."):
                owner, part = name[2:].rsplit(".", 1)
                encoded.setdefault(owner, {})[part] = t
        for name, spec in json.loads(meta.get("state_kv", "{}")).items():
            parts = {f"{spec['kind']}.{part}": t for part, t in encoded[name].items()}
            state[name] = self.codec.decode_tensor(
                parts, spec["kind"], tuple(spec["shape"]), spec["axis"], meta["quant"], getattr(torch, spec["dtype"])
            )
        # a file written before pruned paths carried one branch per event names one [position, id]
        # (its id is not this version's: the path is matched up to that position only)
        legacy = json.loads(meta.get("branch", "null"))
        branches = (
            tuple(map(tuple, json.loads(meta["branches"])))
            if "branches" in meta
            else ((tuple(legacy),) if legacy else ())
        )
        live = tensors["live"].to(torch.bool) if "live" in tensors else None
        return SessionRecord(
            tensors["token_ids"].tolist(),
            meta["text"],
            blocks,
            meta["quant"],
            meta["kivi"] == "True",
            int(meta["block_size"]),
            json.loads(meta["extra_key"]) if "extra_key" in meta else ANY_NAMESPACE,
            branches,
            live,
            state,
            generation=int(meta.get("generation", "0")),
            chunks=chunks,
            dirty=dirty,
        )

    def _read_blocks(
        self, path: Path, meta: dict[str, str], tensors: dict[str, torch.Tensor], chunks: tuple[Chunk, ...]
    ) -> list[dict[str, torch.Tensor]]:
        """The path's blocks: a format-1 head's own, then each of its chunks' in order (a later
        chunk's block stands for an earlier one's). FileNotFoundError: a chunk the head names is gone."""
        count = -(-int(meta["tokens"]) // int(meta["block_size"]))
        blocks: dict[int, dict[str, torch.Tensor]] = {}
        _add_blocks(blocks, tensors)
        for chunk in chunks:
            data = (path.parent / chunk.name).read_bytes()
            try:
                chunk_meta, chunk_tensors = parse_metadata(data), load_tensors(data)
            except Exception as exc:
                raise StoreError(f"{path.name}: its chunk {chunk.name} is unreadable ({exc})") from None
            if chunk_meta.get("checksum") != chunk.digest or chunk.digest != checksum(
                chunk_tensors, {k: v for k, v in chunk_meta.items() if k != "checksum"}
            ):
                raise StoreError(f"{path.name}: checksum mismatch in its chunk {chunk.name} (corrupted file)")
            _add_blocks(blocks, chunk_tensors)
        if any(b not in blocks for b in range(count)):
            raise StoreError(f"{path.name}: blocks of its path are missing")
        return [blocks[b] for b in range(count)]

    def _check(
        self,
        path: Path,
        meta: dict[str, str],
        tensors: dict[str, torch.Tensor],
        tenant: str | None,
        session_id: str,
    ) -> None:
        """StoreError unless the head is whole and this server's to load for this session."""
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise StoreError(
                f"{path.name}: format version {meta.get('format_version')!r}, expected one of {READABLE_VERSIONS}"
            )
        if meta.get("checksum") != checksum(tensors, {k: v for k, v in meta.items() if k != "checksum"}):
            raise StoreError(f"{path.name}: checksum mismatch (corrupted file)")
        written = json.loads(meta["spec"])
        # a pool of another dtype restores the file converted to its own (the launcher picks the dtype
        # from the CPU: the same store on another CPU meets this, and an 8-bit pool's files a float pool)
        if dict(written, dtype=self.spec.dtype) != asdict(self.spec):
            raise StoreError(f"{path.name}: written for another model or cache layout ({meta['spec']})")
        if meta["session_id"] != session_id or meta["tenant"] != (tenant or ""):
            raise StoreError(f"{path.name}: belongs to another session")


def _add_blocks(blocks: dict[int, dict[str, torch.Tensor]], tensors: dict[str, torch.Tensor]) -> None:
    """Tensors named b<block>.<part> into blocks by their block; a later call's block replaces."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith("b") and name[1 : name.find(".")].isdigit():
            b, rest = name.split(".", 1)
            found.setdefault(int(b[1:]), {})[rest] = t
    blocks.update(found)
