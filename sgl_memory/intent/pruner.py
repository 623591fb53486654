"""The IntentKV pruner of one scheduler process: the `intent` mechanism's declarations and hooks.

Data flows one way: the request's `sgl_memory` field (admit, planner.py) -> its session and forced
spans -> query rows captured by the attention backend during prefill (QueryCapture, queries.py) ->
the scorer (the compression event, event.py) -> the layout applied to the slot map by the radix
tree (apply.py) -> metrics on release (here).
"""

from __future__ import annotations

import functools

import torch

from sgl_memory.core import mechanism, metrics, prometheus
from sgl_memory.core.capture import QueryCapture
from sgl_memory.core.kvhost import Branches, KVHost
from sgl_memory.core.mechanism import BranchIds, BuildContext, RowEdit
from sgl_memory.core.request import MemorySpec
from sgl_memory.core.requests import Lifetime, RequestTable
from sgl_memory.core.sessions import SessionKey
from sgl_memory.core.views import RequestView, SchedulerView
from sgl_memory.intent import settings as section
from sgl_memory.intent.apply import RowLayout
from sgl_memory.intent.event import Compressor
from sgl_memory.intent.head import PrunerHead, backbone_spec, find_head
from sgl_memory.intent.paths import branch_ids
from sgl_memory.intent.planner import Planner, RequestIntent
from sgl_memory.intent.queries import PrefillQueries
from sgl_memory.intent.sessions import QueryMemory, SessionMemories
from sgl_memory.intent.settings import IntentConfig

# Prometheus series (HTTP process: each finished request's metrics, recorded by observe)
COMPRESSION_EVENTS = prometheus.counter("compression_events", "IntentKV compression events")
LIVE_KV = prometheus.counter("live_kv_tokens", "KV tokens live after pruning, summed over requests")
PEAK_TOKENS = prometheus.counter("peak_request_tokens", "Peak request tokens, summed over requests")
KV_READS = prometheus.counter("kv_reads", "KV entries attended over decode steps", ["kind"])
BUDGET_CLAMPED = prometheus.counter("budget_clamped", "Requests whose forced set exceeded the configured budget")
SCORING_SECONDS = prometheus.histogram("scoring_seconds", "IntentKV scoring time per compression event")


@mechanism.register("intent")
class IntentPruner(mechanism.Mechanism, mechanism.Branching, mechanism.PositionShifting):
    """The `intent` mechanism: its hooks, each handed to the object whose job it is: admission and
    the request plan (`planner`, planner.py), the query capture (`queries`, queries.py), the
    compression event (`compressor`, event.py) with its layout (`layout`, apply.py), and the
    sessions' QueryMemory (`memories`, sessions.py). It keeps the per-request tables they share, the
    tree's questions about a request's path, and its metrics at release."""

    # after the mechanisms that rewrite the tokens (memory, persist): it finds its forced spans and
    # session in the final ones; and after keep, whose capture writes the placed rows' KV before
    # intent's capture reads the layer
    after = ("memory", "keep", "persist")
    settings = IntentConfig
    fields = section.FIELDS
    parse_request = staticmethod(section.parse_request)
    schema = mechanism.MetricsSchema(
        marker="compression_events",
        maxed=("peak_request_tokens",),
        counted=("session_key_source",),
        summed=(
            "peak_request_tokens",
            "live_kv_tokens",
            "raw_kv_reads",
            "eff_kv_reads",
            "compression_events",
            "scoring_ms",
        ),
    )
    needs_sentinel = True
    # at TP > 1 its scores are combined over the ranks (scorers.py): every rank prunes the same
    # positions (tests/test_tp_scores.py, tests/test_tp_server.py)
    page_refusal = "it points single pruned positions at the sentinel slot (dead_slot) or moves single rows (compact)"

    @classmethod
    def observe(cls, metrics: dict, meta_info: dict) -> None:
        if "compression_events" not in metrics:
            return
        COMPRESSION_EVENTS.inc(metrics["compression_events"])
        LIVE_KV.inc(metrics["live_kv_tokens"])
        PEAK_TOKENS.inc(metrics["peak_request_tokens"])
        KV_READS.labels("raw").inc(metrics["raw_kv_reads"])
        KV_READS.labels("eff").inc(metrics["eff_kv_reads"])
        if metrics["compression_events"]:
            SCORING_SECONDS.observe(metrics["scoring_ms"] / 1000)
        if metrics.get("budget_reason"):
            BUDGET_CLAMPED.inc()

    def __init__(self, config: IntentConfig, tree: KVHost, head: PrunerHead | None = None):
        self.config, self.tree = config, tree
        tree.sessions.limit(self.name, config.session_capacity)
        # what it knows of a request: as long as the request (a retracted one keeps its decision)
        self.plans: RequestTable[RequestIntent] = tree.requests.table("intent plans", Lifetime.REQUEST)
        # the query rows its prefill captures, and its positions' shift once its row was compacted
        self.captures: RequestTable[QueryCapture] = tree.requests.table("intent captures", Lifetime.ROW)
        self.shifts: RequestTable[int] = tree.requests.table("intent shifts", Lifetime.ROW)
        self.memories = SessionMemories(tree.sessions, self.name, config.decay)
        self.layout = RowLayout(self.shifts)
        self.planner = Planner(
            config, self.name, head, self.memories, self.layout, self.plans, self.captures, tree.evicted_within
        )
        self.queries = PrefillQueries(self.captures)
        self.compressor = Compressor(config, head, self.memories, self.layout, self.plans, self.captures)

    @classmethod
    def build(cls, config: IntentConfig, tree: KVHost, ctx: BuildContext | None) -> IntentPruner:
        spec = backbone_spec(ctx.model_config.hf_config) if ctx is not None else None
        head = find_head(config.head, spec)
        if head is None and config.scorer == "learned":
            raise ValueError(
                "intent.scorer learned needs a head: set intent.head to a head file (scripts/train_pruner.py "
                "writes one); no head ships for the served model"
            )
        return cls(config, tree, head)

    def subscriber(self) -> PrefillQueries:
        return self.queries  # it reads its requests' query rows

    def position_shift(self, rid: str) -> int:
        return self.shifts.get(rid) or 0

    # --- the session's QueryMemory, kept with the session by persistence -------------------------

    def export_session(self, key: SessionKey) -> dict[str, torch.Tensor]:
        return self.memories.export(key)

    def describe_session(self, state: QueryMemory) -> dict[str, int]:
        return self.memories.describe(state)

    def import_session(self, key: SessionKey, tensors: dict[str, torch.Tensor]) -> None:
        self.memories.restore(key, tensors)

    # --- admission and the request's path in the tree --------------------------------------------

    def admit(self, scheduler: SchedulerView, req: RequestView, spec: MemorySpec) -> None:
        self.planner.admit(scheduler, req, spec)

    def branch_ids(self, req: RequestView) -> BranchIds | None:
        # a pruning request matches its session's pruned path, every branch of it (intent/paths.py)
        state = self.plans.get(req.rid)
        return functools.partial(branch_ids, state.namespace) if state is not None and state.enabled else None

    def on_match(self, req: RequestView, branches: Branches) -> None:
        self.plans.get(req.rid).branches = branches

    def branches(self, req: RequestView) -> Branches:
        state = self.plans.get(req.rid)
        return state.branches if state is not None else ()

    def match_limit(self, req: RequestView) -> int | None:
        # the rows the scorer reads are computed by the request's own prefill, never taken from the
        # cache, so the kept set does not depend on what the tree held
        state = self.plans.get(req.rid)
        return state.capture_start if state is not None and state.enabled else None

    # --- the compression event (radix tree, after the last prefill chunk) -----------------------

    def on_checkpoint(self, req: RequestView, tree: KVHost) -> RowEdit | None:
        return self.compressor.on_checkpoint(req, tree)

    # --- release: metrics into meta_info -------------------------------------------------------

    def on_release(self, req: RequestView) -> None:
        state: RequestIntent | None = self.plans.get(req.rid)
        if state is None:
            return
        metrics.attach(req, request_metrics(state, len(req.output_ids)))


def request_metrics(state: RequestIntent, output_len: int) -> dict:
    """IntentKV's per-request metrics. Decode step j (1 .. T-1) attends to prompt + j tokens."""
    length = state.prompt_len
    live = state.live_after if state.live_after is not None else length
    steps = max(output_len - 1, 0)
    grown = steps * (steps + 1) // 2
    return {
        "peak_request_tokens": length + output_len,
        "live_kv_tokens": live + output_len,
        "raw_kv_reads": steps * length + grown,
        "eff_kv_reads": steps * live + grown,
        "compression_events": state.events,
        "query_memory_turns": state.memory_turns,
        "session_key_source": state.key_source,
        "scoring_ms": round(state.scoring_ms, 3),
        "prefill_ms": None if state.prefill_ms is None else round(state.prefill_ms, 3),
        "budget": state.budget if state.enabled else None,
        "budget_reason": state.budget_reason,
        "pruned_for": state.gate,
        **({"adaptive_budget": state.adaptive_metrics} if state.adaptive is not None else {}),
        "scorer": state.scorer if state.enabled else None,
        "layout": state.layout if state.enabled else None,
        "freed_slots": state.freed,
        "copied_slots": state.copied,
    }
