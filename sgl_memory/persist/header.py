"""The metadata in the safetensors header of a session's files: read from a file's bytes or from
its header alone in one open, the chunks and the generation a head names, and the checksum a file
carries over its tensors and metadata.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from sgl_memory.persist.records import Chunk

FORMAT_VERSION = 2  # 2: blocks in chunk files; 1: blocks in the head (still read)
READABLE_VERSIONS = ("1", "2")
MAX_HEADER = 100 << 20  # a header longer than this is a damaged length field, not a header


def parse_metadata(data: bytes) -> dict[str, str]:
    """The metadata of a safetensors file's bytes (or of its first bytes, if they hold the header)."""
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER or len(data) < 8 + n:
        raise ValueError(f"a header of {n} bytes in {len(data)} bytes")
    return json.loads(data[8 : 8 + n]).get("__metadata__") or {}


def read_metadata(path: Path) -> dict[str, str]:
    """A session file's metadata, from its header alone, in one open (see store.py's docstring)."""
    with open(path, "rb") as f:
        head = f.read(8)
        return parse_metadata(head + f.read(min(int.from_bytes(head, "little"), MAX_HEADER + 1)))


def named_chunks(meta: dict[str, str]) -> tuple[Chunk, ...]:
    """The chunks a head's metadata names, in its order (none: a head of format 1)."""
    return tuple(Chunk(*c) for c in json.loads(meta.get("chunks", "[]")))


def head_metadata(path: Path) -> dict[str, str] | None:
    """A head's metadata: {} when there is none, None when it cannot be read (truncated, foreign or
    not a safetensors file: read() refuses it with the reason)."""
    try:
        return read_metadata(path)
    except FileNotFoundError:
        return {}
    except Exception:
        return None


def generation_of(meta: dict[str, str] | None) -> int:
    """0: no head, or one from before generations; -1: an unreadable one."""
    return -1 if meta is None else int(meta.get("generation", "0"))


def checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """The sha256 a file carries over its tensors (by name) and its metadata."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy())  # hashed in place, no copy
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()
