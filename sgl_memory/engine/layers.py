"""Rows a prefill stops computing between decoder layers (core/rows.py): the AROUND hook on the
served models' decoder layers that applies a forward's row layout (patches/hooks.yaml).

After each layer the mechanisms' droppers (Mechanism.dropper) say which rows the next layer still needs; the hook cuts
the layer's output and residual to them through SGLang's residual stream (the hand-off it uses for
micro-batches), and before each layer it cuts the positions and the KV write locations to match.
After the last layer the rows come back to their places (zeros where dropped), so the final norm
and the logits see the batch they expect: the dropped rows are placed memory, never a request's
last token.
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.forward_context import get_attn_backend

from sgl_memory.core import capture
from sgl_memory.core.capture import extend_rows
from sgl_memory.core.rows import RowLayout, layout
from sgl_memory.engine import runtime


def _kept_from(forward_batch, droppers: list) -> dict[str, int] | None:
    """Per request, the first position no row may be dropped from: what the capture subscribers
    that are not droppers read of it (capture.Subscriber.first_read; 0 where one reads every row).
    None: no row of this forward may be dropped (the backend does not attend a row layout, or rows
    are in flight to other ranks)."""
    if not getattr(get_attn_backend(), "supports_row_layout", False):
        return None
    if getattr(forward_batch.residual_stream, "transport", None) is not None:
        return None  # rows in flight to other ranks
    kept: dict[str, int] = {}
    for subscriber, parts in (capture.BOUND.get(forward_batch) or (0, []))[1]:
        if subscriber in droppers:
            continue
        for part in parts:
            first = subscriber.first_read(part) if hasattr(subscriber, "first_read") else None
            rid = part[1].rid
            kept[rid] = min(kept.get(rid, first or 0), first or 0)
    return kept


def _restart(forward_batch, value: torch.Tensor, residual: torch.Tensor | None, update):
    from sglang.srt.layers.layer_boundary.residual.stream import ResidualStream

    handle, forward_batch.residual_stream = ResidualStream.from_handoff(value, residual, update)
    return handle


def _export(forward_batch, hidden):
    """The layer's output, its residual and the residual update still owed between them."""
    stream = forward_batch.residual_stream
    update = stream.pending.update if stream.pending is not None else None
    value, residual = stream.export(hidden)
    return value, residual, update


def _cut(forward_batch, hidden, stay: torch.Tensor):
    """The layer's output and residual, only the rows `stay`, as the stream the next layer reads."""
    value, residual, update = _export(forward_batch, hidden)
    stay = stay.to(value.device)
    return _restart(forward_batch, value[stay], None if residual is None else residual[stay], update)


def _restore(forward_batch, hidden, rows: RowLayout, kept: torch.Tensor):
    """The layer's output and residual back at their rows of the whole forward (zeros where
    dropped); `kept`: the rows the layer computed (rows.index)."""
    value, residual, update = _export(forward_batch, hidden)
    index = kept.to(value.device)

    def spread(x):
        if x is None:
            return None
        full = x.new_zeros(rows.total, *x.shape[1:])
        full[index] = x
        return full

    return _restart(forward_batch, spread(value), spread(residual), update)


def _last_layer() -> int | None:
    pool = getattr(get_attn_backend(), "token_to_kv_pool", None)  # rows are only dropped where it exists
    return None if pool is None else (getattr(pool, "start_layer", 0) or 0) + pool.layer_num - 1


def layer_hook(original, layer, positions, hidden_states, forward_batch, *args, **kwargs):
    """AROUND hook on a decoder layer's forward: the layer runs over the rows the layout keeps."""
    mode = forward_batch.forward_mode
    composed = runtime.composition()
    droppers = composed.droppers if composed is not None else ()
    if not droppers or not mode.is_extend() or not forward_batch.rids:
        return original(layer, positions, hidden_states, forward_batch, *args, **kwargs)
    layer_id = layer.self_attn.attn.layer_id
    rows = layout(forward_batch)
    if rows is None:
        if layer_id != 0:
            return original(layer, positions, hidden_states, forward_batch, *args, **kwargs)
        rows = capture.ROW_LAYOUT.set(forward_batch, RowLayout(extend_rows(forward_batch)))
    full_loc = forward_batch.out_cache_loc
    if rows.index is not None:
        positions = positions[rows.index.to(positions.device)]
        forward_batch.out_cache_loc = full_loc[rows.index.to(full_loc.device)]
    try:
        out = original(layer, positions, hidden_states, forward_batch, *args, **kwargs)
    finally:
        forward_batch.out_cache_loc = full_loc
    if layer_id == _last_layer():
        return out if rows.index is None else _restore(forward_batch, out, rows, rows.index)
    kept_from = _kept_from(forward_batch, droppers)
    if kept_from is None:
        return out
    kept = rows.kept.clone()
    for dropper in droppers:
        for rid, dropped in dropper.dropped(rows.current(), layer_id).items():
            full = next(r for r in rows.full if r.rid == rid)
            dropped = dropped.cpu()
            if rid in kept_from:  # another subscriber reads the request's rows from there on
                dropped = dropped[dropped < kept_from[rid]]
            kept[full.start + (dropped - full.prefix)] = False
    if bool((kept != rows.kept).any()):
        out = _cut(forward_batch, out, rows.cut(kept).nonzero().squeeze(1))
    return out
