"""A session pool's block storage: its blocks, the counters kept with them, and the index's rows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from sgl_memory.core.rope import Rope
from sgl_memory.memart.blocks import Block, BlockIndex, ScoreKeys, pieces


class BlockStore:
    """The blocks of one session's memory and what is kept in step with them: host bytes, tokens,
    token-id counts (for merging), the index's rows (`ScoreKeys`: a block's rows are its own keys
    through every add, removal and repacking) and the scoring view made from them. Block ids are
    chronological and never reused: a block replacing one of its id (a merge) takes its place. The
    caller holds the pool's lock."""

    def __init__(
        self, rope: Rope | None = None, score_layers: int | None = None, line_ends: frozenset[int] | None = None
    ):
        self.blocks: dict[int, Block] = {}  # insertion order is chronological order
        self.turns = 0
        self.clock = 0  # counts retrievals, for LRU
        self.next_id = 0
        self.rope = rope  # the model's; None: keys come position-free (at position 0)
        self.score_layers = score_layers  # the index's layers: the first ones (None: all)
        self.line_ends = line_ends  # token ids after which a block ends (memory.cut: lines)
        self.score = ScoreKeys()
        self.held = 0  # host memory of its blocks (the index's is score.nbytes())
        self.tokens = 0  # tokens its blocks hold
        self.counts: Counter = Counter()  # token id -> occurrences in its blocks (for merging)
        self._index: BlockIndex | None = None

    @property
    def bytes(self) -> int:
        """Host memory of the pool: its blocks and its index."""
        return self.held + self.score.nbytes()

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
        positions: torch.Tensor,
        free: torch.Tensor,
        block_size: int,
        made: float,
    ) -> int:
        """A turn's blocks (`free`: its index rows, free_keys of its keys); returns its turn number."""
        turn = self.turns
        self.turns += 1
        first = self.score.append(free)
        for start, end in pieces(tokens, block_size, self.line_ends):
            # clones: an evicted block's memory goes with it, not with the rest of its turn
            self.add(
                Block(
                    self.next_id,
                    tokens[start:end],
                    keys[:, start:end].clone(),
                    values[:, start:end].clone(),
                    positions[start:end].clone(),
                    [(turn, o) for o in range(start, end)],
                    made,
                    self.clock,
                    end - start,
                    first + start,
                )
            )
            self.next_id += 1
        return turn

    def drop_turns(self, turns: set[int]) -> None:
        """Remove every block holding a token of these turns (a merged block goes whole: a
        superseded fact must not be recalled)."""
        if turns:
            for block in [b for b in self.blocks.values() if not turns.isdisjoint(b.turns())]:
                self.remove(block)
        self._index = None  # the book changed what retrieval sees

    def add(self, block: Block) -> None:
        """A block replacing one of its id takes its place (dict order is chronological order)."""
        if block.id in self.blocks:
            self._forget(self.blocks[block.id])
        self.blocks[block.id] = block
        self.held += block.nbytes()
        self.tokens += len(block.tokens)
        self.counts.update(block.tokens)
        self._index = None

    def remove(self, block: Block) -> None:
        del self.blocks[block.id]
        self._forget(block)
        if self.score.dead * 8 > self.score.used:
            self.score.repack(list(self.blocks.values()))
        self._index = None

    def _forget(self, block: Block) -> None:
        self.held -= block.nbytes()
        self.tokens -= len(block.tokens)
        self.counts.subtract(block.tokens)
        self.score.dead += len(block.tokens)

    def take(self, ids: list[int]) -> list[Block]:
        """The blocks of these ids in chronological order, marked as used now."""
        self.clock += 1
        chosen = [self.blocks[i] for i in sorted(ids) if i in self.blocks]
        for block in chosen:
            block.used = self.clock
        return chosen

    def index(self, hidden_turns: Callable[[], set[int]]) -> BlockIndex:
        """The scoring view of the blocks retrieval may choose (those of no `hidden_turns()`), made
        again after the blocks change (its block rows only: the keys are the index's buffer)."""
        if self._index is None:
            hidden = hidden_turns()
            visible = (
                [b for b in self.blocks.values() if hidden.isdisjoint(b.turns())]
                if hidden
                else list(self.blocks.values())
            )
            self._index = BlockIndex.of(visible, self.score)
        return self._index
