"""Which blocks a retrieval places, and their KV at the positions they are placed at."""

from __future__ import annotations

import torch

from sgl_memory.core.rope import Rope
from sgl_memory.memart.blocks import Block
from sgl_memory.memart.pool import MemArtPool


HEADER_SCOPES = {"none": (), "turn": ("turn",), "line": ("line",), "turn_line": ("turn", "line")}


def choose(memory: MemArtPool, ranked: list[int], header: str, budget: int | None, unit: str = "block") -> list[int]:
    """The block ids to place: each ranked block with the rest of its unit (an entry's or a static
    group's other blocks, MemArtPool.unit; with `unit` "line", the rest of its line, MemArtPool.line)
    and its header blocks (the first block of its turn and/or line, MemArtConfig.header: a block,
    what a turn's or line's start says, not the whole line) unless chosen already. What would pass
    `budget` (the tokens to place at most) is skipped, so a shorter one after it may still fit; a
    line longer than the whole budget goes as its block alone (a tool output on one line of
    thousands of tokens is still recalled by its best blocks)."""
    chosen, used, units = {}, 0, memory.book.unit_turns()
    for block_id in ranked:
        members = memory.unit(block_id, units)
        if unit == "line":
            line = [b for m in members for b in memory.line(m)]
            if budget is None or sum(len(memory.blocks[b].tokens) for b in line if b in memory.blocks) <= budget:
                members = line
        headers = [memory.first_of(block_id, scope) for scope in HEADER_SCOPES[header]]
        new = [
            b for b in dict.fromkeys([*members, *headers]) if b is not None and b not in chosen and b in memory.blocks
        ]
        n = sum(len(memory.blocks[b].tokens) for b in new)
        if budget is not None and used + n > budget:
            continue  # the request must still fit the context (and the placement budget)
        chosen.update(dict.fromkeys(new))
        used += n
    return list(chosen)


def assemble(blocks: list[Block], rope: Rope, at: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks in the given order at contiguous positions at..at+M-1: keys rotated from where they
    were computed to their new positions (float64 math, one rounding into the pool's dtype; a key
    placed where it was computed is the cached key bit for bit), values as stored; [L, M, Hkv, D] each."""
    keys = torch.cat([b.keys for b in blocks], dim=1)
    values = torch.cat([b.values for b in blocks], dim=1)
    moved = torch.arange(at, at + keys.shape[1]) - torch.cat([b.positions for b in blocks]).long()
    return rope.rotate_layers(keys, moved), values
