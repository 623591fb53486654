"""What a full session pool gives up: blocks dropped by policy, or neighbouring blocks merged."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sgl_memory.memart.blocks import Block
from sgl_memory.memart.storage import BlockStore

# which block a full pool drops first: smallest key. `merge` folds neighbours instead (see
# Eviction.merge_one) and drops by LRU only what merging cannot shrink (a single block left).
EVICTIONS = {
    "lru": lambda b: (b.used, b.id),  # least recently retrieved, the oldest among equals
    "fifo": lambda b: b.id,
    "merge": lambda b: (b.used, b.id),
}


class Eviction:
    """A pool's eviction policy (memory.eviction) over its block storage: what goes when the pool
    holds more than `capacity` blocks or more bytes than it may, and the counts of what went. The
    caller holds the pool's lock."""

    def __init__(
        self, store: BlockStore, capacity: int, policy: str = "lru", block_size: int = 16, norm_ties: bool = True
    ):
        self.store = store
        self.capacity = capacity
        self.policy = policy
        self.block_size = block_size  # what a merged block holds at most
        self.norm_ties = norm_ties  # a merge breaks ties by key norm (off under tensor parallelism)
        self.evicted = 0
        self.merged = 0  # blocks folded into a neighbour (eviction `merge`)

    def fit(self) -> None:
        """Evict down to `capacity` blocks."""
        self.evict(lambda: len(self.store.blocks) > self.capacity)

    def evict(self, over: Callable[[], bool]) -> None:
        """Merge (policy `merge`), then drop blocks in eviction order while over()."""
        if self.policy == "merge":
            while over() and self.merge_one():
                pass
        if not over():
            return
        for victim in sorted(self.store.blocks.values(), key=EVICTIONS[self.policy]):
            self.store.remove(victim)
            self.evicted += 1
            if not over():
                break

    def merge_one(self) -> bool:
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
        store = self.store
        blocks = list(store.blocks.values())
        if len(blocks) < 2:
            return False
        i = min(
            range(len(blocks) - 1),
            key=lambda i: (blocks[i].covers + blocks[i + 1].covers, max(blocks[i].used, blocks[i + 1].used), i),
        )
        first, second = blocks[i], blocks[i + 1]
        keys, values = torch.cat([first.keys, second.keys], 1), torch.cat([first.values, second.values], 1)
        positions = torch.cat([first.positions, second.positions])
        free = torch.cat([store.score.rows(first), store.score.rows(second)], 1)
        tokens, origin = first.tokens + second.tokens, first.origin + second.origin
        if len(tokens) > self.block_size:
            # a rotation keeps the norm; a tensor-parallel rank holds its own heads' keys, whose
            # norms would make each rank keep other tokens: there the earlier token wins a tie
            strength = keys.float().norm(dim=-1).mean(dim=(0, 2)).tolist() if self.norm_ties else [0.0] * len(tokens)
            ranked = sorted(range(len(tokens)), key=lambda t: (store.counts[tokens[t]], -strength[t]))
            keep = sorted(ranked[: self.block_size])
            keys, values, positions, free = keys[:, keep], values[:, keep], positions[keep], free[:, keep]
            tokens, origin = [tokens[t] for t in keep], [origin[t] for t in keep]
        store.remove(second)
        row = store.score.append(free)  # after the removal: a repacking there moves rows, not these
        store.add(
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
