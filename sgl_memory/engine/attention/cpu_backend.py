"""`sgl_memory_cpu`: SGLang's torch_native backend with attention proportional to the new tokens.

torch_native pads each request's query to the full KV length and runs a causal SDPA over all of it,
so a 1-token extend over a 10k cached prefix costs a 10k x 10k attention per layer, and it gathers
every request's KV and repeats it per query head in every layer. Here, once per forward, each
request's slot map is turned into a plan (sgl_memory.engine.attention.kv_source: pool views where slots are
contiguous); each layer then attends only the new tokens (sgl_memory.engine.attention.merged).

KV writes, metadata and the paths we do not specialise (encoder / cross attention, sliding
windows, non-causal layers, speculative modes) stay torch_native's.

With intent pruning on (sgl_memory.intent), `kv_slots` leaves the sentinel slot out of every index
list, so attention reads only the kept entries of a pruned request.

A layer may compute only some rows of a request (sgl_memory/core/rows.py: KEEP drops placed memory rows it
does not recompute); the backend then plans that layer from the forward's row layout, and such a
request's rows attend by position over its whole slot list.

A decode step of a request with reads (core/decode.py: SentenceKV) attends, at each layer, the
positions its reads give for that layer's query, not its whole slot list.

A pool that stores another dtype than the model computes in (an 8-bit pool; a bf16 pool under
float32) rounds every row it holds. A prefill's rows attend one another as the forward computed
them, not as the pool gives them back: only what a later forward reads from the pool is rounded,
once. Otherwise each token's hidden state would carry the rounding of every row before it into
its own K and V, layer after layer, before that K is rounded again. A decode step's own row, one
among the request's, is read from the pool like the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_memory.core import kv_rows
from sgl_memory.core.rows import layout as row_layout
from sgl_memory.engine import runtime
from sgl_memory.engine.attention.kv_source import KvSource, locate
from sgl_memory.engine.attention.merged import attend, attend_masked

BACKEND_NAME = "sgl_memory_cpu"

_PLANNED_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE)


@dataclass(frozen=True)
class RequestPlan:
    """How one request's new query rows (from `q_start`) attend at a layer: the keys all of them
    see, and their own keys, seen causally."""

    q_start: int
    n_new: int
    visible: KvSource  # keys every new token sees: the prefix, or the whole sequence when n_new == 1
    own: KvSource | None  # the new tokens' own keys, seen causally (n_new > 1)


@dataclass(frozen=True)
class SparsePlan:
    """A request of which this layer computes only some rows: each attends to every key at a
    position up to its own (its dropped rows' KV included, which the pool holds)."""

    q_start: int
    n_new: int
    keys: KvSource
    key_positions: torch.Tensor  # [kv] of `keys` (positions pruned to the sentinel left out)
    q_positions: torch.Tensor  # [n_new]


def plan_layout(req_to_token: torch.Tensor, rows, sentinel: int | None = None) -> list:
    """Plans of one layer from the forward's row layout (rows.py: RowLayout.current())."""
    plans: list[RequestPlan | SparsePlan] = []
    for r in rows:
        if r.positions is None:
            plans += plan_requests(req_to_token, [r.pool_row], [r.prefix], [r.count], sentinel, q_start=r.start)
            continue
        end = int(r.positions[-1]) + 1 if r.count else r.prefix
        slots = req_to_token[r.pool_row, :end]
        positions = torch.arange(end, device=slots.device)
        if sentinel is not None:
            live = slots != sentinel
            slots, positions = slots[live], positions[live]
        plans.append(SparsePlan(r.start, r.count, locate(slots), positions, r.positions.to(slots.device)))
    return plans


def plan_requests(
    req_to_token: torch.Tensor,
    rows: list[int],
    prefix_lens: list[int],
    new_lens: list[int],
    sentinel: int | None = None,
    q_start: int = 0,
) -> list[RequestPlan]:
    plans = []
    for row, prefix, n in zip(rows, prefix_lens, new_lens):
        if n == 1:
            plans.append(RequestPlan(q_start, n, locate(kv_slots(req_to_token, row, 0, prefix + 1, sentinel)), None))
        else:
            visible = locate(kv_slots(req_to_token, row, 0, prefix, sentinel))
            plans.append(RequestPlan(q_start, n, visible, locate(req_to_token[row, prefix : prefix + n])))
        q_start += n
    return plans


def kv_slots(req_to_token: torch.Tensor, row: int, start: int, stop: int, sentinel: int | None = None) -> torch.Tensor:
    """The pool slots of positions [start, stop) a request attends to, in position order: the one
    place cached history is read from the slot map. Positions pruned to the sentinel are left out,
    so attention reads only kept entries (the new tokens of a forward are never pruned)."""
    slots = req_to_token[row, start:stop]
    return slots if sentinel is None else slots[slots != sentinel]


def with_step_reads(
    plans: list,
    step_reads: dict,
    layer: int,
    query: torch.Tensor,
    req_to_token: torch.Tensor,
    sentinel: int | None = None,
) -> list:
    """A decode step's plans at one layer: a request with reads attends only the positions they
    give for its query at this layer (core/decode.py), the sentinel's left out."""
    plans = list(plans)
    for i, (reads, row, length, token) in step_reads.items():
        p = plans[i]
        positions = reads.positions(layer, query[p.q_start], token, length)
        slots = req_to_token[row, positions.to(req_to_token.device)]
        if sentinel is not None:
            slots = slots[slots != sentinel]
        plans[i] = RequestPlan(p.q_start, 1, locate(slots), None)
    return plans


def run_plans(plans, query, output, k_cache, v_cache, scaling, computed=None) -> torch.Tensor:
    """Each plan's attention into `output`. `computed`: this forward's K and V rows [tokens, heads,
    dim] (rows of `query`), attended in place of the pool's copies of the rows this forward wrote."""
    for p in plans:
        end = p.q_start + p.n_new
        mine = None if computed is None else (computed[0][p.q_start : end], computed[1][p.q_start : end])
        if isinstance(p, SparsePlan):
            k, v = p.keys.read_joined(k_cache), p.keys.read_joined(v_cache)
            if mine is not None:
                # the computed rows' positions are live (a forward's rows are never pruned) and sorted
                at = torch.searchsorted(p.key_positions, p.q_positions)
                k, v = (kv_rows.convert(x, query.dtype) for x in (k, v))
                k[at], v[at] = mine
            mask = p.key_positions[None, :] <= p.q_positions[:, None]
            output[p.q_start : end] = attend_masked(query[p.q_start : end], k, v, mask, scaling)
            continue
        visible = list(zip(p.visible.read(k_cache), p.visible.read(v_cache)))
        own = None
        if p.own is not None:
            own = mine if mine is not None else (p.own.read_joined(k_cache), p.own.read_joined(v_cache))
        output[p.q_start : end] = attend(query[p.q_start : end], visible, own, scaling)
    return output


def unplanned(k_cache: torch.Tensor) -> None:
    """A layer torch_native attends (encoder, cross or windowed attention): it reads the pool's
    buffers as values, which packed int8 rows are not, so such a server cannot use that pool."""
    if kv_rows.packed(k_cache):
        raise RuntimeError(
            "--kv-cache-dtype int8 is read by this backend's own plans only; this model has layers it leaves "
            "to torch_native (encoder, cross or sliding-window attention): serve it with a float or fp8 pool"
        )


class SglMemoryCpuAttnBackend(TorchNativeAttnBackend):
    """The `sgl_memory_cpu` attention backend to SGLang: its torch_native backend with the forward's
    metadata and the extend and decode attention overridden (patches/contacts.yaml), so that each
    layer attends only what each request's plan reads."""

    plans: list | None = None
    planned_tokens = 0  # query rows the plans cover; a layer called with other rows is not ours
    supports_row_layout = True  # engine/layers.py may drop rows between layers
    forward_batch = None
    layout_version = 0  # of the row layout the plans follow
    step_reads: dict | None = None  # decode: batch index -> (reads, slot-map row, length, input token)
    layer_id = 0  # of the layer whose decode attention runs (forward_decode)
    computed: tuple[torch.Tensor, torch.Tensor] | None = None  # the extending layer's K and V (forward_extend)

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self.plans, self.forward_batch, self.layout_version, self.step_reads = None, forward_batch, 0, None
        mode = forward_batch.forward_mode
        if mode not in _PLANNED_MODES or forward_batch.encoder_lens is not None:
            return
        rows = forward_batch.req_pool_indices.tolist()
        seq_lens = forward_batch.seq_lens.tolist()
        if mode == ForwardMode.DECODE:
            prefix_lens, new_lens = [s - 1 for s in seq_lens], [1] * len(seq_lens)
        else:
            prefix_lens = forward_batch.extend_prefix_lens_cpu or forward_batch.extend_prefix_lens.tolist()
            new_lens = forward_batch.extend_seq_lens_cpu or forward_batch.extend_seq_lens.tolist()
        sentinel = runtime.sentinel()
        self.plans = plan_requests(
            self.req_to_token_pool.req_to_token, rows, list(prefix_lens), list(new_lens), sentinel
        )
        self.planned_tokens = sum(new_lens)
        composed = runtime.composition()
        if mode == ForwardMode.DECODE and composed is not None and composed.reads_steps:
            tokens = forward_batch.input_ids.tolist()
            reads = [composed.step_reads(rid) for rid in forward_batch.rids or ()]
            self.step_reads = {i: (r, rows[i], seq_lens[i], tokens[i]) for i, r in enumerate(reads) if r is not None}

    def _planned(self, query, encoder_lens, is_cross_attn, sliding_window_size) -> bool:
        windowed = sliding_window_size is not None and sliding_window_size > -1
        return (
            self.plans is not None
            and encoder_lens is None
            and not is_cross_attn
            and not windowed
            and self.planned_tokens == query.shape[0]
        )

    def _run_sdpa_forward_extend(
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_prefix_lens,
        extend_seq_lens,
        encoder_lens=None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size=None,
    ):
        layout = row_layout(self.forward_batch) if self.plans is not None else None
        if layout is not None and layout.version != self.layout_version:
            rows = layout.current()
            self.plans = plan_layout(self.req_to_token_pool.req_to_token, rows, runtime.sentinel())
            self.planned_tokens, self.layout_version = sum(r.count for r in rows), layout.version
        if causal and self._planned(query, encoder_lens, is_cross_attn, sliding_window_size):
            # the pool's copies equal the computed rows where it stores the compute dtype: read them there
            computed = self.computed if k_cache.dtype != query.dtype else None
            return run_plans(self.plans, query, output, k_cache, v_cache, scaling, computed)
        unplanned(k_cache)
        return super()._run_sdpa_forward_extend(
            query,
            output,
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices,
            seq_lens,
            extend_prefix_lens,
            extend_seq_lens,
            encoder_lens,
            scaling,
            enable_gqa,
            causal,
            is_cross_attn,
            sliding_window_size,
        )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        # _run_sdpa_forward_extend is handed the pool, not the rows this forward computed
        self.computed = (
            None
            if k is None or v is None
            else (k.view(-1, layer.tp_k_head_num, layer.qk_head_dim), v.view(-1, layer.tp_v_head_num, layer.v_head_dim))
        )
        try:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        finally:
            self.computed = None

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.layer_id = layer.layer_id  # the step reads are per layer; _run_sdpa_forward_decode is not told which
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _run_sdpa_forward_decode(
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        encoder_lens=None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size=None,
    ):
        if self._planned(query, encoder_lens, is_cross_attn, sliding_window_size):
            plans = self.plans
            assert plans is not None  # _planned: this forward's plans are made
            if self.step_reads:
                plans = with_step_reads(plans, self.step_reads, self.layer_id, query, req_to_token, runtime.sentinel())
            return run_plans(plans, query, output, k_cache, v_cache, scaling)
        unplanned(k_cache)
        return super()._run_sdpa_forward_decode(
            query,
            output,
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices,
            seq_lens,
            encoder_lens,
            scaling,
            enable_gqa,
            causal,
            is_cross_attn,
            sliding_window_size,
        )


def create(runner) -> SglMemoryCpuAttnBackend:
    return SglMemoryCpuAttnBackend(runner)
