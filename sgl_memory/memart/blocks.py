"""A session's memory pool: its finished turns as KV blocks, and the index that scores them.

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
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from sgl_memory.memart.entries import ALONE, EntryBook
from sgl_memory.core.rope import Rope

logger = logging.getLogger(__name__)


@dataclass
class Block:
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
    Neither writes a row a scoring view may read: growth and compaction make new buffers, appends
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

    def compact(self, blocks: list[Block]) -> None:
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


# which block a full pool drops first: smallest key. `merge` folds neighbours instead (see
# MemArtPool._merge_one) and drops by LRU only what merging cannot shrink (a single block left).
EVICTIONS = {
    "lru": lambda b: (b.used, b.id),  # least recently retrieved, the oldest among equals
    "fifo": lambda b: b.id,
    "merge": lambda b: (b.used, b.id),
}


@dataclass
class MemArtPool:
    capacity: int
    eviction: str = "lru"
    block_size: int = 16  # what a merged block holds at most
    blocks: dict[int, Block] = field(default_factory=dict)  # insertion order is chronological order
    path: list[int] = field(default_factory=list)  # the last full-history request's KV path
    turns: int = 0
    clock: int = 0  # counts retrievals, for LRU
    next_id: int = 0
    evicted: int = 0
    merged: int = 0  # blocks folded into a neighbour (eviction `merge`)
    rope: Rope | None = None  # the model's; None: keys come position-free (at position 0)
    score_layers: int | None = None  # the index's layers: the first ones (None: all)
    norm_ties: bool = True  # a merge breaks ties by key norm (off under tensor parallelism)
    score: ScoreKeys = field(default_factory=ScoreKeys)
    held: int = 0  # host memory of its blocks (the index's is score.nbytes())
    tokens: int = 0  # tokens its blocks hold
    counts: Counter = field(default_factory=Counter)  # token id -> occurrences in its blocks (for merging)
    inbox: deque = field(default_factory=deque)  # submitted turns not added yet, oldest first
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards blocks, inbox, counters
    ingesting: threading.Lock = field(default_factory=threading.Lock)  # one ingest at a time: turns stay in order
    _index: BlockIndex | None = None
    line_ends: frozenset[int] | None = None  # token ids after which a block ends (memory.cut: lines)
    book: EntryBook = field(default_factory=lambda: EntryBook(threshold=ALONE, static_after=1))  # entries.py

    @property
    def bytes(self) -> int:
        """Host memory of the pool: its blocks and its index."""
        return self.held + self.score.nbytes()

    def submit(
        self,
        tokens: list[int],
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tag: tuple | None = None,
    ) -> None:
        """A finished turn's KV as copied off the KV pool (keys rotated at `positions`), for
        ingest(); `tag`: the entry or group joint KV it holds (EntryBook)."""
        with self.lock:
            self.inbox.append((tokens, positions, keys, values, tag))

    def ingest(self, block_size: int) -> None:
        """Add every submitted turn, in order. The memory worker calls this, and so does a
        retrieval of the session before it reads the pool: waiting for the turn the worker is
        adding, then adding the rest itself, so no retrieval ever runs without a turn that finished
        before it, however slow the worker is."""
        with self.ingesting:
            while True:
                with self.lock:
                    if not self.inbox:
                        return
                    tokens, positions, keys, values, tag = self.inbox.popleft()
                try:
                    self.add_turn(tokens, keys, values, block_size, tag, positions)
                except Exception:  # one bad turn must not stop the session's others
                    logger.exception("memory: adding a turn failed")

    def busy(self) -> bool:
        return bool(self.inbox) or self.ingesting.locked()

    def free_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The index's rows of keys [L, n, Hkv, D] rotated at `positions`: the scoring layers'
        keys with the rotation removed (float64 math), in the keys' dtype."""
        keys = keys[: self.score_layers]
        if self.rope is not None:
            return self.rope.rotate_layers(keys, -positions)
        if positions.any():
            raise ValueError("a pool without the model's RoPE takes position-free keys only")
        return keys  # a view: append() and merges copy it

    def add_turn(
        self,
        tokens: list[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        block_size: int,
        tag: tuple | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Cut one turn's KV [L, n, Hkv, D] (keys rotated at `positions`; None: position-free,
        at 0) into blocks of `block_size` tokens (the last may be shorter); with `line_ends` (token
        ids that end a line), a block also ends after each of them, so that no block holds the end
        of one line and the start of the next. Keys are kept in the values' dtype, the pool's.
        A tagged turn (an entry, a group's joint KV) replaces the turn its tag had, or is dropped
        when a newer write made it stale."""
        now = time.time()
        keys = keys.to(values.dtype)
        positions = torch.zeros(len(tokens), dtype=torch.int32) if positions is None else positions.to(torch.int32)
        free = self.free_keys(keys, positions)  # the slow part, outside the lock
        with self.lock:
            turn = self.turns
            self.turns += 1
            first = self.score.append(free)
            for start, end in pieces(tokens, block_size, self.line_ends):
                # clones: an evicted block's memory goes with it, not with the rest of its turn
                self._add(
                    Block(
                        self.next_id,
                        tokens[start:end],
                        keys[:, start:end].clone(),
                        values[:, start:end].clone(),
                        positions[start:end].clone(),
                        [(turn, o) for o in range(start, end)],
                        now,
                        self.clock,
                        end - start,
                        first + start,
                    )
                )
                self.next_id += 1
            if tag is not None:
                stays, replaced = self.book.arrived(tag, turn)
                self.drop_turns(replaced if stays else {turn})
            self._evict(lambda: len(self.blocks) > self.capacity)

    def drop_turns(self, turns: set[int]) -> None:
        """Remove every block holding a token of these turns (a merged block goes whole: a
        superseded fact must not be recalled). Caller holds the lock."""
        if turns:
            for block in [b for b in self.blocks.values() if not turns.isdisjoint(b.turns())]:
                self._remove(block)
        self._index = None  # the book changed what retrieval sees

    def unit(self, block_id: int, units: dict[int, tuple]) -> list[int]:
        """The blocks placed together with this one: its whole turn when that turn is an entry or a
        group's joint KV (`units`: the book's unit_turns, read once per retrieval), else itself. A
        turn's blocks have consecutive ids."""
        block = self.blocks.get(block_id)
        if block is None or block.origin[0][0] not in units:
            return [block_id]
        turn = block.origin[0][0]
        first = last = block_id
        while first - 1 in self.blocks and self.blocks[first - 1].origin[-1][0] == turn:
            first -= 1
        while last + 1 in self.blocks and self.blocks[last + 1].origin[0][0] == turn:
            last += 1
        return list(range(first, last + 1))

    def segments(self, blocks: list[Block], units: dict[int, tuple], lines: bool = False) -> list[int]:
        """Token counts of the segments these placed blocks form, in order: an entry's or a static
        group's blocks are one segment (KEEP recomputes them together), and with `lines` (placed
        whole: memory.unit line) so is each line's run of blocks; any other block is its own."""
        out, last, before = [], None, None
        for block in blocks:
            unit = units.get(block.origin[0][0], ("block", block.id))
            grouped = unit == last and unit[0] != "block"
            same_line = lines and unit[0] == "block" and before is not None and self._continues(before, block)
            if grouped or same_line:
                out[-1] += len(block.tokens)
            else:
                out.append(len(block.tokens))
            last, before = unit, block
        return out

    def first_of(self, block_id: int, scope: str) -> int | None:
        """The id of the first block of the turn (`scope` "turn") or of the line ("line") that block
        `block_id` belongs to, walking back over the pool's blocks (a turn's blocks have consecutive
        ids); None where a block on the way was evicted or merged away."""
        block = self.blocks.get(block_id)
        if block is None or (scope == "line" and self.line_ends is None):
            return None  # lines are known where blocks were cut at them
        turn, offset = block.origin[0]
        while offset > 0:
            before = self.blocks.get(block_id - 1)
            if before is None or before.origin[-1] != (turn, offset - 1):
                return None
            if scope == "line" and before.tokens[-1] in self.line_ends:
                break
            block_id, offset = block_id - 1, before.origin[0][1]
        return block_id

    def line(self, block_id: int) -> list[int]:
        """The ids of the blocks of the line that block `block_id` belongs to, in order (where
        blocks are cut at lines: `line_ends`; elsewhere the block alone). Where a block of the line
        was evicted or merged away, the part of the line around this block that is still whole."""
        if block_id not in self.blocks or self.line_ends is None:
            return [block_id]
        first = last = block_id
        while first - 1 in self.blocks and self._continues(self.blocks[first - 1], self.blocks[first]):
            first -= 1
        while last + 1 in self.blocks and self._continues(self.blocks[last], self.blocks[last + 1]):
            last += 1
        return list(range(first, last + 1))

    def _continues(self, a: Block, b: Block) -> bool:
        """b goes on with a's line: it starts at the next token of a's turn and a ends no line
        (lines known: blocks cut at them)."""
        turn, offset = a.origin[-1]
        return self.line_ends is not None and b.origin[0] == (turn, offset + 1) and a.tokens[-1] not in self.line_ends

    def _add(self, block: Block) -> None:
        """Caller holds the lock. A block replacing one of its id takes its place (dict order is
        chronological order)."""
        if block.id in self.blocks:
            self._forget(self.blocks[block.id])
        self.blocks[block.id] = block
        self.held += block.nbytes()
        self.tokens += len(block.tokens)
        self.counts.update(block.tokens)
        self._index = None

    def _remove(self, block: Block) -> None:
        del self.blocks[block.id]
        self._forget(block)
        if self.score.dead * 8 > self.score.used:
            self.score.compact(list(self.blocks.values()))
        self._index = None

    def _forget(self, block: Block) -> None:
        self.held -= block.nbytes()
        self.tokens -= len(block.tokens)
        self.counts.subtract(block.tokens)
        self.score.dead += len(block.tokens)

    def trim(self, max_bytes: int) -> None:
        """Evict blocks (by the pool's policy) until its blocks take at most max_bytes."""
        with self.lock:
            self._evict(lambda: self.bytes > max_bytes)

    def _evict(self, over) -> None:
        """Merge (policy `merge`), then drop blocks in eviction order while over(); caller holds the lock."""
        if self.eviction == "merge":
            while over() and self._merge_one():
                pass
        if not over():
            return
        for victim in sorted(self.blocks.values(), key=EVICTIONS[self.eviction]):
            self._remove(victim)
            self.evicted += 1
            if not over():
                break

    def _merge_one(self) -> bool:
        """Fold two neighbouring blocks (chronological neighbours, of any turns) into one of at most
        `block_size` tokens; False when fewer than two blocks are left.

        Which two: those that together stand for the fewest tokens of the session (`covers`), the
        least recently retrieved among equals. Compression then spreads evenly, oldest first at each
        level, instead of one block absorbing the whole early history (folding the least recently
        retrieved block again and again did that: its merged self stays the least recent). Which
        tokens: the rarest in the pool (token ids counted over its blocks), the larger key norm
        among equals, kept in their order. Formatting and speaker names recur in every turn and go
        first; the words only one turn holds stay, and they are what a question about that turn
        matches (keeping the largest keys instead kept such recurring tokens: measured evidence
        recall 0.00 in bench/long_session.py)."""
        blocks = list(self.blocks.values())
        if len(blocks) < 2:
            return False
        i = min(
            range(len(blocks) - 1),
            key=lambda i: (blocks[i].covers + blocks[i + 1].covers, max(blocks[i].used, blocks[i + 1].used), i),
        )
        first, second = blocks[i], blocks[i + 1]
        keys, values = torch.cat([first.keys, second.keys], 1), torch.cat([first.values, second.values], 1)
        positions = torch.cat([first.positions, second.positions])
        free = torch.cat([self.score.rows(first), self.score.rows(second)], 1)
        tokens, origin = first.tokens + second.tokens, first.origin + second.origin
        if len(tokens) > self.block_size:
            # a rotation keeps the norm; a tensor-parallel rank holds its own heads' keys, whose
            # norms would make each rank keep other tokens: there the earlier token wins a tie
            strength = keys.float().norm(dim=-1).mean(dim=(0, 2)).tolist() if self.norm_ties else [0.0] * len(tokens)
            ranked = sorted(range(len(tokens)), key=lambda t: (self.counts[tokens[t]], -strength[t]))
            keep = sorted(ranked[: self.block_size])
            keys, values, positions, free = keys[:, keep], values[:, keep], positions[keep], free[:, keep]
            tokens, origin = [tokens[t] for t in keep], [origin[t] for t in keep]
        self._remove(second)
        row = self.score.append(free)  # after the removal: a compaction there moves rows, not these
        self._add(
            Block(
                first.id,
                tokens,
                keys.contiguous(),
                values.contiguous(),
                positions.contiguous(),
                origin,
                min(first.made, second.made),
                max(first.used, second.used),
                first.covers + second.covers,
                row,
            )
        )
        self.merged += 1
        return True

    def index(self) -> BlockIndex:
        """The scoring view of the blocks retrieval may choose, made again after the pool changes
        (its block rows only: the keys are the index's buffer)."""
        with self.lock:
            if self._index is None:
                hidden = self.book.hidden_turns()
                visible = (
                    [b for b in self.blocks.values() if hidden.isdisjoint(b.turns())]
                    if hidden
                    else list(self.blocks.values())
                )
                self._index = BlockIndex.of(visible, self.score)
            return self._index

    def export(self) -> dict[str, torch.Tensor]:
        """The pool as flat tensors (its blocks concatenated, per-block and per-token metadata
        alongside), exact: a pool loaded from them retrieves, places and merges what this one would."""
        with self.lock:
            blocks = list(self.blocks.values())
            meta = torch.tensor([self.turns, self.clock, self.next_id, self.evicted, self.merged], dtype=torch.int64)
            path = torch.tensor(self.path, dtype=torch.int64)
            book = self.book.export()
            if not blocks:
                return {"meta": meta, "path": path, **book}
            column = lambda name: torch.tensor([getattr(b, name) for b in blocks], dtype=torch.int64)  # noqa: E731
            return {
                "meta": meta,
                "path": path,
                "ids": column("id"),
                "used": column("used"),
                "covers": column("covers"),
                "made": torch.tensor([b.made for b in blocks], dtype=torch.float64),
                "lengths": torch.tensor([len(b.tokens) for b in blocks], dtype=torch.int64),
                "tokens": torch.tensor([t for b in blocks for t in b.tokens], dtype=torch.int64),
                "origin": torch.tensor([o for b in blocks for o in b.origin], dtype=torch.int64),
                "positions": torch.cat([b.positions for b in blocks]),
                "keys": torch.cat([b.keys for b in blocks], 1),
                "values": torch.cat([b.values for b in blocks], 1),
                **book,
            }

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the state `export` gave (into an empty pool); the index is computed from the keys.
        Files of earlier formats: without per-token origins, a turn and offset per block; without
        positions, keys stored position-free in float32 (the same keys at position 0)."""
        with self.lock:
            self.turns, self.clock, self.next_id, self.evicted, self.merged = (int(x) for x in tensors["meta"])
            self.path = tensors["path"].tolist()
            self.book.load(tensors)
            if "ids" not in tensors:
                return
            tokens, keys, values = tensors["tokens"].tolist(), tensors["keys"], tensors["values"]
            lengths = tensors["lengths"].tolist()
            if "origin" in tensors:
                origin = [tuple(o) for o in tensors["origin"].tolist()]
            else:
                origin = [
                    (turn, offset + j)
                    for turn, offset, n in zip(tensors["turn"].tolist(), tensors["offset"].tolist(), lengths)
                    for j in range(n)
                ]
            covers = tensors["covers"].tolist() if "covers" in tensors else lengths
            keys = keys.to(values.dtype)
            positions = (
                tensors["positions"].to(torch.int32)
                if "positions" in tensors
                else torch.zeros(len(tokens), dtype=torch.int32)
            )
            first = self.score.append(self.free_keys(keys, positions))
            start = 0
            for i, n in enumerate(lengths):
                self._add(
                    Block(
                        int(tensors["ids"][i]),
                        tokens[start : start + n],
                        keys[:, start : start + n].clone(),
                        values[:, start : start + n].clone(),
                        positions[start : start + n].clone(),
                        origin[start : start + n],
                        float(tensors["made"][i]),
                        int(tensors["used"][i]),
                        covers[i],
                        first + start,
                    )
                )
                start += n
            self._evict(lambda: len(self.blocks) > self.capacity)

    def take(self, ids: list[int]) -> list[Block]:
        """The blocks of these ids in chronological order, marked as used now."""
        with self.lock:
            self.clock += 1
            chosen = [self.blocks[i] for i in sorted(ids) if i in self.blocks]
            for block in chosen:
                block.used = self.clock
            return chosen
