"""A session's memory pool: its finished turns as KV blocks with position-free keys and AABBs.

Keys are stored with their rotary rotation removed (the rotation of position p inverted exactly in
float64, kept as float32), so a block can be placed at any position later (MemArt 3.2.3); values
carry no position and stay in the pool's dtype. Each block keeps its tokens, its turn and the wall
time it was made, and the per-layer, per-KV-head bounding box of its keys (the AABB index).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass
class Block:
    id: int  # chronological: blocks are made in turn order, ids never reused
    tokens: list[int]
    keys: torch.Tensor  # [L, n, Hkv, D] float32, position-free
    values: torch.Tensor  # [L, n, Hkv, D] pool dtype
    lo: torch.Tensor  # [L, Hkv, D] element-wise min of keys
    hi: torch.Tensor  # [L, Hkv, D] element-wise max
    turn: int
    offset: int  # of its first token within its turn's stored tokens
    made: float  # wall time
    used: int  # the pool's retrieval counter when last retrieved (or made)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.lo, self.hi))


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


# which block a full pool drops (or, with `merge`, folds into its neighbour) first: smallest key
EVICTIONS = {
    "lru": lambda b: (b.used, b.id),  # least recently retrieved, the oldest among equals
    "fifo": lambda b: b.id,
    # least recently retrieved first, folded into the neighbouring block of its turn: the two keep
    # one block's worth of their tokens, those of the largest keys (see MemArtPool._merge_one)
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
    inbox: deque = field(default_factory=deque)  # submitted turns not added yet, oldest first
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards blocks, inbox, counters
    ingesting: threading.Lock = field(default_factory=threading.Lock)  # one ingest at a time: turns stay in order
    _index: BlockIndex | None = None

    def submit(self, tokens: list[int], positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A finished turn's KV as copied off the KV pool (keys still rotated), for ingest()."""
        with self.lock:
            self.inbox.append((tokens, positions, keys, values))

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
                    tokens, positions, keys, values = self.inbox.popleft()
                try:
                    self.add_turn(tokens, unrotate(keys, positions), values, block_size)
                except Exception:  # one bad turn must not stop the session's others
                    logger.exception("memory: adding a turn failed")

    def busy(self) -> bool:
        return bool(self.inbox) or self.ingesting.locked()

    def add_turn(self, tokens: list[int], keys: torch.Tensor, values: torch.Tensor, block_size: int) -> None:
        """Cut one turn's position-free KV [L, n, Hkv, D] into blocks (the last may be shorter)."""
        now = time.time()
        n = len(tokens)
        count = -(-n // block_size)
        # one min/max over all blocks: the short last block is padded with copies of its own last key
        padded = torch.cat([keys, keys[:, -1:].expand(-1, count * block_size - n, -1, -1)], dim=1)
        boxes = padded.view(keys.shape[0], count, block_size, *keys.shape[2:])
        lo, hi = boxes.amin(dim=2), boxes.amax(dim=2)
        with self.lock:
            turn = self.turns
            self.turns += 1
            for i, start in enumerate(range(0, n, block_size)):
                end = start + block_size
                # clones: an evicted block's memory goes with it, not with the last block of its turn
                block = Block(self.next_id, tokens[start:end], keys[:, start:end].clone(), values[:, start:end].clone(),
                              lo[:, i].clone(), hi[:, i].clone(), turn, start, now, self.clock)  # fmt: skip
                self.blocks[block.id] = block
                self.bytes += block.nbytes()
                self.next_id += 1
            self._evict(lambda: len(self.blocks) > self.capacity)
            self._index = None

    def trim(self, max_bytes: int) -> None:
        """Evict blocks (by the pool's policy) until its blocks take at most max_bytes."""
        with self.lock:
            self._evict(lambda: self.bytes > max_bytes)

    def _evict(self, over) -> None:
        """Merge (policy `merge`), then drop blocks in eviction order while over(); caller holds the lock."""
        if not over():
            return
        if self.eviction == "merge":
            while over() and self._merge_one():
                pass
        if not over():
            self._index = None
            return
        for victim in sorted(self.blocks.values(), key=EVICTIONS[self.eviction]):
            del self.blocks[victim.id]
            self.bytes -= victim.nbytes()
            self.evicted += 1
            if not over():
                break
        self._index = None

    def _merge_one(self) -> bool:
        """Fold the least recently retrieved block that has a neighbour of its own turn (the block
        before or after it, the less recently retrieved of the two) into one block of at most
        `block_size` tokens: the tokens whose position-free keys have the largest norm, averaged over
        layers and heads (a larger key scores higher against any query of its direction), in their
        order. The pool then holds old, rarely recalled text at a lower density instead of losing
        it. False when no block has a neighbour to merge with."""
        order = list(self.blocks)
        at = {block_id: i for i, block_id in enumerate(order)}
        for block in sorted(self.blocks.values(), key=EVICTIONS["merge"]):
            i = at[block.id]
            near = [self.blocks[order[j]] for j in (i - 1, i + 1) if 0 <= j < len(order)]
            near = [b for b in near if b.turn == block.turn]
            if not near:
                continue
            other = min(near, key=EVICTIONS["merge"])
            first, second = (block, other) if block.id < other.id else (other, block)
            keys, values = torch.cat([first.keys, second.keys], 1), torch.cat([first.values, second.values], 1)
            tokens = first.tokens + second.tokens
            if len(tokens) > self.block_size:
                strength = keys.norm(dim=-1).mean(dim=(0, 2))
                keep = strength.topk(self.block_size).indices.sort().values
                keys, values, tokens = keys[:, keep], values[:, keep], [tokens[k] for k in keep.tolist()]
            merged = Block(first.id, tokens, keys.contiguous(), values.contiguous(), keys.amin(1), keys.amax(1),
                           first.turn, first.offset, min(first.made, second.made), max(first.used, second.used))  # fmt: skip
            self.bytes += merged.nbytes() - first.nbytes() - second.nbytes()
            del self.blocks[second.id]
            self.blocks[first.id] = merged  # an existing key keeps its place: chronological order holds
            self.merged += 1
            return True
        return False

    def index(self, layers: int, block_size: int) -> BlockIndex:
        """The scoring view of the first `layers` layers, rebuilt after the pool changes."""
        with self.lock:
            if self._index is None or self._index.layers != layers:
                self._index = BlockIndex.of(list(self.blocks.values()), layers, block_size)
            return self._index

    def export(self) -> dict[str, torch.Tensor]:
        """The pool as flat tensors (its blocks concatenated, per-block metadata alongside), exact:
        a pool loaded from them retrieves and places what this one would."""
        with self.lock:
            blocks = list(self.blocks.values())
            meta = torch.tensor([self.turns, self.clock, self.next_id, self.evicted, self.merged], dtype=torch.int64)
            path = torch.tensor(self.path, dtype=torch.int64)
            if not blocks:
                return {"meta": meta, "path": path}
            column = lambda name: torch.tensor([getattr(b, name) for b in blocks], dtype=torch.int64)  # noqa: E731
            return {
                "meta": meta, "path": path, "ids": column("id"), "turn": column("turn"), "offset": column("offset"),
                "used": column("used"), "made": torch.tensor([b.made for b in blocks], dtype=torch.float64),
                "lengths": torch.tensor([len(b.tokens) for b in blocks], dtype=torch.int64),
                "tokens": torch.tensor([t for b in blocks for t in b.tokens], dtype=torch.int64),
                "keys": torch.cat([b.keys for b in blocks], 1), "values": torch.cat([b.values for b in blocks], 1),
            }  # fmt: skip

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the state `export` gave (into an empty pool); the boxes are recomputed from the keys."""
        with self.lock:
            self.turns, self.clock, self.next_id, self.evicted, self.merged = (int(x) for x in tensors["meta"])
            self.path = tensors["path"].tolist()
            if "ids" not in tensors:
                return
            tokens, keys, values = tensors["tokens"].tolist(), tensors["keys"], tensors["values"]
            start = 0
            for i, n in enumerate(tensors["lengths"].tolist()):
                k = keys[:, start : start + n].clone()
                block = Block(int(tensors["ids"][i]), tokens[start : start + n], k, values[:, start : start + n].clone(),
                              k.amin(dim=1), k.amax(dim=1), int(tensors["turn"][i]), int(tensors["offset"][i]),
                              float(tensors["made"][i]), int(tensors["used"][i]))  # fmt: skip
                self.blocks[block.id] = block
                self.bytes += block.nbytes()
                start += n
            self._evict(lambda: len(self.blocks) > self.capacity)
            self._index = None

    def take(self, ids: list[int]) -> list[Block]:
        """The blocks of these ids in chronological order, marked as used now."""
        with self.lock:
            self.clock += 1
            chosen = [self.blocks[i] for i in sorted(ids) if i in self.blocks]
            for block in chosen:
                block.used = self.clock
            return chosen


