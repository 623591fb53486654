"""The on-disk session KV store: one safetensors file per (tenant, session, model).

A session's KV (keys and values of every layer along its token path) is cut into fixed-size blocks,
the unit the later KV-memory retrieval shares; each block holds its layers stacked, quantized
(quant.py) or as bf16 / fp32 values. One file per session keeps a turn's write a single atomic rename and a restore
a single read; the file's metadata carries what a loader must check before trusting it: format
version, model id and config hash, the cache spec, session and tenant, token ids, the rendered
prompt text, quantization, its generation, and a sha256 over every tensor and the metadata itself.

File names are hashes of the ids, so no id can name a path outside the store directory.

Several servers may share one store (replicas behind a router, one taking over another's sessions).
A reader needs no lock: a file is written under a temporary name and renamed over the old one, and
a reader takes the whole file in one read of one open file, so it sees the old file or the new one
(safetensors' own reader opens the path a second time to map its data: a rename between the two
opens gave it one file's header and the other's bytes). Writers of one session are ordered by its generation: a
writer says which generation its record continues, and the rename happens under an exclusive lock
on the session's directory only if the file is still at that generation (compare-and-swap). So a
session's file is one linear history: two servers that both continue generation 5 cannot both
store a generation 6; the second is refused (WriteConflict) and must re-read the session.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save_file

from sgl_memory.core.sessions import digest63
from sgl_memory.persist.quant import BITS, GROUP, RAW, Quantized, dequantize, quantize

FORMAT_VERSION = 1


class StoreError(RuntimeError):
    """A file that must not be loaded; the message says why."""


class WriteConflict(StoreError):
    """The session's file moved on since the generation a write continues: another server wrote it."""


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
    shard: str = "tp0/1"  # a tensor-parallel rank holds its own KV heads, in its own file


# The namespace of a path written before files recorded it: restored into any (the old behaviour).
ANY_NAMESPACE = "\x00any"


@dataclass
class SessionRecord:
    """A session's token path and its KV in stored (encoded) form, one dict of tensors per block of
    `block_size` tokens: the form both the file and the host-memory (warm) tier hold.

    A path is found in the radix tree by its key, which is more than its tokens: the namespace
    (`extra_key`: tenant, client key, KV-memory assembly) and, for a pruned path, the branch ids at
    its branch positions (intent/paths.py); `live` marks the positions that hold KV
    (a pruned one's stored KV is the sentinel's zeros). `state` holds the other mechanisms' state of
    the session (the tree's export_session), restored with it."""

    token_ids: list[int]
    text: str
    blocks: list[dict[str, torch.Tensor]]
    quant: str
    kivi: bool
    block_size: int
    extra_key: str | None = None
    branches: tuple[tuple[int, int], ...] = ()  # (position, key id), ascending
    live: torch.Tensor | None = None  # [len(token_ids)] bool; None: every position is live
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    # name -> "k" or "v": the state tensors that hold KV ([layers, tokens, heads, dim]) and are
    # stored in the record's quantization like its blocks; the rest are stored exactly
    state_kv: dict[str, str] = field(default_factory=dict)
    generation: int = 0  # of the file it was read from or last written to; 0: never stored

    def nbytes(self) -> int:
        tensors = [t for block in self.blocks for t in block.values()] + list(self.state.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def history_digest(self) -> int:
        """What every tensor-parallel rank's file of one stored turn shares (each holds its own
        heads' KV): the path's tokens, namespace, branches and live mask, and the state's names,
        shapes and integer tensors (counters, token ids; the floating ones are the rank's heads).
        63 bits, so a rank_range can compare it."""
        parts = [array("q", self.token_ids).tobytes(), json.dumps([self.extra_key, self.branches]).encode()]
        if self.live is not None:
            parts.append(self.live.to(torch.uint8).numpy().tobytes())
        for name in sorted(self.state):
            t = self.state[name]
            parts.append(f"{name}{list(t.shape)}".encode())
            if not t.is_floating_point():
                parts.append(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return digest63(*parts)


def _alive(tmp_name: str) -> bool:
    pid = tmp_name[1:].split("-", 1)[0]
    if not tmp_name.startswith("w") or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:40]


class SessionFiles:
    def __init__(self, root: str | os.PathLike, spec: CacheSpec, quant: str = "q4", kivi: bool = False, block_size: int = 256):
        self.root = Path(root).expanduser()
        self.spec, self.quant, self.kivi, self.block_size = spec, quant, kivi, block_size
        self.removed_partial = self._remove_partial_writes()
        self.disk_bytes = 0  # of the session files, as of the last enforce_quota

    def _remove_partial_writes(self) -> int:
        """Temporary files of writers that died before their rename: never loadable, only space.
        A temporary file is named after its writer's pid; a live writer's (another server sharing
        the store) is left alone."""
        stale = [t for t in self.root.glob("*/*/*.tmp") if not _alive(t.name)] if self.root.exists() else []
        for tmp in stale:
            tmp.unlink(missing_ok=True)
        return len(stale)

    def enforce_quota(self, quota_bytes: int) -> list[Path]:
        """Delete least recently used session files until the store fits in quota_bytes."""
        files = []
        for path in self.root.glob("*/*/*.safetensors"):
            try:
                files.append((path.stat(), path))
            except FileNotFoundError:  # another server sharing the store removed it meanwhile
                pass
        files.sort(key=lambda f: f[0].st_mtime)
        total = sum(stat.st_size for stat, _ in files)
        removed = []
        while files and total > quota_bytes:
            stat, oldest = files.pop(0)
            total -= stat.st_size
            oldest.unlink(missing_ok=True)
            removed.append(oldest)
        self.disk_bytes = total
        return removed

    def path(self, tenant: str | None, session_id: str) -> Path:
        model = _digest(self.spec.model_id, self.spec.config_hash, self.spec.shard)
        return self.root / _digest("tenant", tenant or "") / model / f"{_digest('session', session_id)}.safetensors"

    # --- encoding ------------------------------------------------------------------------------

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Blocks of [layers, tokens, kv_heads, head_dim] KV that starts at a block boundary."""
        blocks = []
        for start in range(0, keys.shape[1], self.block_size):
            stop = start + self.block_size
            block = self._encode("k", keys[:, start:stop], 1 if self.kivi else -1)
            block.update(self._encode("v", values[:, start:stop], -1))
            blocks.append(block)
        return blocks

    def record(self, token_ids: list[int], text: str, keys: torch.Tensor, values: torch.Tensor) -> SessionRecord:
        return SessionRecord(list(token_ids), text, self.encode(keys, values), self.quant, self.kivi, self.block_size)

    def _encode(self, name: str, x: torch.Tensor, axis: int) -> dict[str, torch.Tensor]:
        if self.quant in RAW:
            return {name: x.to(RAW[self.quant]).contiguous()}
        q = quantize(x, BITS[self.quant], axis=axis)
        return {f"{name}.codes": q.codes.contiguous(), f"{name}.scales": q.scales.contiguous(),
                f"{name}.biases": q.biases.contiguous()}  # fmt: skip

    def decode(self, record: SessionRecord, start: int = 0, stop: int | None = None,
               dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Keys and values [layers, stop - start, kv_heads, head_dim] of tokens start .. stop - 1;
        only the blocks that hold them are dequantized."""
        n = len(record.token_ids)
        stop = n if stop is None else stop
        size = record.block_size
        first, last = start // size, -(-stop // size)
        # every block is decoded straight into one buffer (no per-block tensors to concatenate)
        shape = (self.spec.layers, min(last * size, n) - first * size, self.spec.kv_heads, self.spec.head_dim)
        keys, values = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        for b in range(first, last):
            at, length = (b - first) * size, min(size, n - b * size)
            part = (*shape[:1], length, *shape[2:])
            self._decode(record.blocks[b], "k", part, 1 if record.kivi else 3, record.quant, dtype, keys[:, at : at + length])
            self._decode(record.blocks[b], "v", part, 3, record.quant, dtype, values[:, at : at + length])
        cut = slice(start - first * size, stop - first * size)
        return keys[:, cut], values[:, cut]

    def _decode(self, block, name, shape, axis, quant, dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        if quant in RAW:
            return block[name].to(dtype) if out is None else out.copy_(block[name])
        q = Quantized(block[f"{name}.codes"], block[f"{name}.scales"], block[f"{name}.biases"],
                      shape, BITS[quant], axis, GROUP)  # fmt: skip
        return dequantize(q, dtype, out)

    def generation(self, tenant: str | None, session_id: str) -> int:
        """The generation of the session's file: 0 when it has none, -1 when it cannot be read.
        Reads the file's header only."""
        return _generation(self.path(tenant, session_id))

    # --- write -----------------------------------------------------------------------------------

    def write(self, tenant: str | None, session_id: str, record: SessionRecord, base: int | None = None) -> Path:
        """Store the record as the session's file. `base`: the generation the record continues (0:
        the session had no file); if another writer stored a different one since, nothing is
        written and WriteConflict says so. None: replace whatever is there. A file that is missing
        (removed for the quota) or unreadable never blocks a write. The record's `generation`
        becomes the new file's."""
        path = self.path(tenant, session_id)
        generation = (base if base is not None else max(0, _generation(path))) + 1
        tensors = {"token_ids": torch.tensor(record.token_ids, dtype=torch.int64)}
        for b, block in enumerate(record.blocks):
            tensors.update({f"b{b}.{name}": t for name, t in block.items()})
        if record.live is not None:
            tensors["live"] = record.live.to(torch.uint8)
        layout = {}
        for name, t in record.state.items():
            kind = record.state_kv.get(name)
            if kind is None or record.quant in RAW:  # unquantized: KV state stored as held (memory keys are float32)
                tensors[f"s.{name}"] = t.contiguous()
                continue
            axis = 1 if kind == "k" and record.kivi else 3
            encoded = self._encode(kind, t, axis)
            tensors.update({f"q.{name}.{part.split('.', 1)[1]}": x for part, x in encoded.items()})
            layout[name] = {"kind": kind, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "axis": axis}
        meta = {
            "format_version": str(FORMAT_VERSION), "tenant": tenant or "", "session_id": session_id,
            "spec": json.dumps(asdict(self.spec)), "quant": record.quant, "kivi": str(record.kivi),
            "block_size": str(record.block_size), "tokens": str(len(record.token_ids)), "text": record.text,
            "extra_key": json.dumps(record.extra_key), "branches": json.dumps(record.branches), "state_kv": json.dumps(layout),
            "generation": str(generation),
        }  # fmt: skip
        meta["checksum"] = _checksum(tensors, meta)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"w{os.getpid()}-", suffix=".tmp")
        os.close(fd)
        try:
            try:
                save_file(tensors, tmp, metadata=meta)
            except SafetensorError as exc:  # how safetensors reports a failed write (ENOSPC, EFBIG, ...)
                raise OSError(str(exc)) from exc
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            # the lock covers the check and the rename only (the slow part, writing, is done); it
            # is the directory's, so there is no lock file to leave behind, and the kernel drops it
            # with a writer that dies holding it
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX)
                current = _generation(path)
                if base is not None and current > 0 and current != base:
                    raise WriteConflict(f"{path.name}: another server stored generation {current} of the session; "
                                        f"this write continues generation {base}")  # fmt: skip
                os.replace(tmp, path)  # readers see the old file or the new one, never a torn one
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        record.generation = generation
        return path

    # --- read ------------------------------------------------------------------------------------

    def read(self, tenant: str | None, session_id: str) -> SessionRecord | None:
        """The session's record, or None when it has no file; StoreError when the file must not be used."""
        path = self.path(tenant, session_id)
        try:
            data = path.read_bytes()
            meta, tensors = _metadata(data), load_tensors(data)
        except FileNotFoundError:
            return None  # never written, or removed (the quota, also another server's sharing the store)
        except Exception as exc:  # truncated or not a safetensors file at all
            raise StoreError(f"{path.name}: unreadable ({exc})") from None
        self._check(path, meta, tensors, tenant, session_id)
        os.utime(path)  # a read is a use: quota eviction is least recently used
        blocks: dict[int, dict[str, torch.Tensor]] = {}
        state, encoded = {}, {}
        for name, t in tensors.items():
            if name.startswith("s."):
                state[name[2:]] = t
            elif name.startswith("q."):
                owner, part = name[2:].rsplit(".", 1)
                encoded.setdefault(owner, {})[part] = t
            elif name not in ("token_ids", "live"):
                b, rest = name.split(".", 1)
                blocks.setdefault(int(b[1:]), {})[rest] = t
        for name, spec in json.loads(meta.get("state_kv", "{}")).items():
            parts = {f"{spec['kind']}.{part}": t for part, t in encoded[name].items()}
            state[name] = self._decode(parts, spec["kind"], tuple(spec["shape"]), spec["axis"], meta["quant"],
                                       getattr(torch, spec["dtype"]))  # fmt: skip
        # a file written before pruned paths carried one branch per event names one [position, id]
        # (its id is not this version's: the path is matched up to that position only)
        legacy = json.loads(meta.get("branch", "null"))
        branches = tuple(map(tuple, json.loads(meta["branches"]))) if "branches" in meta else ((tuple(legacy),) if legacy else ())
        live = tensors["live"].to(torch.bool) if "live" in tensors else None
        return SessionRecord(tensors["token_ids"].tolist(), meta["text"], [blocks[b] for b in sorted(blocks)],
                             meta["quant"], meta["kivi"] == "True", int(meta["block_size"]),
                             json.loads(meta["extra_key"]) if "extra_key" in meta else ANY_NAMESPACE,
                             branches, live, state, generation=int(meta.get("generation", "0")))  # fmt: skip

    def _check(self, path, meta, tensors, tenant, session_id) -> None:
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise StoreError(f"{path.name}: format version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
        if meta.get("checksum") != _checksum(tensors, {k: v for k, v in meta.items() if k != "checksum"}):
            raise StoreError(f"{path.name}: checksum mismatch (corrupted file)")
        written = json.loads(meta["spec"])
        if written != asdict(self.spec) and dict(written, dtype=self.spec.dtype) == asdict(self.spec):
            # the launcher picks the dtype from the CPU: the same store on another CPU meets this
            raise StoreError(f"{path.name}: written by a {written['dtype']} KV pool, this server's is {self.spec.dtype} "
                             f"(start it with --dtype {written['dtype']} to restore the session)")  # fmt: skip
        if written != asdict(self.spec):
            raise StoreError(f"{path.name}: written for another model or cache layout ({meta['spec']})")
        if meta["session_id"] != session_id or meta["tenant"] != (tenant or ""):
            raise StoreError(f"{path.name}: belongs to another session")


MAX_HEADER = 100 << 20  # a header longer than this is a damaged length field, not a header


def _metadata(data: bytes) -> dict[str, str]:
    """The metadata of a safetensors file's bytes (or of its first bytes, if they hold the header)."""
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER or len(data) < 8 + n:
        raise ValueError(f"a header of {n} bytes in {len(data)} bytes")
    return json.loads(data[8 : 8 + n]).get("__metadata__") or {}


def read_metadata(path: Path) -> dict[str, str]:
    """A session file's metadata, from its header alone, in one open (see the module's docstring)."""
    with open(path, "rb") as f:
        head = f.read(8)
        return _metadata(head + f.read(min(int.from_bytes(head, "little"), MAX_HEADER + 1)))


def _generation(path: Path) -> int:
    try:
        return int(read_metadata(path).get("generation", "0"))  # a file from before generations: 0
    except FileNotFoundError:
        return 0
    except Exception:  # truncated, foreign or not a safetensors file: read() refuses it with the reason
        return -1


def _checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy())  # hashed in place, no copy
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()
