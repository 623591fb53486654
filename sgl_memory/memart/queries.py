"""The query pass of a memory-mode request, scheduler side (probe.py sends it): what it leaves for
its request (the position-free queries of its scoring tokens, and the system message's KV when the
blocks go after it), how much of the prompt it computes, and which positions score."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sgl_memory.core import tree_fill
from sgl_memory.core.capture import ExtendRows
from sgl_memory.core.requests import RequestTable
from sgl_memory.core.rope import Rope
from sgl_memory.core.spans import RoleMarkers


@dataclass
class Probe:
    """What the probe pass of one prompt leaves for its request: the position-free queries of its
    scoring tokens, filled layer by layer as its prefill computes them, and, for a request that
    places its blocks after the system message, that message's KV (post-RoPE at its own
    positions, which it keeps), copied off the probe's row at its release."""

    owner: tuple[str, str]
    scoring: list[int]  # the prompt positions whose queries score the blocks
    layers: int  # the layers whose queries score the blocks (the first ones)
    length: int
    system_end: int  # [0, system_end) is the system message whose KV the request needs (0: none)
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [length - start, H, D]
    system_kv: tree_fill.PathKV | None = None
    prefilled: int = 0  # what the probe computed (its length less the tree's cached prefix), set at its release

    @property
    def start(self) -> int:
        return self.scoring[0]

    def add(self, layer: int, q, positions: torch.Tensor, rope: Rope) -> None:
        keep = positions >= self.start
        if layer < self.layers and bool(keep.any()):
            rows = self.rows.get(layer)
            if rows is None:
                rows = self.rows[layer] = torch.zeros(self.length - self.start, *q.shape[1:])
            rows[positions[keep] - self.start] = rope.rotate(q[keep].float(), -positions[keep]).float()

    def queries(self) -> torch.Tensor:
        picked = torch.tensor(self.scoring) - self.start
        return torch.stack([self.rows[i][picked] for i in sorted(self.rows)])  # [L, T, H, D]


def probe_end(ids: list[int], spans, mode: str, markers: RoleMarkers, tokenizer) -> int:
    """How much of the prompt the probe computes: the question's turn and the header line of the
    message that opens after it, where an ordinary prompt ends. A prompt that goes on (an assistant
    turn continued, or one a readonly request teacher-forces) is cut there; with `all` scoring
    every position scores, so nothing is cut."""
    if mode == "all" or tokenizer is None:
        return len(ids)
    after = next((i for i in range(spans.query_start + 1, len(ids)) if ids[i] == markers.opener), None)
    if after is None:
        return len(ids)
    return next((j + 1 for j in range(after + 1, len(ids)) if "\n" in tokenizer.decode([ids[j]])), len(ids))


def scoring_positions(ids: list[int], spans, mode: str, markers: RoleMarkers, tokenizer) -> list[int]:
    """The prompt positions whose queries score the blocks: every one (`all`); the last user turn
    (`query`); or its text (`text`): the turn without its chat markup (special tokens, the role
    name on a message opener's line, whitespace), which would match every block that holds markup,
    up to the next message (a prompt that continues an assistant turn, or a readonly request that
    scores one, retrieves for the question, not for the answer it holds)."""
    if mode == "all":
        return list(range(len(ids)))
    turn = list(range(spans.query_start, len(ids)))
    if mode == "query" or tokenizer is None:
        return turn or list(range(len(ids)))
    special = set(getattr(tokenizer, "all_special_ids", ()))
    text, header = [], False
    for i in turn:
        if ids[i] == markers.opener and i > spans.query_start:
            break  # the turn ends where the next message opens: an assistant turn's text is not the query
        piece = tokenizer.decode([ids[i]])
        if ids[i] == markers.opener:
            header = True  # the role name that follows runs to the end of its line
        elif header:
            header = "\n" not in piece
        elif ids[i] not in special and piece.strip():
            text.append(i)
    return text or turn or list(range(len(ids)))


class ProbeCapture:
    """The capture subscriber (core/capture.py) of the probes being prefilled: each probe's scoring
    rows, by position, at the layers that score."""

    def __init__(self, rope: Rope, probing: RequestTable[Probe]):
        self.rope = rope
        self.probing = probing  # each probe being prefilled, by its request's id

    def capturing(self) -> bool:
        return bool(self.probing)

    def bind(self, rows: list[ExtendRows]) -> list[tuple[Probe, ExtendRows]]:
        return [(probe, r) for r in rows if (probe := self.probing.get(r.rid)) is not None]

    def first_read(self, part) -> int:
        return part[0].start  # the probe's scoring rows, taken by position

    def take(self, bound, layer, q, k, v) -> None:
        for probe, r in bound:
            rows = slice(r.start, r.start + r.count)
            probe.add(
                layer.layer_id,
                q[rows].reshape(r.count, layer.tp_q_head_num, layer.qk_head_dim),
                r.row_positions(),
                self.rope,
            )
