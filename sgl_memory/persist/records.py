"""The session store's record types: a session's record in stored form, the chunks that hold its
blocks, the cache spec a file must match, and the errors a file's read or write reports.

The files themselves, their format and how writers share them: store.py.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field

import torch

from sgl_memory.core.sessions import digest63


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
