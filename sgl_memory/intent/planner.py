"""The request plan at admission: what the pruner will do with a request (budget, scorer, layout,
forced spans, session, the namespace of its branches), and the query capture its event will read.

The request's `sgl_memory` field and the `intent:` section (settings.py) give the rule, its forced
spans (sgl_memory/core/spans.py) and session key (sessions.py) what the rule applies to; in
budget_mode total a budget below the forced set is a 400 when the client asked for it, and clamped
to the forced set when the server's default asked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from sgl_memory.core import prometheus
from sgl_memory.core.capture import QueryCapture
from sgl_memory.core.kvhost import Branches
from sgl_memory.core.request import FIELD, MemorySpec, SpecError
from sgl_memory.core.requests import RequestTable
from sgl_memory.core.sessions import SessionKey
from sgl_memory.core.spans import RoleMarkers, Spans, find_spans
from sgl_memory.core.views import RequestView, SchedulerView
from sgl_memory.intent import scorers
from sgl_memory.intent.apply import RowLayout
from sgl_memory.intent.head import PrunerHead
from sgl_memory.intent.paths import namespace
from sgl_memory.intent.sessions import NAMED_SOURCES, SessionMemories, resolve_key
from sgl_memory.intent.settings import IntentConfig, IntentRequest

ADAPTIVE_SCORERS = (
    "memory",
    "memory_pool",
    "query",
    "learned",
)  # their scores, normalised, are a mass over the candidates


@dataclass
class RequestIntent:
    """What the pruner knows about one request, kept in its `plans` table (IntentPruner)."""

    enabled: bool
    budget: int
    scorer: str
    layout: str
    spans: Spans
    prompt_len: int
    session_key: SessionKey | None
    key_source: str | None
    budget_reason: str | None = None  # why the budget applied is not the one configured
    gate: str | None = None  # intent.when pressure: why this request prunes ("session", "pressure")
    namespace: int = 0  # the branch ids of this session's pruned paths derive from it (intent/paths.py)
    branches: Branches = ()  # where this request's path takes branch ids; (): a plain path
    capture_start: int = 0  # the first prompt position whose query rows the scorer and QueryMemory read
    decided: bool = False
    live_after: int | None = None  # live prompt tokens after the event (None: no event)
    events: int = 0
    memory_turns: int = 0  # turns folded into the session's QueryMemory, this one included
    scoring_ms: float = 0.0
    prefill_ms: float | None = None  # the prefill the event follows, from its first forward (None: unknown)
    freed: int = 0
    copied: int = 0  # kept positions of the shared path copied into the pruned path's own slots
    ablation: str = "none"  # the learned scorer's (IntentConfig.ablation)
    adaptive: IntentConfig | None = None  # budget_mode adaptive: the settings its budget follows
    adaptive_metrics: dict | None = None  # what the event did to the session's budget


class Planner:
    """Admission (scheduler hook, before the request is queued): the request's plan into the
    `plans` table, and for a request that prunes the QueryCapture its prefill fills, into
    `captures` (both IntentPruner's request-store tables)."""

    def __init__(
        self,
        config: IntentConfig,
        name: str,
        head: PrunerHead | None,
        memories: SessionMemories,
        layout: RowLayout,
        plans: RequestTable[RequestIntent],
        captures: RequestTable[QueryCapture],
        evicted_within: Callable[[float], bool],
    ):
        self.config, self.name = config, name
        self.evicted_within = evicted_within  # KVHost.evicted_within: the pool's pressure
        self.head = head  # the learned scorer's (None: scorer learned is refused)
        self.memories, self.layout = memories, layout
        self.plans, self.captures = plans, captures
        self.markers: RoleMarkers | None = None  # from the tokenizer, at the first request

    def admit(self, scheduler: SchedulerView, req: RequestView, spec: MemorySpec) -> None:
        if req.rid in self.plans or req.finished():
            return
        if self.markers is None:
            self.markers = RoleMarkers.from_tokenizer(getattr(scheduler, "tokenizer", None), self.config.roles)
        try:
            self.plans.set(req.rid, self.plan(req, spec))
        except SpecError as exc:
            prometheus.BAD_REQUESTS.labels("field").inc()
            req.set_finish_with_abort(str(exc))
            return
        state = self.plans.get(req.rid)
        if spec.readonly:
            # no event: no query rows to compute, so it takes all the session's path holds of its prompt
            state.capture_start = state.prompt_len
        elif state.enabled:
            window = self.config.window if scorers.SCORERS[state.scorer].needs_window else 0
            query_capture = self.captures.set(req.rid, QueryCapture(state.spans.query_start, state.prompt_len, window))
            state.capture_start = min(query_capture.span_start, query_capture.window_start)
            if state.layout == "compact" and self.layout.rope is None:
                try:
                    self.layout.load_rope(scheduler.model_config.hf_config)
                except ValueError as exc:
                    req.set_finish_with_abort(f"{FIELD}.layout compact: {exc}")
                    self.captures.pop(req.rid)

    def gate(self, key: SessionKey, source: str, cfg: IntentConfig, length: int, forced: int) -> str | None:
        """intent.when pressure: "session" when the session, named by the client, pruned before (its
        path is a pruned one, which only a pruning turn follows), "pressure" when the tree evicted
        within the window and the request has history over the configured budget to drop, None when
        it is served whole. Without that history an event would drop nothing, yet the pruning
        request prefills its latest message itself (its query rows), all of its history when a
        client sends it as one message. A session the server derived from the tokens (a prefix
        hash) is not followed: every request opening alike would be it."""
        if source in NAMED_SOURCES and self.memories.has_turns(key):
            return "session"
        keeps = cfg.budget if cfg.budget_mode == "total" else forced + cfg.budget
        if length <= max(keeps, forced):
            return None
        return "pressure" if self.evicted_within(cfg.pressure_window_s) else None

    def plan(self, req: RequestView, spec: MemorySpec) -> RequestIntent:
        asked: IntentRequest = spec.part(self.name) or IntentRequest()
        cfg = asked.over(self.config)
        tokens = req.origin_input_ids
        spans = find_spans(tokens, self.markers, cfg.query_tail)
        if cfg.system_prompt == "compressible":
            spans = replace(spans, system_end=0)
        forced = spans.forced_count(len(tokens))
        enabled = cfg.enabled  # the section's, unless the request says `intent: false`
        key, source, gate = None, None, None
        if enabled:
            key, source = resolve_key(
                spec.session_id,
                spec.tenant,
                getattr(req, "session_id", None),
                tokens,
                spans.session_span,
                cfg.session_prefix_tokens,
                req.rid,
            )
        if enabled and cfg.when == "pressure":
            gate = self.gate(key, source, cfg, len(tokens), forced)
            enabled = gate is not None
            if not enabled:
                key, source = None, None  # as on a server that does not prune
        budget, reason = cfg.budget, None
        if cfg.budget_mode == "adaptive" and enabled:
            if cfg.scorer not in ADAPTIVE_SCORERS:
                raise SpecError(
                    f"{FIELD}.budget_mode adaptive follows a scorer's attention mass: use scorer "
                    f"{', '.join(ADAPTIVE_SCORERS)}, not {cfg.scorer!r}"
                )
            budget = self.memories.budget(key, cfg).current + forced
        elif cfg.budget_mode == "history":
            budget = cfg.budget + forced
        elif enabled and budget < forced:
            parts = f"(system prefix {spans.system_end} + actionable query span {len(tokens) - spans.query_start})"
            if asked.budget is not None:  # the client asked for what cannot be kept: say so
                raise SpecError(
                    f"{FIELD}.budget {budget} is smaller than this request's forced set of {forced} "
                    f"tokens {parts}; use a budget >= {forced}, budget_mode history or system_prompt compressible"
                )
            # the server's default cannot refuse a client that asked for nothing: prune as far as it can
            budget, reason = (
                forced,
                (
                    f"intent.budget {cfg.budget} is smaller than this request's forced set of "
                    f"{forced} tokens {parts}: only the forced set is kept"
                ),
            )
        # the pruning rule names the branch: in history mode the applied budget moves with each
        # turn's forced set, in adaptive mode with the session too, and the session's next turn
        # must still find this one's path
        rule = budget if cfg.budget_mode == "total" else f"history:{cfg.budget}"
        if cfg.budget_mode == "adaptive":
            rule = f"adaptive:{cfg.budget_floor}-{cfg.budget_ceiling}"
        rule = rule if cfg.system_prompt == "forced" else f"{rule}/system"
        if enabled and cfg.scorer == "learned" and self.head is None:
            raise SpecError(f"{FIELD}.scorer learned: this server has no pruner head for its model (intent.head)")
        # an ablation of the learned head keeps another set, so it prunes on a branch of its own
        scorer = cfg.scorer if cfg.scorer != "learned" or cfg.ablation == "none" else f"{cfg.scorer}/{cfg.ablation}"
        ns = namespace(key, scorer, rule, cfg.layout) if enabled else 0
        return RequestIntent(
            enabled,
            budget,
            cfg.scorer,
            cfg.layout,
            spans,
            len(tokens),
            key,
            source,
            budget_reason=reason,
            gate=gate,
            namespace=ns,
            ablation=cfg.ablation,
            adaptive=cfg if cfg.budget_mode == "adaptive" and enabled else None,
        )
