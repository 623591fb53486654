"""The keep mechanism: repairs the KV of memory blocks placed among a request's prefill tokens.

KV memory (memart) attaches a `ReusedKV` to a request that asks for `recompute: keep` or
`cacheblend` and prefills the blocks' tokens with the request. At every attention layer of that
prefill (a capture.py subscriber: the BEFORE hook on RadixAttention.forward sees the layer's q, k
and v before the backend stores and attends them), the rows the layer does not recompute get the
placed KV written over their fresh K and V, so the backend stores and attends the placed KV there;
then the selector names the rows the next layer recomputes. What the request attends to is what a
forward that computes only the selected rows would give. With `drop_rows` on (the default) the rows
no later layer recomputes are also dropped from the hidden states after each layer (rows.py, on
the backends that attend a row layout): their KV at the later layers goes into the pool from the
placed KV, layer by layer, and the layers run over fewer rows, which is where the time goes down.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from sgl_memory.core import capture, kv_rows, mechanism, metrics, prometheus, tree_fill
from sgl_memory.core.capture import ExtendRows
from sgl_memory.keep import settings as section
from sgl_memory.keep.settings import KeepConfig, KeepRequest
from sgl_memory.keep.loading import LayerLoader
from sgl_memory.keep.select import SELECTORS, LayerView, Selector, ratio_at
from sgl_memory.core.requests import Lifetime, RequestTable
from sgl_memory.core.reuse import ReusedKV, prefill_cost

logger = logging.getLogger(__name__)


@dataclass
class Blend:
    """One request's repair, advanced layer by layer as its prefill runs."""

    reuse: ReusedKV
    selector: Selector
    ratio: float
    decay: float
    layers: int
    prompt_len: int
    segment: torch.Tensor = field(init=False)  # [M] segment of each placed token
    selected: torch.Tensor = field(init=False)  # [M] bool: the rows the current layer recomputes
    next_layer: int = 0
    per_layer: list[int] = field(default_factory=list)
    history: list[torch.Tensor] = field(default_factory=list)  # the selections, when traced
    loading: str = "sync"
    bandwidth: float = 0.0
    drop_rows: bool = True  # drop the rows no later layer recomputes (rows.py), where the backend can
    loader: LayerLoader | None = None  # created at the first layer, on the layer's device
    select_ms: float = 0.0
    dropped_rows: bool = False  # whether later layers ran without the rows not recomputed (rows.py)
    refused: str | None = None

    def __post_init__(self):
        self.segment = self.reuse.segment_of_token()
        self.selected = torch.ones(self.reuse.keys.shape[1], dtype=torch.bool)

    def needed(self, selected: torch.Tensor) -> torch.Tensor:
        """The placed rows a layer that recomputes `selected` reads."""
        return torch.ones_like(selected) if self.selector.reads_placed else ~selected

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()

    def units(self) -> int:
        return len(self.reuse.segments) if self.selector.unit == "segment" else self.reuse.keys.shape[1]

    def layer(self, layer_id: int, attn, q, k, v, rows: ExtendRows, tree, trace: bool) -> None:
        """One attention layer, before the backend stores and attends its KV: the placed KV goes
        where this layer does not recompute (over the fresh rows in place, or into the pool for rows
        rows.py dropped), then the selector names the next layer's rows."""
        if self.refused:
            return
        positions = rows.row_positions()
        if layer_id != self.next_layer or rows.prefix > self.reuse.start or int(positions[-1]) + 1 < self.prompt_len:
            # the placed rows and the turn must be in one forward, from the first layer on
            self.refused = "the prefill was split (chunked prefill); the blocks were recomputed in full"
            return
        self.next_layer += 1
        start, end = self.reuse.start, self.reuse.end
        batch = rows.start + torch.arange(len(positions))
        in_memory = (positions >= start) & (positions < end)
        present = torch.zeros(end - start, dtype=torch.bool)
        present[positions[in_memory] - start] = True
        mem_rows, turn_rows = batch[in_memory], batch[positions >= end]
        keys = k.view(-1, attn.tp_k_head_num, attn.qk_head_dim)
        values = v.view(-1, attn.tp_v_head_num, attn.v_head_dim)
        if self.loader is None:
            self.loader = LayerLoader(self.reuse.keys, self.reuse.values, k.device, self.loading, self.bandwidth)
        placed_k, placed_v = self.loader.ready(layer_id, self.needed(self.selected))
        placed_k, placed_v = placed_k.to(keys.dtype), placed_v.to(values.dtype)
        over = (present & ~self.selected)[present]  # present rows this layer does not recompute
        if bool(over.any()):
            keys[mem_rows[over].to(k.device)] = placed_k[present & ~self.selected]
            values[mem_rows[over].to(k.device)] = placed_v[present & ~self.selected]
        absent = ~present
        if bool(absent.any()):  # rows no longer computed: their placed KV into their slots
            self.dropped_rows = True
            slot_map = tree.slot_map()
            slots = slot_map[rows.pool_row, (start + absent.nonzero().squeeze(1)).to(slot_map.device)].to(torch.int64)
            pool, absent = tree.pool, absent.to(k.device)
            buffers = (pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id))
            for buffer, placed in zip(buffers, (placed_k, placed_v)):
                buffer[slots] = kv_rows.convert(placed[absent], buffer.dtype)  # an 8-bit pool: rounded to it
        self.per_layer.append(int(self.selected.sum()))
        if trace:
            self.history.append(self.selected.clone())
        if layer_id + 1 >= self.layers or not bool(self.selected.any()):
            return  # the last layer, or none left to recompute (the later layers take the placed KV)
        t0 = time.perf_counter()
        queries = q.view(-1, attn.tp_q_head_num, attn.qk_head_dim)
        k_mem, v_mem = placed_k.clone(), placed_v.clone()
        q_mem = queries.new_zeros(end - start, *queries.shape[1:])
        idx = present.to(k.device)
        k_mem[idx], v_mem[idx], q_mem[idx] = (
            keys[mem_rows.to(k.device)],
            values[mem_rows.to(k.device)],
            queries[mem_rows.to(k.device)],
        )
        turn = turn_rows.to(k.device)
        view = LayerView(
            q_mem,
            k_mem,
            v_mem,
            queries[turn],
            keys[turn],
            placed_k,
            placed_v,
            self.selected.to(k.device),
            self.segment.to(k.device),
            tree.reduce_heads,
        )
        n = math.ceil(ratio_at(layer_id + 1, self.layers, self.ratio, self.decay) * self.units())
        self.selected = self.selector.select(view, n).cpu()
        self.loader.want(layer_id + 1, self.needed(self.selected), ~self.selected)
        self.select_ms += (time.perf_counter() - t0) * 1000

    def dropped(self) -> torch.Tensor:
        """Positions of the placed rows the next layer does not recompute."""
        if self.refused:
            return torch.zeros(0, dtype=torch.int64)
        return self.reuse.start + (~self.selected).nonzero().squeeze(1)

    def metrics(self, cached_tokens: int) -> dict:
        m = self.reuse.keys.shape[1]
        recomputed = sum(self.per_layer) if not self.refused else m * self.layers
        loads = self.loader.metrics() if self.loader is not None else {}
        cost = prefill_cost(self.prompt_len, cached_tokens, m, True, recomputed, self.layers)
        return (
            loads
            | cost
            | {
                "recompute_method": self.reuse.method,
                "recompute_placed_tokens": m * self.layers,
                "recomputed_per_layer": self.per_layer,
                "recompute_share": round(recomputed / max(1, m * self.layers), 6),
                "recompute_ms": round(self.select_ms, 3),
                # the repair's own time: choosing the rows, and waiting for placed KV a layer needed
                # (the rows it recomputes are in the prefill's time, as every prompt token is)
                "repair_ms": round(self.select_ms + loads.get("load_wait_ms", 0.0), 3),
                "recompute_dropped_rows": self.dropped_rows,
                "recompute_refused": self.refused,
            }
        )


REPAIRED = prometheus.counter("keep_repairs", "Requests whose placed memory blocks KEEP repaired", ["method"])
PLACED_TOKENS = prometheus.counter("keep_placed_tokens", "Placed memory tokens times layers of the repaired requests")
RECOMPUTED_TOKENS = prometheus.counter("keep_recomputed_tokens", "Of those, the tokens times layers recomputed")
SELECT_SECONDS = prometheus.histogram("keep_select_seconds", "KEEP's selection time per repaired request")
REPAIR_SECONDS = prometheus.histogram("keep_repair_seconds", "A repair's own time: selection and waits for placed KV")


@mechanism.register("keep")
class KeepManager(mechanism.Mechanism):
    """The `keep` mechanism: repairs the KV that memory placed among a request's prefill tokens,
    layer by layer, by the selector the request's `recompute` names."""

    # after memory: it repairs the blocks memory placed among the request's prefill tokens
    # (reuse.py); intent runs after it, so its capture subscriber writes their KV before intent's
    # reads the layer
    after = ("memory",)
    repairs = SELECTORS.names()  # memory.recompute: keep, cacheblend, starts
    settings = KeepConfig
    fields = ("keep",)
    parse_request = staticmethod(section.parse_request)
    schema = mechanism.MetricsSchema(
        marker="recompute_method", summed=("recomputed_token_layers", "recompute_ms", "repair_ms")
    )
    # at TP > 1 the selectors' head aggregates are combined over the ranks (select.py): every rank
    # recomputes the same rows (tests/test_tp_scores.py, tests/test_tp_server.py)
    page_refusal = "it recomputes, and may drop, single rows of the placed blocks"
    # on with KV memory unless its section says: memory's default repair (recompute: starts) runs here
    enabled_with = "memory"

    @classmethod
    def observe(cls, metrics: dict, meta_info: dict) -> None:
        if "recompute_method" not in metrics:
            return
        REPAIRED.labels(metrics["recompute_method"]).inc()
        PLACED_TOKENS.inc(metrics["recompute_placed_tokens"])
        RECOMPUTED_TOKENS.inc(metrics["recomputed_token_layers"])
        SELECT_SECONDS.observe(metrics["recompute_ms"] / 1000)
        REPAIR_SECONDS.observe(metrics["repair_ms"] / 1000)

    def __init__(self, config: KeepConfig, tree):
        self.config, self.tree = config, tree
        self.layers = tree.pool.layer_num
        # the repair of a request, from its admission to its row's release
        self.blends: RequestTable[Blend] = tree.requests.table("keep blends", Lifetime.ROW)

    @classmethod
    def build(cls, config: KeepConfig, tree, ctx) -> KeepManager:
        return cls(config, tree)

    def subscriber(self) -> KeepManager:
        return self  # it takes the placed rows it recomputes

    def dropper(self) -> KeepManager:
        return self  # a request may drop rows (keep.drop_rows) whatever the server's default

    def admit(self, scheduler, req, spec) -> None:
        reuse: ReusedKV | None = self.tree.placed_kv(req)
        if reuse is None:
            return
        asked: KeepRequest = spec.part(self.name) or KeepRequest()
        hops = asked.hops or self.config.hops
        selector = SELECTORS[reuse.method](hops=hops) if reuse.method == "keep" else SELECTORS[reuse.method]()
        ratio = asked.ratio
        if ratio is None:
            ratio = self.config.starts_ratio if reuse.method == "starts" else self.config.ratio
        drop_rows = self.config.drop_rows if asked.drop_rows is None else asked.drop_rows
        self.blends.set(
            req.rid,
            Blend(
                reuse,
                selector,
                ratio,
                self.config.decay,
                self.layers,
                len(req.origin_input_ids),
                loading=self.config.loading,
                bandwidth=self.config.tier_bandwidth,
                drop_rows=drop_rows,
            ),
        )

    # --- the layers of the prefill (a capture.py subscriber) -------------------------------------

    def capturing(self) -> bool:
        return bool(self.blends)

    def bind(self, rows: list[ExtendRows]) -> list[tuple[Blend, ExtendRows]]:
        return [(blend, r) for r in rows if (blend := self.blends.get(r.rid)) is not None]

    def take(self, bound, layer, q, k, v) -> None:
        for blend, rows in bound:
            blend.layer(layer.layer_id, layer, q, k, v, rows, self.tree, bool(self.config.trace_dir))

    # --- dropping the rows no later layer recomputes (a rows.py dropper) ------------------------

    def dropped(self, rows: list[ExtendRows], layer_id: int) -> dict[str, torch.Tensor]:
        blends = [(r.rid, self.blends.get(r.rid)) for r in rows]
        return {rid: blend.dropped() for rid, blend in blends if blend is not None and blend.drop_rows}

    # --- release ---------------------------------------------------------------------------------

    def on_drop(self, req) -> None:
        blend = self.blends.get(req.rid)
        if blend is not None:
            blend.close()

    def on_release(self, req) -> None:
        blend = self.blends.get(req.rid)
        if blend is None:
            return
        blend.close()
        metrics.attach(req, blend.metrics(req.cached_tokens))
        if self.config.trace_dir and not blend.refused and not self.tree.disable:
            self._trace(req, blend)

    def _trace(self, req, blend: Blend) -> None:
        """The placed rows' KV as the tree holds it after the prefill, which layers recomputed which
        rows, and the prompt's tokens: what a test compares with a full prefill."""
        path = tree_fill.held_path(self.tree, req)
        if len(path) < blend.reuse.end:
            return
        kv = tree_fill.copy_path(self.tree, path, blend.reuse.start, blend.reuse.end)
        capture.write_trace(
            self.config.trace_dir,
            req.rid,
            {
                "keys": kv.keys,
                "values": kv.values,
                "selected": torch.stack(blend.history).to(torch.uint8),
                "tokens": torch.tensor(list(req.origin_input_ids), dtype=torch.int64),
                "start": torch.tensor([blend.reuse.start]),
            },
        )
