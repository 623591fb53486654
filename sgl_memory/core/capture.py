"""One tap on the attention layers' inputs during prefill, which mechanisms subscribe to
(Mechanism.subscriber).

Intent pruning reads the post-RoPE query rows of its requests' prompts (QueryMemory, SnapKV's
window); KV memory reads a probe prompt's queries, keys and values. Both need them as every
attention layer receives them, whatever the backend, so the engine's one hook on the attention
layers (engine/hooks.py) hands each extend forward and the composition's subscribers to `feed`,
which passes it to those that have a request in it.

The batch packs the new tokens of its requests one after another: request i's query, key and value
rows start where request i-1's end, and its first new token sits at position prefix_len (what the
radix tree already held); `extend_rows` says where each request's rows are. When a layer computes
only some rows of a request (rows.py), its rows carry their positions.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from sgl_memory.core.side_tables import SideTable


class ExtendRows(NamedTuple):
    """Where one request's rows sit in an extend forward's packed q / k / v, and the positions they hold."""

    rid: str
    start: int  # first row of the request in the batch's q / k / v
    prefix: int  # position of that row (the request's first new token)
    count: int  # type: ignore[assignment]  # a field named as tuple's method: rows of the request here
    pool_row: int = -1  # the request's row of the slot map (req_to_token)
    # the rows' positions when a layer computes only some of them (rows.py); None: prefix..prefix+count-1
    positions: torch.Tensor | None = None

    def row_positions(self) -> torch.Tensor:
        """The position of each row, on the host."""
        return (
            self.positions.cpu() if self.positions is not None else torch.arange(self.prefix, self.prefix + self.count)
        )


def extend_rows(forward_batch: Any) -> list[ExtendRows]:
    prefix_lens = forward_batch.extend_prefix_lens_cpu or forward_batch.extend_prefix_lens.tolist()
    new_lens = forward_batch.extend_seq_lens_cpu or forward_batch.extend_seq_lens.tolist()
    pool_rows = forward_batch.req_pool_indices.tolist()
    rows, start = [], 0
    for rid, prefix, n, pool_row in zip(forward_batch.rids, prefix_lens, new_lens, pool_rows):
        rows.append(ExtendRows(rid, start, prefix, n, pool_row))
        start += n
    return rows


class Subscriber(Protocol):
    """What a mechanism that reads the attention layers' prefill inputs provides
    (Mechanism.subscriber): which requests of a forward it takes, and each layer's rows of them."""

    def capturing(self) -> bool:
        """Whether any request is waiting for rows now (checked on every layer call: keep it cheap)."""

    def bind(self, rows: list[ExtendRows]) -> list:
        """The parts of this forward's requests this subscriber takes, once per forward; empty: none.
        Each part is a pair whose second item is the request's ExtendRows."""

    def first_read(self, part: list[Any]) -> int | None:
        """The first prompt position of its request that `part` reads: a row dropper (rows.py) may
        drop the request's rows before it and leave the rest to this subscriber, which then receives
        the rows with their positions. None: it reads every row, so none of the request's is dropped."""

    def take(self, bound: list[Any], layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """One attention layer's inputs of the requests `bind` chose."""


class QueryCapture:
    """Post-RoPE query rows of one request's prompt, as the attention layers receive them:
    the sum over the actionable span (for its mean) and the last `window` rows, per layer."""

    def __init__(self, span_start: int, length: int, window: int):
        self.span_start, self.length = span_start, length
        self.window_start = max(0, length - window) if window else length
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}
        self.windows: dict[int, torch.Tensor] = {}

    def add(self, layer: int, q: torch.Tensor, first_pos: int) -> None:
        """q: [n, heads, head_dim] for positions first_pos .. first_pos + n - 1 of this request."""
        n = q.shape[0]
        lo = max(self.span_start, first_pos) - first_pos
        if lo < n:
            rows = q[lo:].float().sum(0)
            self.sums[layer] = self.sums[layer] + rows if layer in self.sums else rows
            self.counts[layer] = self.counts.get(layer, 0) + (n - lo)
        w_lo = max(self.window_start, first_pos) - first_pos
        if w_lo < n and self.window_start < self.length:
            buf = self.windows.get(layer)
            if buf is None:
                buf = self.windows[layer] = torch.zeros(self.length - self.window_start, *q.shape[1:])
            start = first_pos + w_lo - self.window_start
            buf[start : start + n - w_lo] = q[w_lo:].float()

    def add_rows(self, layer: Any, q: torch.Tensor, r: ExtendRows) -> None:
        """A subscriber's `take`: this request's rows `r` of an attention layer's packed query `q`.
        Where a dropper left only some of the request's rows (`r.positions`), the rows from the first
        one this capture reads on are contiguous (first_read kept them): they are added from there."""
        rows = q[r.start : r.start + r.count].reshape(r.count, layer.tp_q_head_num, layer.qk_head_dim)
        first = r.prefix
        if r.positions is not None:
            positions = r.row_positions()
            kept = (positions >= self.first_read()).nonzero().squeeze(1)
            if kept.numel() == 0:
                return
            lo = int(kept[0])
            rows, first = rows[lo:], int(positions[lo])
        self.add(layer.layer_id, rows, first)

    def first_read(self) -> int:
        """The first prompt position this capture reads (the actionable span or the window)."""
        return min(self.span_start, self.window_start)

    def q_mean(self) -> torch.Tensor | None:
        if not self.sums:
            return None
        return torch.stack([self.sums[i] / self.counts[i] for i in sorted(self.sums)])

    def q_window(self) -> torch.Tensor:
        return torch.stack([self.windows[i] for i in sorted(self.windows)]) if self.windows else torch.zeros(0)


# per forward batch: the row layout rows.py made (the rows the layers compute, once rows are
# dropped), and each subscriber's binding of the rows, made once per layout version
ROW_LAYOUT: SideTable = SideTable("row layout")
BOUND: SideTable[tuple[int, list]] = SideTable("capture bindings")


def feed(
    subscribers: list[Subscriber], layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: Any
) -> None:
    """One attention layer's inputs of a forward: each subscriber's rows of an extend forward."""
    if not forward_batch.rids or forward_batch.forward_mode.is_decode():
        return None  # decode steps, every layer of every token: nothing to capture
    layout = ROW_LAYOUT.get(forward_batch)  # rows.py: the rows this layer computes
    version = layout.version if layout is not None else 0
    held = BOUND.get(forward_batch)
    if held is None or held[0] != version:  # once per forward and row layout
        active = [s for s in subscribers if s.capturing()]
        rows = (layout.current() if layout is not None else extend_rows(forward_batch)) if active else []
        held = BOUND.set(forward_batch, (version, [(s, s.bind(rows)) for s in active]))
    bound = held[1]
    for subscriber, parts in bound:
        if parts:
            subscriber.take(parts, layer, q, k, v)
    return None


def write_trace(
    directory: str, rid: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> Path:
    """What a mechanism captured for one request, written for offline use (the pruner head's
    training rows, KEEP's checks against a full prefill): `<directory>/<rid>.safetensors`, the rid
    made a safe file name."""
    from safetensors.torch import save_file

    out = Path(directory).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    path = out / (re.sub(r"[^A-Za-z0-9._-]", "_", str(rid)) + ".safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path
