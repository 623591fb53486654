"""Which stored blocks go together: a turn placed whole, a line's run of blocks, a turn's or line's first block."""

from __future__ import annotations

from sgl_memory.memart.blocks import Block
from sgl_memory.memart.storage import BlockStore


class BlockRuns:
    """Lookups over a pool's blocks by where their tokens came from (turn, offset) and by the line
    ends they were cut at: what a retrieval places together with a chosen block, and the segments
    a repair recomputes. A turn's blocks have consecutive ids."""

    def __init__(self, store: BlockStore):
        self.store = store

    def unit(self, block_id: int, units: dict[int, tuple]) -> list[int]:
        """The blocks placed together with this one: its whole turn when that turn is an entry or a
        group's joint KV (`units`: the book's unit_turns, read once per retrieval), else itself."""
        blocks = self.store.blocks
        block = blocks.get(block_id)
        if block is None or block.origin[0][0] not in units:
            return [block_id]
        turn = block.origin[0][0]
        first = last = block_id
        while first - 1 in blocks and blocks[first - 1].origin[-1][0] == turn:
            first -= 1
        while last + 1 in blocks and blocks[last + 1].origin[0][0] == turn:
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
        `block_id` belongs to, walking back over the pool's blocks; None where a block on the way
        was evicted or merged away."""
        blocks, line_ends = self.store.blocks, self.store.line_ends
        block = blocks.get(block_id)
        if block is None or (scope == "line" and line_ends is None):
            return None  # lines are known where blocks were cut at them
        turn, offset = block.origin[0]
        while offset > 0:
            before = blocks.get(block_id - 1)
            if before is None or before.origin[-1] != (turn, offset - 1):
                return None
            if scope == "line" and before.tokens[-1] in line_ends:
                break
            block_id, offset = block_id - 1, before.origin[0][1]
        return block_id

    def line(self, block_id: int) -> list[int]:
        """The ids of the blocks of the line that block `block_id` belongs to, in order (where
        blocks are cut at lines: `line_ends`; elsewhere the block alone). Where a block of the line
        was evicted or merged away, the part of the line around this block that is still whole."""
        blocks = self.store.blocks
        if block_id not in blocks or self.store.line_ends is None:
            return [block_id]
        first = last = block_id
        while first - 1 in blocks and self._continues(blocks[first - 1], blocks[first]):
            first -= 1
        while last + 1 in blocks and self._continues(blocks[last], blocks[last + 1]):
            last += 1
        return list(range(first, last + 1))

    def _continues(self, a: Block, b: Block) -> bool:
        """b goes on with a's line: it starts at the next token of a's turn and a ends no line
        (lines known: blocks cut at them)."""
        turn, offset = a.origin[-1]
        line_ends = self.store.line_ends
        return line_ends is not None and b.origin[0] == (turn, offset + 1) and a.tokens[-1] not in line_ends
