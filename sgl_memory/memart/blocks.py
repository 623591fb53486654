"""A session's memory as data: its finished turns as KV blocks, and the index that scores them.

A block keeps its keys as the KV pool held them (post-RoPE, the pool's dtype) with the position of
each, its values, its tokens and where each token came from (turn, offset in the turn), and the wall
time it was made. Placed at other positions (MemArt 3.2.3), its keys are rotated by the difference
(float64 math, one rounding into the pool's dtype); placed at their own positions they are the
cached keys bit for bit.

Retrieval compares queries and keys without positions, so the pool also keeps an index
(`ScoreKeys`): the keys of the scoring layers only, rotation removed (float64 math, rounded into the
pool's dtype), one row per stored token, appended per turn. A bf16 pool holds a token in
2 x 2 bytes (keys, values) per layer and KV head element, as SGLang's KV pool does, plus 2 bytes for
the index on the scoring layers (half of them by default): 1.25x the KV pool's bytes per token.
The rotation is removed where the index's rows are made (storage.py, BlockStore.free_keys) and
applied where blocks are placed (placement.assemble); a pool is pool.py's `MemArtPool`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Block:
    """One KV block of a session's memory: its tokens, their post-RoPE keys with the position of
    each, their values and where each token came from."""

    id: int  # chronological: blocks are made in turn order, ids never reused
    tokens: list[int]
    keys: torch.Tensor  # [L, n, Hkv, D] pool dtype, post-RoPE at `positions`
    values: torch.Tensor  # [L, n, Hkv, D] pool dtype
    positions: torch.Tensor  # [n] int32: where each key was computed
    origin: list[tuple[int, int]]  # per token: (turn, offset within its turn's stored tokens)
    made: float  # wall time
    used: int  # the pool's retrieval counter when last retrieved (or made)
    covers: int  # tokens of the turns it stands for: len(tokens), or more once merged
    row: int = 0  # its first row in the pool's ScoreKeys (its rows are consecutive)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions))

    def turns(self) -> set[int]:
        return {turn for turn, _ in self.origin}

    def spans(self) -> list[list[int]]:
        """[turn, offset, tokens] per run of consecutive tokens of one turn: one run unless merged."""
        runs: list[list[int]] = []
        for turn, offset in self.origin:
            if runs and runs[-1][0] == turn and runs[-1][1] + runs[-1][2] == offset:
                runs[-1][2] += 1
            else:
                runs.append([turn, offset, 1])
        return runs


class ScoreKeys:
    """The index's keys: [layers, rows, Hkv, D] position-free keys of the scoring layers, one row per
    stored token, in the pool's dtype. A turn's rows are appended (the buffer grows by an eighth of
    its rows at least, so appending stays amortised O(turn)); a removed block's rows stay until an
    eighth of the rows are dead, then the live ones are copied into a buffer of their own size.
    Neither writes a row a scoring view may read: growth and repacking make new buffers, appends
    write past the rows any view was taken with."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.used = 0  # rows written
        self.dead = 0  # rows of removed blocks

    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def append(self, free: torch.Tensor) -> int:
        """Rows for these keys [layers, n, Hkv, D]; returns the first."""
        n = free.shape[1]
        if self.buffer is None or self.used + n > self.buffer.shape[1]:
            grown = free.new_empty(free.shape[0], self.used + max(n, self.used // 8), *free.shape[2:])
            if self.used:
                grown[:, : self.used] = self.buffer[:, : self.used]
            self.buffer = grown
        self.buffer[:, self.used : self.used + n] = free
        self.used += n
        return self.used - n

    def rows(self, block: Block) -> torch.Tensor:
        return self.buffer[:, block.row : block.row + len(block.tokens)]

    def repack(self, blocks: list[Block]) -> None:
        """Keep the rows of these blocks only (their `row` moves), in a buffer of exactly their size."""
        if not blocks:
            self.buffer, self.used, self.dead = None, 0, 0
            return
        self.buffer = torch.cat([self.rows(b) for b in blocks], 1)
        at = 0
        for block in blocks:
            block.row, at = at, at + len(block.tokens)
        self.used, self.dead = at, 0


@dataclass
class BlockIndex:
    """A scoring view of a pool: its visible blocks' ids in chronological order, the index's keys
    [layers, rows, Hkv, D] and each block's rows [N, S] (S its longest block; a short block repeats
    its last row, which changes neither its box nor its best key)."""

    ids: list[int]
    keys: torch.Tensor
    rows: torch.Tensor
    _boxes: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, blocks: list[Block], score: ScoreKeys) -> BlockIndex:
        if not blocks:
            return cls([], torch.zeros(0, 0, 1, 1), torch.zeros(0, 1, dtype=torch.int64))
        starts = torch.tensor([b.row for b in blocks], dtype=torch.int64)
        lengths = torch.tensor([len(b.tokens) for b in blocks], dtype=torch.int64)
        steps = torch.arange(int(lengths.max()))
        rows = starts[:, None] + torch.minimum(steps[None], lengths[:, None] - 1)
        return cls([b.id for b in blocks], score.buffer, rows)

    def block_keys(self, n0: int = 0, n1: int | None = None) -> torch.Tensor:
        """The keys of blocks n0..n1, padded: [layers, n, S, Hkv, D]."""
        rows = self.rows[n0:n1]
        return self.keys[:, rows.flatten()].view(self.keys.shape[0], *rows.shape, *self.keys.shape[2:])

    def boxes(self, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """The AABB of each block's keys, lo and hi [layers, N, Hkv, D], computed once per view."""
        if self._boxes is None:
            lo = self.keys.new_empty(self.keys.shape[0], len(self.ids), *self.keys.shape[2:])
            hi = torch.empty_like(lo)
            for n0 in range(0, len(self.ids), chunk):  # a chunk's padded keys at a time
                part = self.block_keys(n0, n0 + chunk)
                lo[:, n0 : n0 + chunk], hi[:, n0 : n0 + chunk] = part.amin(2), part.amax(2)
            self._boxes = (lo, hi)
        return self._boxes


def pieces(tokens: list[int], block_size: int, line_ends: frozenset[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each block of a turn: block_size tokens at most, and ending after every
    token of `line_ends` when given."""
    out, start = [], 0
    for i, token in enumerate(tokens):
        if i + 1 - start == block_size or (line_ends is not None and token in line_ends):
            out.append((start, i + 1))
            start = i + 1
    if start < len(tokens):
        out.append((start, len(tokens)))
    return out
