"""The on-disk session KV store: per (tenant, session, model) a head file and the chunk files it names.

A session's KV (keys and values of every layer along its token path) is cut into fixed-size blocks,
the unit the later KV-memory retrieval shares; each block holds its layers stacked, quantized
(quant.py) or as bf16 / fp32 values. The blocks lie in chunk files (safetensors), each a run of
blocks written once and never changed; the head file (safetensors) holds the rest and is replaced
by each turn's write with a single atomic rename. Its metadata carries what a loader must check
before trusting it: format version, model id and config hash, the cache spec, session and tenant,
token ids, the rendered prompt text, quantization, its generation, the chunks (name, first block,
blocks, sha256), and a sha256 over every tensor of the head and the metadata itself.

A turn writes the blocks its path changed or added as a new chunk, and a head that names it after
the chunks it keeps; a later chunk's blocks stand for an earlier one's. So a turn's write follows
its new tokens, not the session's history (a 16k-token history in Q8 is 100 MB: rewritten and
hashed every turn, it cost more than the turn's own prefill). Chunks merge like a binary counter (a
new chunk takes in the last one while it would be at least as large): a session of n blocks has
about log2(n) chunks, and a block is rewritten about log2(n) times over the session's life. A head
of format 1 (before chunks) holds its blocks itself and reads as before.

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

FORMAT_VERSION = 2  # 2: blocks in chunk files; 1: blocks in the head (still read)
READABLE_VERSIONS = ("1", "2")
CHUNK_SUFFIX = ".chunk"
READ_ATTEMPTS = 3  # a head replaced between reading it and its chunks is read again


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


@dataclass(frozen=True)
class Chunk:
    """A chunk file of a session: blocks first .. first + count - 1, and the file's sha256."""

    name: str
    first: int
    count: int
    digest: str


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
    # the chunks of that file, and the first block they do not hold as the record has it (blocks
    # from there are written by the next write)
    chunks: tuple[Chunk, ...] = ()
    dirty: int = 0

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
    def __init__(
        self, root: str | os.PathLike, spec: CacheSpec, quant: str = "q4", kivi: bool = False, block_size: int = 256
    ):
        self.root = Path(root).expanduser()
        self.spec, self.quant, self.kivi, self.block_size = spec, quant, kivi, block_size
        self.removed_partial = self._remove_partial_writes()
        self.disk_bytes = 0  # of the session files, as of the last enforce_quota

    def _remove_partial_writes(self) -> int:
        """Temporary files and chunks of writers that died before their head's rename: never
        loadable, only space. Both are named after their writer's pid; a live writer's (another
        server sharing the store) are left alone, and so is every chunk a head names."""
        if not self.root.exists():
            return 0
        stale = [t for t in self.root.glob("*/*/*.tmp") if not _alive(t.name)]
        named = set()
        for head in self.root.glob("*/*/*.safetensors"):
            try:
                named.update(c.name for c in _chunks(read_metadata(head)))
            except Exception:  # unreadable: read() refuses it with the reason; its chunks stay
                named.update(p.name for p in _chunk_files(head))
        stale += [
            c
            for c in self.root.glob(f"*/*/*{CHUNK_SUFFIX}")
            if c.name not in named and not _alive(c.name.split(".", 1)[1])
        ]
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale)

    def enforce_quota(self, quota_bytes: int) -> list[Path]:
        """Delete least recently used sessions (a head and its chunks) until the store fits in
        quota_bytes. Returns the heads removed."""
        sessions: dict[Path, list] = {}  # head path -> [head stat, bytes of its files]
        for path in self.root.glob("*/*/*"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another server sharing the store removed it meanwhile
                continue
            head = path.parent / (path.name.split(".", 1)[0] + ".safetensors")
            entry = sessions.setdefault(head, [None, 0])
            entry[1] += stat.st_size
            if path == head:
                entry[0] = stat
        total = sum(size for _, size in sessions.values())
        # a chunk without its head (a writer between the two, or one that died) is not a session
        files = sorted(
            ((stat, size, head) for head, (stat, size) in sessions.items() if stat is not None),
            key=lambda f: f[0].st_mtime,
        )
        removed = []
        while files and total > quota_bytes:
            _, size, oldest = files.pop(0)
            total -= size
            self._remove(oldest)
            removed.append(oldest)
        self.disk_bytes = total
        return removed

    def _remove(self, head: Path) -> None:
        for path in [head, *_chunk_files(head)]:
            path.unlink(missing_ok=True)

    def files(self, tenant: str | None, session_id: str) -> list[Path]:
        """The session's files on disk: its head (first, whether or not it exists) and its chunk files."""
        head = self.path(tenant, session_id)
        return [head, *_chunk_files(head)]

    def size(self, tenant: str | None, session_id: str) -> int:
        """Bytes on disk of the session: its head and its chunk files."""
        total = 0
        for path in self.files(tenant, session_id):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total

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

    def continued(
        self,
        previous: SessionRecord | None,
        token_ids: list[int],
        start: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        **key,
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

    def _encode(self, name: str, x: torch.Tensor, axis: int) -> dict[str, torch.Tensor]:
        if self.quant in RAW:
            return {name: x.to(RAW[self.quant]).contiguous()}
        q = quantize(x, BITS[self.quant], axis=axis)
        return {
            f"{name}.codes": q.codes.contiguous(),
            f"{name}.scales": q.scales.contiguous(),
            f"{name}.biases": q.biases.contiguous(),
        }

    def decode(
        self, record: SessionRecord, start: int = 0, stop: int | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
            self._decode(
                record.blocks[b], "k", part, 1 if record.kivi else 3, record.quant, dtype, keys[:, at : at + length]
            )
            self._decode(record.blocks[b], "v", part, 3, record.quant, dtype, values[:, at : at + length])
        cut = slice(start - first * size, stop - first * size)
        return keys[:, cut], values[:, cut]

    def _decode(self, block, name, shape, axis, quant, dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        if quant in RAW:
            return block[name].to(dtype) if out is None else out.copy_(block[name])
        q = Quantized(
            block[f"{name}.codes"], block[f"{name}.scales"], block[f"{name}.biases"], shape, BITS[quant], axis, GROUP
        )
        return dequantize(q, dtype, out)

    def generation(self, tenant: str | None, session_id: str) -> int:
        """The generation of the session's file: 0 when it has none, -1 when it cannot be read.
        Reads the file's header only."""
        return _generation(_head_metadata(self.path(tenant, session_id)))

    # --- write -----------------------------------------------------------------------------------

    def write(self, tenant: str | None, session_id: str, record: SessionRecord, base: int | None = None) -> Path:
        """Store the record as the session's head and chunks: the blocks from `record.dirty` on go
        into a new chunk (with the chunks it takes in), the rest stay in the chunks the record
        names. `base`: the generation the record continues (0: the session had no file); if
        another writer stored a different one since, nothing is written and WriteConflict says so.
        None: replace whatever is there (and write every block). A file that is missing (removed
        for the quota) or unreadable never blocks a write. The record's `generation`, `chunks` and
        `dirty` become the new head's."""
        path = self.path(tenant, session_id)
        generation = (base if base is not None else max(0, _generation(_head_metadata(path)))) + 1
        n = len(record.blocks)
        start = min(record.dirty, n) if base is not None else 0
        kept = [c for c in record.chunks if c.first < start]  # a chunk from `start` on is superseded
        if start and (not kept or kept[0].first or any(not (path.parent / c.name).exists() for c in kept)):
            start, kept = 0, []  # blocks before `start` in no chunk: a format-1 head's, or removed (the quota)
        # binary merging: the new chunk takes in the last kept one while it is at least as large
        while kept and n - start >= start - kept[-1].first:
            start = kept.pop().first
        path.parent.mkdir(parents=True, exist_ok=True)
        written = []
        try:
            if start < n:
                written.append(self._write_chunk(path, generation, record.blocks, start, n))
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
                encoded = self._encode(kind, t, axis)
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
            meta["checksum"] = _checksum(tensors, meta)
            replaced = self._replace(path, tensors, meta, base)
        except BaseException:
            for chunk in written:
                (path.parent / chunk.name).unlink(missing_ok=True)
            raise
        named = {c.name for c in chunks}
        for name in replaced - named:  # the replaced head's chunks the new one does not name
            (path.parent / name).unlink(missing_ok=True)
        record.generation, record.chunks, record.dirty = generation, chunks, n
        return path

    def _write_chunk(
        self, head: Path, generation: int, blocks: list[dict[str, torch.Tensor]], first: int, stop: int
    ) -> Chunk:
        """Blocks first .. stop - 1 as a chunk file of the session, named after this writer."""
        tensors = {f"b{b}.{name}": t for b in range(first, stop) for name, t in blocks[b].items()}
        meta = {"format_version": str(FORMAT_VERSION), "first": str(first), "count": str(stop - first)}
        meta["checksum"] = _checksum(tensors, meta)
        name = f"{head.stem}.w{os.getpid()}-{generation}-{os.urandom(4).hex()}{CHUNK_SUFFIX}"
        os.replace(self._save(head.parent, tensors, meta), head.parent / name)  # a name no other writer has
        return Chunk(name, first, stop - first, meta["checksum"])

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
                old = _head_metadata(path)  # unreadable: replaced; its chunks cannot be told from others'
                current = _generation(old)
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
        return {c.name for c in _chunks(old)} if old else set()

    # --- read ------------------------------------------------------------------------------------

    def read(self, tenant: str | None, session_id: str) -> SessionRecord | None:
        """The session's record, or None when it has no file; StoreError when the file must not be used."""
        path = self.path(tenant, session_id)
        for attempt in range(READ_ATTEMPTS):
            try:
                data = path.read_bytes()
                meta, tensors = _metadata(data), load_tensors(data)
            except FileNotFoundError:
                return None  # never written, or removed (the quota, also another server's sharing the store)
            except Exception as exc:  # truncated or not a safetensors file at all
                raise StoreError(f"{path.name}: unreadable ({exc})") from None
            self._check(path, meta, tensors, tenant, session_id)
            chunks = _chunks(meta)
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
            state[name] = self._decode(
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
                chunk_meta, chunk_tensors = _metadata(data), load_tensors(data)
            except Exception as exc:
                raise StoreError(f"{path.name}: its chunk {chunk.name} is unreadable ({exc})") from None
            if chunk_meta.get("checksum") != chunk.digest or chunk.digest != _checksum(
                chunk_tensors, {k: v for k, v in chunk_meta.items() if k != "checksum"}
            ):
                raise StoreError(f"{path.name}: checksum mismatch in its chunk {chunk.name} (corrupted file)")
            _add_blocks(blocks, chunk_tensors)
        if any(b not in blocks for b in range(count)):
            raise StoreError(f"{path.name}: blocks of its path are missing")
        return [blocks[b] for b in range(count)]

    def _check(self, path, meta, tensors, tenant, session_id) -> None:
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise StoreError(
                f"{path.name}: format version {meta.get('format_version')!r}, expected one of {READABLE_VERSIONS}"
            )
        if meta.get("checksum") != _checksum(tensors, {k: v for k, v in meta.items() if k != "checksum"}):
            raise StoreError(f"{path.name}: checksum mismatch (corrupted file)")
        written = json.loads(meta["spec"])
        if written != asdict(self.spec) and dict(written, dtype=self.spec.dtype) == asdict(self.spec):
            # the launcher picks the dtype from the CPU: the same store on another CPU meets this
            raise StoreError(
                f"{path.name}: written by a {written['dtype']} KV pool, this server's is {self.spec.dtype} "
                f"(start it with --dtype {written['dtype']} to restore the session)"
            )
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


def _chunks(meta: dict[str, str]) -> tuple[Chunk, ...]:
    return tuple(Chunk(*c) for c in json.loads(meta.get("chunks", "[]")))


def _add_blocks(blocks: dict[int, dict[str, torch.Tensor]], tensors: dict[str, torch.Tensor]) -> None:
    """Tensors named b<block>.<part> into blocks by their block; a later call's block replaces."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith("b") and name[1 : name.find(".")].isdigit():
            b, rest = name.split(".", 1)
            found.setdefault(int(b[1:]), {})[rest] = t
    blocks.update(found)


def _head_metadata(path: Path) -> dict[str, str] | None:
    """A head's metadata: {} when there is none, None when it cannot be read (truncated, foreign or
    not a safetensors file: read() refuses it with the reason)."""
    try:
        return read_metadata(path)
    except FileNotFoundError:
        return {}
    except Exception:
        return None


def _generation(meta: dict[str, str] | None) -> int:
    """0: no head, or one from before generations; -1: an unreadable one."""
    return -1 if meta is None else int(meta.get("generation", "0"))


def _chunk_files(head: Path) -> list[Path]:
    """The chunk files on disk of the session whose head is `head` (named or not by it)."""
    return list(head.parent.glob(f"{head.stem}.*{CHUNK_SUFFIX}"))


def _checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy())  # hashed in place, no copy
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()
