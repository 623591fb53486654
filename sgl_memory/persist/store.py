"""The on-disk session KV store: one safetensors file per (tenant, session, model).

A session's KV (keys and values of every layer along its token path) is cut into fixed-size blocks,
the unit the later KV-memory retrieval shares; each block holds its layers stacked, quantized
(quant.py) or bf16. One file per session keeps a turn's write a single atomic rename and a restore
a single read; the file's metadata carries what a loader must check before trusting it: format
version, model id and config hash, the cache spec, session and tenant, token ids, the rendered
prompt text, quantization, and a sha256 over every tensor and the metadata itself.

File names are hashes of the ids, so no id can name a path outside the store directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sgl_memory.persist.quant import BITS, GROUP, Quantized, dequantize, quantize

FORMAT_VERSION = 1


class StoreError(RuntimeError):
    """A file that must not be loaded; the message says why."""


@dataclass(frozen=True)
class CacheSpec:
    """What KV from a file must match to be loaded into this server's pool."""

    model_id: str
    config_hash: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int


@dataclass
class SessionKV:
    token_ids: list[int]
    text: str
    keys: torch.Tensor  # [layers, tokens, kv_heads, head_dim]
    values: torch.Tensor


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:40]


class SessionFiles:
    def __init__(self, root: str | os.PathLike, spec: CacheSpec, quant: str = "q4", kivi: bool = False, block_size: int = 256):
        self.root = Path(root).expanduser()
        self.spec, self.quant, self.kivi, self.block_size = spec, quant, kivi, block_size
        self.removed_partial = self._remove_partial_writes()

    def _remove_partial_writes(self) -> int:
        """Temporary files of writers that died before their rename; never loadable, only space."""
        stale = list(self.root.glob("*/*/*.tmp")) if self.root.exists() else []
        for tmp in stale:
            tmp.unlink(missing_ok=True)
        return len(stale)

    def enforce_quota(self, quota_bytes: int) -> list[Path]:
        """Delete least recently used session files until the store fits in quota_bytes."""
        files = sorted(self.root.glob("*/*/*.safetensors"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        removed = []
        while files and total > quota_bytes:
            oldest = files.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink(missing_ok=True)
            removed.append(oldest)
        return removed

    def path(self, tenant: str | None, session_id: str) -> Path:
        model = _digest(self.spec.model_id, self.spec.config_hash)
        return self.root / _digest("tenant", tenant or "") / model / f"{_digest('session', session_id)}.safetensors"

    # --- write -----------------------------------------------------------------------------------

    def write(self, tenant: str | None, session_id: str, kv: SessionKV) -> Path:
        tensors = {"token_ids": torch.tensor(kv.token_ids, dtype=torch.int64)}
        n = len(kv.token_ids)
        for b, start in enumerate(range(0, n, self.block_size)):
            stop = min(start + self.block_size, n)
            for name, x, axis in (("k", kv.keys, 1 if self.kivi else -1), ("v", kv.values, -1)):
                tensors.update(self._encode(f"b{b}.{name}", x[:, start:stop], axis))
        meta = {
            "format_version": str(FORMAT_VERSION), "tenant": tenant or "", "session_id": session_id,
            "spec": json.dumps(asdict(self.spec)), "quant": self.quant, "kivi": str(self.kivi),
            "block_size": str(self.block_size), "tokens": str(n), "text": kv.text,
        }  # fmt: skip
        meta["checksum"] = _checksum(tensors, meta)
        path = self.path(tenant, session_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)  # readers see the old file or the new one, never a torn one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return path

    def _encode(self, prefix: str, x: torch.Tensor, axis: int) -> dict[str, torch.Tensor]:
        if self.quant == "bf16":
            return {prefix: x.to(torch.bfloat16).contiguous()}
        q = quantize(x, BITS[self.quant], axis=axis)
        return {f"{prefix}.codes": q.codes.contiguous(), f"{prefix}.scales": q.scales.contiguous(),
                f"{prefix}.biases": q.biases.contiguous()}  # fmt: skip

    # --- read ------------------------------------------------------------------------------------

    def read(self, tenant: str | None, session_id: str, dtype: torch.dtype = torch.bfloat16) -> SessionKV | None:
        """The session's KV, or None when it has no file; StoreError when the file must not be used."""
        path = self.path(tenant, session_id)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # truncated or not a safetensors file at all
            raise StoreError(f"{path.name}: unreadable ({exc})") from None
        self._check(path, meta, tensors, tenant, session_id)
        os.utime(path)  # a read is a use: quota eviction is least recently used
        tokens = tensors["token_ids"].tolist()
        keys, values = [], []
        for b, start in enumerate(range(0, len(tokens), int(meta["block_size"]))):
            stop = min(start + int(meta["block_size"]), len(tokens))
            shape = (self.spec.layers, stop - start, self.spec.kv_heads, self.spec.head_dim)
            keys.append(self._decode(tensors, f"b{b}.k", shape, 1 if meta["kivi"] == "True" else 3, meta, dtype))
            values.append(self._decode(tensors, f"b{b}.v", shape, 3, meta, dtype))
        return SessionKV(tokens, meta["text"], torch.cat(keys, 1), torch.cat(values, 1))

    def _check(self, path, meta, tensors, tenant, session_id) -> None:
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise StoreError(f"{path.name}: format version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
        if meta.get("checksum") != _checksum(tensors, {k: v for k, v in meta.items() if k != "checksum"}):
            raise StoreError(f"{path.name}: checksum mismatch (corrupted file)")
        if json.loads(meta["spec"]) != asdict(self.spec):
            raise StoreError(f"{path.name}: written for another model or cache layout ({meta['spec']})")
        if meta["session_id"] != session_id or meta["tenant"] != (tenant or ""):
            raise StoreError(f"{path.name}: belongs to another session")

    def _decode(self, tensors, prefix, shape, axis, meta, dtype) -> torch.Tensor:
        if meta["quant"] == "bf16":
            return tensors[prefix].to(dtype)
        q = Quantized(tensors[f"{prefix}.codes"], tensors[f"{prefix}.scales"], tensors[f"{prefix}.biases"],
                      shape, BITS[meta["quant"]], axis, GROUP)  # fmt: skip
        return dequantize(q, dtype)


def _checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()
