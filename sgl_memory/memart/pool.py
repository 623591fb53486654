"""A session's memory pool: one per (tenant, session), its turns as KV blocks that retrieval scores and places."""

from __future__ import annotations

import threading
import time

import torch

from sgl_memory.core.rope import Rope
from sgl_memory.memart import pool_io
from sgl_memory.memart.blocks import Block, BlockIndex
from sgl_memory.memart.entries import ALONE, EntryBook
from sgl_memory.memart.eviction import Eviction
from sgl_memory.memart.inbox import Inbox
from sgl_memory.memart.runs import BlockRuns
from sgl_memory.memart.storage import BlockStore


class MemArtPool:
    """One session's memory, composed of one object per job: its block storage with the index's
    rows (`store`, storage.py), its eviction policy (`evictor`, eviction.py), the inbox of turns
    not added yet (`inbox`, inbox.py), the lookups of blocks that go together (`runs`, runs.py),
    and its entries (`book`, entries.py); export and load are pool_io.py's. One lock guards the
    blocks, the inbox and the counters: the pool's methods take it where their callers do not."""

    def __init__(
        self,
        capacity: int,
        eviction: str = "lru",
        block_size: int = 16,
        rope: Rope | None = None,
        score_layers: int | None = None,
        norm_ties: bool = True,
        line_ends: frozenset[int] | None = None,
        book: EntryBook | None = None,
    ):
        self.lock = threading.Lock()
        self.store = BlockStore(rope, score_layers, line_ends)
        self.evictor = Eviction(self.store, capacity, eviction, block_size, norm_ties)
        self.inbox = Inbox(self.lock)
        self.runs = BlockRuns(self.store)
        self.book = book if book is not None else EntryBook(threshold=ALONE, static_after=1)
        self.path: list[int] = []  # the last full-history request's KV path

    @property
    def blocks(self) -> dict[int, Block]:
        return self.store.blocks

    @property
    def turns(self) -> int:
        return self.store.turns

    @property
    def tokens(self) -> int:
        return self.store.tokens

    @property
    def bytes(self) -> int:
        return self.store.bytes

    @property
    def line_ends(self) -> frozenset[int] | None:
        return self.store.line_ends

    @line_ends.setter
    def line_ends(self, ends: frozenset[int] | None) -> None:
        self.store.line_ends = ends

    # --- turns in: submitted, then ingested in order ----------------------------------------------

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
        self.inbox.submit((tokens, positions, keys, values, tag))

    def ingest(self, block_size: int) -> None:
        """Add every submitted turn, in order. The memory worker calls this, and so does a
        retrieval of the session before it reads the pool: waiting for the turn the worker is
        adding, then adding the rest itself, so no retrieval ever runs without a turn that finished
        before it, however slow the worker is."""
        self.inbox.ingest(
            lambda tokens, positions, keys, values, tag: self.add_turn(tokens, keys, values, block_size, tag, positions)
        )

    def busy(self) -> bool:
        return self.inbox.busy()

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
        free = self.store.free_keys(keys, positions)  # the slow part, outside the lock
        with self.lock:
            turn = self.store.add_turn(tokens, keys, values, positions, free, block_size, now)
            if tag is not None:
                stays, replaced = self.book.arrived(tag, turn)
                self.store.drop_turns(replaced if stays else {turn})
            self.evictor.fit()

    def drop_turns(self, turns: set[int]) -> None:
        """Remove every block holding a token of these turns (BlockStore.drop_turns). Caller holds the lock."""
        self.store.drop_turns(turns)

    def trim(self, max_bytes: int) -> None:
        """Evict blocks (by the pool's policy) until its blocks take at most max_bytes."""
        with self.lock:
            self.evictor.evict(lambda: self.store.bytes > max_bytes)

    # --- retrieval's reads ---------------------------------------------------------------------

    def index(self) -> BlockIndex:
        """The scoring view of the blocks retrieval may choose: those of no turn the book hides."""
        with self.lock:
            return self.store.index(self.book.hidden_turns)

    def transcript(self) -> list[tuple[int, list[int]]]:
        """The token ids it holds of each turn retrieval may choose, in turn order (text mode reads
        them, memart/text.py): what eviction or a merge left of a turn, in the turn's own order."""
        with self.lock:
            blocks = [self.store.blocks[i] for i in self.store.index(self.book.hidden_turns).ids]
        held: dict[int, list[tuple[int, int]]] = {}
        for block in blocks:
            for token, (turn, offset) in zip(block.tokens, block.origin):
                held.setdefault(turn, []).append((offset, token))
        return [(turn, [t for _, t in sorted(held[turn])]) for turn in sorted(held)]

    def take(self, ids: list[int]) -> list[Block]:
        """The blocks of these ids in chronological order, marked as used now."""
        with self.lock:
            return self.store.take(ids)

    def unit(self, block_id: int, units: dict[int, tuple]) -> list[int]:
        return self.runs.unit(block_id, units)

    def segments(self, blocks: list[Block], units: dict[int, tuple], lines: bool = False) -> list[int]:
        return self.runs.segments(blocks, units, lines)

    def first_of(self, block_id: int, scope: str) -> int | None:
        return self.runs.first_of(block_id, scope)

    def line(self, block_id: int) -> list[int]:
        return self.runs.line(block_id)

    # --- the session store's ---------------------------------------------------------------------

    def export(self) -> dict[str, torch.Tensor]:
        return pool_io.export(self)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        pool_io.load(self, tensors)
