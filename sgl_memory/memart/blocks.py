"""A session's memory pool: its finished turns as KV blocks with position-free keys and AABBs.

Keys are stored with their rotary rotation removed (the rotation of position p inverted exactly in
float64, kept as float32), so a block can be placed at any position later (MemArt 3.2.3); values
carry no position and stay in the pool's dtype. Each block keeps its tokens, where each token came
from (turn, offset in the turn), the wall time it was made, and the per-layer, per-KV-head bounding
box of its keys (the AABB index).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from sgl_memory.memart.entries import ALONE, EntryBook

logger = logging.getLogger(__name__)


@dataclass
class Block:
    id: int  # chronological: blocks are made in turn order, ids never reused
    tokens: list[int]
    keys: torch.Tensor  # [L, n, Hkv, D] float32, position-free
    values: torch.Tensor  # [L, n, Hkv, D] pool dtype
    lo: torch.Tensor  # [L, Hkv, D] element-wise min of keys
    hi: torch.Tensor  # [L, Hkv, D] element-wise max
    origin: list[tuple[int, int]]  # per token: (turn, offset within its turn's stored tokens)
    made: float  # wall time
    used: int  # the pool's retrieval counter when last retrieved (or made)
    covers: int  # tokens of the turns it stands for: len(tokens), or more once merged

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.lo, self.hi))

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


@dataclass
class BlockIndex:
    """A pool's blocks stacked for scoring: ids in chronological order, their AABBs lo, hi
    [L, N, Hkv, D], and their keys [L, N, block_size, Hkv, D] (a short block padded with copies of
    its own last key, which changes neither its box nor its best key)."""

    layers: int
    ids: list[int]
    lo: torch.Tensor
    hi: torch.Tensor
    keys: torch.Tensor

    @classmethod
    def of(cls, blocks: list[Block], layers: int, block_size: int) -> BlockIndex:
        if not blocks:
            return cls(layers, [], torch.zeros(0), torch.zeros(0), torch.zeros(0))
        padded = [b.keys[:layers] if len(b.tokens) == block_size else
                  torch.cat([b.keys[:layers], b.keys[:layers, -1:].expand(-1, block_size - len(b.tokens), -1, -1)], 1)
                  for b in blocks]  # fmt: skip
        return cls(layers, [b.id for b in blocks], torch.stack([b.lo[:layers] for b in blocks], 1),
                   torch.stack([b.hi[:layers] for b in blocks], 1), torch.stack(padded, 1))  # fmt: skip


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
    bytes: int = 0  # host memory of its blocks
    counts: Counter = field(default_factory=Counter)  # token id -> occurrences in its blocks (for merging)
    inbox: deque = field(default_factory=deque)  # submitted turns not added yet, oldest first
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards blocks, inbox, counters
    ingesting: threading.Lock = field(default_factory=threading.Lock)  # one ingest at a time: turns stay in order
    _index: BlockIndex | None = None
    line_ends: frozenset[int] | None = None  # token ids after which a block ends (memory.cut: lines)
    book: EntryBook = field(default_factory=lambda: EntryBook(threshold=ALONE, static_after=1))  # entries.py

    def submit(self, tokens: list[int], positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               tag: tuple | None = None) -> None:
        """A finished turn's KV as copied off the KV pool (keys still rotated), for ingest(); `tag`:
        the entry or group joint KV it holds (EntryBook)."""
        with self.lock:
            self.inbox.append((tokens, positions, keys, values, tag))

    def ingest(self, unrotate, block_size: int) -> None:
        """Add every submitted turn, in order; `unrotate(keys, positions)` makes keys position-free.
        The memory worker calls this, and so does a retrieval of the session before it reads the
        pool: waiting for the turn the worker is adding, then adding the rest itself, so no
        retrieval ever runs without a turn that finished before it, however slow the worker is."""
        with self.ingesting:
            while True:
                with self.lock:
                    if not self.inbox:
                        return
                    tokens, positions, keys, values, tag = self.inbox.popleft()
                try:
                    self.add_turn(tokens, unrotate(keys, positions), values, block_size, tag)
                except Exception:  # one bad turn must not stop the session's others
                    logger.exception("memory: adding a turn failed")

    def busy(self) -> bool:
        return bool(self.inbox) or self.ingesting.locked()

    def add_turn(self, tokens: list[int], keys: torch.Tensor, values: torch.Tensor, block_size: int,
                 tag: tuple | None = None) -> None:
        """Cut one turn's position-free KV [L, n, Hkv, D] into blocks of `block_size` tokens (the
        last may be shorter); with `line_ends` (token ids that end a line), a block also ends
        after each of them, so that no block holds the end of one line and the start of the next.
        A tagged turn (an entry, a group's joint KV) replaces the turn its tag had, or is dropped
        when a newer write made it stale."""
        now = time.time()
        with self.lock:
            turn = self.turns
            self.turns += 1
            for start, end in pieces(tokens, block_size, self.line_ends):
                # clones: an evicted block's memory goes with it, not with the rest of its turn
                k = keys[:, start:end].clone()
                self._add(Block(self.next_id, tokens[start:end], k, values[:, start:end].clone(), k.amin(1), k.amax(1),
                                [(turn, o) for o in range(start, end)], now, self.clock, end - start))  # fmt: skip
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
            old = self.blocks[block.id]
            self.bytes -= old.nbytes()
            self.counts.subtract(old.tokens)
        self.blocks[block.id] = block
        self.bytes += block.nbytes()
        self.counts.update(block.tokens)
        self._index = None

    def _remove(self, block: Block) -> None:
        del self.blocks[block.id]
        self.bytes -= block.nbytes()
        self.counts.subtract(block.tokens)
        self._index = None

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
        i = min(range(len(blocks) - 1),
                key=lambda i: (blocks[i].covers + blocks[i + 1].covers, max(blocks[i].used, blocks[i + 1].used), i))  # fmt: skip
        first, second = blocks[i], blocks[i + 1]
        keys, values = torch.cat([first.keys, second.keys], 1), torch.cat([first.values, second.values], 1)
        tokens, origin = first.tokens + second.tokens, first.origin + second.origin
        if len(tokens) > self.block_size:
            strength = keys.norm(dim=-1).mean(dim=(0, 2)).tolist()
            ranked = sorted(range(len(tokens)), key=lambda t: (self.counts[tokens[t]], -strength[t]))
            keep = sorted(ranked[: self.block_size])
            keys, values = keys[:, keep], values[:, keep]
            tokens, origin = [tokens[t] for t in keep], [origin[t] for t in keep]
        self._remove(second)
        self._add(Block(first.id, tokens, keys.contiguous(), values.contiguous(), keys.amin(1), keys.amax(1), origin,
                        min(first.made, second.made), max(first.used, second.used), first.covers + second.covers))  # fmt: skip
        self.merged += 1
        return True

    def index(self, layers: int, block_size: int) -> BlockIndex:
        """The scoring view of the first `layers` layers, rebuilt after the pool changes."""
        with self.lock:
            if self._index is None or self._index.layers != layers:
                hidden = self.book.hidden_turns()
                visible = [b for b in self.blocks.values() if hidden.isdisjoint(b.turns())] if hidden else list(self.blocks.values())
                self._index = BlockIndex.of(visible, layers, block_size)
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
                "meta": meta, "path": path, "ids": column("id"), "used": column("used"), "covers": column("covers"),
                "made": torch.tensor([b.made for b in blocks], dtype=torch.float64),
                "lengths": torch.tensor([len(b.tokens) for b in blocks], dtype=torch.int64),
                "tokens": torch.tensor([t for b in blocks for t in b.tokens], dtype=torch.int64),
                "origin": torch.tensor([o for b in blocks for o in b.origin], dtype=torch.int64),
                "keys": torch.cat([b.keys for b in blocks], 1), "values": torch.cat([b.values for b in blocks], 1),
                **book,
            }  # fmt: skip

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the state `export` gave (into an empty pool); the boxes are recomputed from the keys.
        A file written before blocks kept per-token origins has a turn and offset per block."""
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
                origin = [(turn, offset + j) for turn, offset, n in
                          zip(tensors["turn"].tolist(), tensors["offset"].tolist(), lengths) for j in range(n)]  # fmt: skip
            covers = tensors["covers"].tolist() if "covers" in tensors else lengths
            start = 0
            for i, n in enumerate(lengths):
                k = keys[:, start : start + n].clone()
                self._add(Block(int(tensors["ids"][i]), tokens[start : start + n], k, values[:, start : start + n].clone(),
                                k.amin(dim=1), k.amax(dim=1), origin[start : start + n], float(tensors["made"][i]),
                                int(tensors["used"][i]), covers[i]))  # fmt: skip
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


