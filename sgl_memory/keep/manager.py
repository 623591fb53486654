"""The keep mechanism: repairs the KV of memory blocks placed among a request's prefill tokens.

KV memory (memart) attaches a `ReusedKV` to a request that asks for `recompute: keep` or
`cacheblend` and prefills the blocks' tokens with the request. At every attention layer of that
prefill (a capture.py subscriber: the BEFORE hook on RadixAttention.forward sees the layer's q, k
and v before the backend stores and attends them), the rows the layer does not recompute get the
placed KV written over their fresh K and V, so the backend stores and attends the placed KV there;
then the selector names the rows the next layer recomputes. What the request attends to is what a
forward that computes only the selected rows would give. Its cost is still a full prefill of the
blocks: dropping the other rows from the hidden states between layers is the speed-up still to come
(README.md, "Limits").
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sgl_memory import capture, mechanism, metrics, tree_fill
from sgl_memory.capture import ExtendRows
from sgl_memory.config import KeepConfig
from sgl_memory.keep.select import REGISTRY, LayerView, Selector, ratio_at
from sgl_memory.reuse import ReusedKV

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
    select_ms: float = 0.0
    refused: str | None = None

    def __post_init__(self):
        self.segment = self.reuse.segment_of_token()
        self.selected = torch.ones(self.reuse.keys.shape[1], dtype=torch.bool)

    def units(self) -> int:
        return len(self.reuse.segments) if self.selector.unit == "segment" else self.reuse.keys.shape[1]

    def layer(self, layer_id: int, attn, q, k, v, rows: ExtendRows, trace: bool) -> None:
        if self.refused:
            return
        if layer_id != self.next_layer or rows.prefix > self.reuse.start or rows.prefix + rows.count < self.prompt_len:
            # the placed rows and the turn must be in one forward, from the first layer on
            self.refused = "the prefill was split (chunked prefill); the blocks were recomputed in full"
            return
        self.next_layer += 1
        m = self.reuse.keys.shape[1]
        first = rows.start + self.reuse.start - rows.prefix
        mem = slice(first, first + m)
        turn = slice(first + m, rows.start + rows.count)
        keys = k.view(-1, attn.tp_k_head_num, attn.qk_head_dim)
        values = v.view(-1, attn.tp_v_head_num, attn.v_head_dim)
        placed_k = self.reuse.keys[layer_id].to(k.device, non_blocking=True)
        placed_v = self.reuse.values[layer_id].to(v.device, non_blocking=True)
        selected = self.selected.to(k.device)
        keys[mem][~selected] = placed_k[~selected].to(keys.dtype)
        values[mem][~selected] = placed_v[~selected].to(values.dtype)
        self.per_layer.append(int(self.selected.sum()))
        if trace:
            self.history.append(self.selected.clone())
        if layer_id + 1 >= self.layers or not bool(self.selected.any()):
            return  # the last layer, or none left to recompute (the later layers take the placed KV)
        t0 = time.perf_counter()
        queries = q.view(-1, attn.tp_q_head_num, attn.qk_head_dim)
        view = LayerView(queries[mem], keys[mem], values[mem], queries[turn], keys[turn], placed_k, placed_v, selected,
                         self.segment.to(k.device))  # fmt: skip
        n = math.ceil(ratio_at(layer_id + 1, self.layers, self.ratio, self.decay) * self.units())
        self.selected = self.selector.select(view, n).cpu()
        self.select_ms += (time.perf_counter() - t0) * 1000

    def metrics(self) -> dict:
        m = self.reuse.keys.shape[1]
        recomputed = sum(self.per_layer) if not self.refused else m * self.layers
        return {"recomputed_tokens": recomputed, "recomputed_per_layer": self.per_layer,
                "recompute_share": round(recomputed / max(1, m * self.layers), 6), "recompute_ms": round(self.select_ms, 3),
                "recompute_refused": self.refused}  # fmt: skip


@mechanism.register("keep")
class KeepManager(mechanism.Mechanism):
    def __init__(self, config: KeepConfig, tree):
        self.config, self.tree = config, tree
        self.layers = tree.token_to_kv_pool_allocator.get_kvcache().layer_num
        self.blends: dict[str, Blend] = {}  # rid -> the repair of a request admitted and not released

    @classmethod
    def build(cls, config: KeepConfig, tree, ctx) -> KeepManager:
        manager = cls(config, tree)
        capture.subscribe(cls.name, manager)
        return manager

    def admit(self, scheduler, req, spec) -> None:
        reuse: ReusedKV | None = getattr(req, "sgl_reuse", None)
        if reuse is None or spec.memory is None:
            return
        query = spec.memory
        hops = query.hops or self.config.hops
        selector = REGISTRY[reuse.method](hops=hops) if reuse.method == "keep" else REGISTRY[reuse.method]()
        ratio = self.config.ratio if query.recompute_ratio is None else query.recompute_ratio
        self.blends[req.rid] = Blend(reuse, selector, ratio, self.config.decay, self.layers, len(req.origin_input_ids))

    # --- the layers of the prefill (a capture.py subscriber) -------------------------------------

    def capturing(self) -> bool:
        return bool(self.blends)

    def bind(self, rows: list[ExtendRows]) -> list[tuple[Blend, ExtendRows]]:
        return [(self.blends[r.rid], r) for r in rows if r.rid in self.blends]

    def take(self, bound, layer, q, k, v) -> None:
        for blend, rows in bound:
            blend.layer(layer.layer_id, layer, q, k, v, rows, bool(self.config.trace_dir))

    # --- release ---------------------------------------------------------------------------------

    def on_release(self, req) -> None:
        blend = self.blends.pop(req.rid, None)
        if blend is None:
            return
        metrics.attach(req, blend.metrics())
        if self.config.trace_dir and not blend.refused and not self.tree.disable:
            self._trace(req, blend)

    def _trace(self, req, blend: Blend) -> None:
        """The placed rows' KV as the tree holds it after the prefill, which layers recomputed which
        rows, and the prompt's tokens: what a test compares with a full prefill."""
        from safetensors.torch import save_file

        path = tree_fill.held_path(self.tree, req)
        if len(path) < blend.reuse.end:
            return
        kv = tree_fill.copy_path(self.tree, path, blend.reuse.start, blend.reuse.end)
        out = Path(self.config.trace_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9._-]", "_", str(req.rid))
        save_file({"keys": kv.keys.contiguous(), "values": kv.values.contiguous(),
                   "selected": torch.stack(blend.history).to(torch.uint8),
                   "tokens": torch.tensor(list(req.origin_input_ids), dtype=torch.int64),
                   "start": torch.tensor([blend.reuse.start])}, str(out / f"{name}.safetensors"))  # fmt: skip
