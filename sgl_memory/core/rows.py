"""A prefill forward's rows, as the layers compute them, and the requests whose positions move.

KEEP recomputes a shrinking share of a request's placed memory rows layer by layer (keep/). A row
not recomputed at layer l+1 needs no hidden state after layer l: its KV at the later layers is the
placed KV, which the keep mechanism writes into the pool itself. Dropping the row from the hidden
states is where the time goes down: every later layer's projections, MLP and attention queries run
over fewer rows.

A forward packs the new tokens of its requests one after another (capture.ExtendRows). The layout
holds which of those rows the current layer computes. After each layer the mechanisms' droppers
(Mechanism.dropper: keep) say which rows the next layer still needs; the engine (engine/layers.py) cuts the layer's
output and residual to them and, before each layer, the positions and the KV write locations.

Only the attention backend that reads the layout (`supports_row_layout`, our CPU backend) can attend
a request whose rows are not contiguous; on any other backend nothing is dropped: the droppers fall
back to writing the placed KV over the rows they do not need (the same attention, at full cost). A
row that another capture subscriber reads (from its `first_read` position on: intent's query span,
SentenceKV's window, a probe's scoring rows) is not dropped either, and that subscriber takes the
request's rows by position.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from sgl_memory.core import capture
from sgl_memory.core.capture import ExtendRows


class RowLayout:
    """The rows of one extend forward that the current layer computes."""

    def __init__(self, rows: list[ExtendRows]):
        self.full = rows  # every request's rows as the forward packed them
        self.total = sum(r.count for r in rows)
        self.kept = torch.ones(self.total, dtype=torch.bool)
        self.index: torch.Tensor | None = None  # the kept rows (None: all of them)
        self.version = 0
        self.rows = rows  # what current() returns, recomputed only when the layout changes

    def current(self) -> list[ExtendRows]:
        """Each request's rows at the current layer: where they start among the kept rows, how many,
        and their positions when some of them were dropped."""
        return self.rows

    def _rows(self) -> list[ExtendRows]:
        out, start = [], 0
        for r in self.full:
            kept = self.kept[r.start : r.start + r.count]
            n = int(kept.sum())
            positions = None if n == r.count else r.prefix + kept.nonzero().squeeze(1)
            out.append(r._replace(start=start, count=n, positions=positions))
            start += n
        return out

    def cut(self, kept: torch.Tensor) -> torch.Tensor:
        """Keep only `kept` [total] of the rows from now on; returns which of the current rows stay."""
        stay = kept[self.kept] if self.index is not None else kept
        self.kept = kept
        self.index = kept.nonzero().squeeze(1) if not bool(kept.all()) else None
        self.version += 1
        self.rows = self._rows()
        return stay


class RowDropper(Protocol):
    """What a mechanism that stops later layers computing some prefill rows provides
    (Mechanism.dropper): after each layer, the rows no later layer computes."""

    def dropped(self, rows: list[ExtendRows], layer_id: int) -> dict[str, torch.Tensor]:
        """After layer `layer_id`, per request id: the positions of its rows (among `rows`, this
        layer's) that no later layer computes; requests not named keep their rows."""


def layout(forward_batch: Any) -> RowLayout | None:
    return capture.ROW_LAYOUT.get(forward_batch)
