"""The IntentKV pruner of one scheduler process: admission, query capture, compression, metrics.

Data flows one way: the request's `sgl_memory` field (admit) -> its session and forced spans ->
query rows captured by the attention backend during prefill (QueryCapture) -> the scorer ->
the layout applied to the slot map by the radix tree (compress) -> metrics on release.
"""

from __future__ import annotations

import functools
import logging
import time
import zlib
from dataclasses import dataclass, replace

import torch

from sgl_memory.core import capture, mechanism, metrics, prometheus, tree_fill
from sgl_memory.core.capture import ExtendRows, QueryCapture
from sgl_memory.intent import scorers
from sgl_memory.intent.head import PrunerHead, backbone_spec, find_head
from sgl_memory.core.mechanism import RowEdit
from sgl_memory.intent.layouts import apply_compact, apply_dead_slot
from sgl_memory.intent.paths import branch_id, branch_ids, namespace
from sgl_memory.core.kvhost import Branches
from sgl_memory.intent import settings as section
from sgl_memory.intent.settings import IntentConfig, IntentRequest
from sgl_memory.core.request import FIELD, MemorySpec, SpecError
from sgl_memory.core.requests import Lifetime, RequestTable
from sgl_memory.intent.sessions import AdaptiveBudget, QueryMemory, resolve_key
from sgl_memory.core.spans import RoleMarkers, Spans, find_spans

logger = logging.getLogger(__name__)
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
    session_key: tuple[str, str] | None
    key_source: str | None
    budget_reason: str | None = None  # why the budget applied is not the one configured
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


COMPRESSION_EVENTS = prometheus.counter("compression_events", "IntentKV compression events")
LIVE_KV = prometheus.counter("live_kv_tokens", "KV tokens live after pruning, summed over requests")
PEAK_TOKENS = prometheus.counter("peak_request_tokens", "Peak request tokens, summed over requests")
KV_READS = prometheus.counter("kv_reads", "KV entries attended over decode steps", ["kind"])
BUDGET_CLAMPED = prometheus.counter("budget_clamped", "Requests whose forced set exceeded the configured budget")
SCORING_SECONDS = prometheus.histogram("scoring_seconds", "IntentKV scoring time per compression event")


@mechanism.register("intent")
class IntentPruner(mechanism.Mechanism, mechanism.Branching, mechanism.PositionShifting):
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

    def __init__(self, config: IntentConfig, tree, head: PrunerHead | None = None):
        self.config, self.tree = config, tree
        self.head = head  # the learned scorer's (None: scorer learned is refused)
        tree.sessions.limit(self.name, config.session_capacity)
        self.markers: RoleMarkers | None = None
        self.rope = None
        # what it knows of a request: as long as the request (a retracted one keeps its decision)
        self.plans: RequestTable[RequestIntent] = tree.requests.table("intent plans", Lifetime.REQUEST)
        # the query rows its prefill captures, and its positions' shift once its row was compacted
        self.captures: RequestTable[QueryCapture] = tree.requests.table("intent captures", Lifetime.ROW)
        self.shifts: RequestTable[int] = tree.requests.table("intent shifts", Lifetime.ROW)

    @classmethod
    def build(cls, config: IntentConfig, tree, ctx) -> IntentPruner:
        spec = backbone_spec(ctx.model_config.hf_config) if ctx is not None else None
        head = find_head(config.head, spec)
        if head is None and config.scorer == "learned":
            raise ValueError(
                "intent.scorer learned needs a head: set intent.head to a head file (scripts/train_pruner.py "
                "writes one); no head ships for the served model"
            )
        return cls(config, tree, head)

    def subscriber(self) -> IntentPruner:
        return self  # it reads its requests' query rows

    def position_shift(self, rid: str) -> int:
        return self.shifts.get(rid) or 0

    # --- the session's QueryMemory, kept with the session by persistence -------------------------

    def export_session(self, key) -> dict[str, torch.Tensor]:
        memory = self.tree.sessions.get(key, self.name)
        state = memory.state if memory is not None else None  # read once: update() replaces it whole
        if state is None:
            return {}
        out = {"query_memory": state, "updates": torch.tensor([memory.updates])}
        if memory.budget is not None:
            out["adaptive_budget"] = torch.tensor([memory.budget.current])
        return out

    def describe_session(self, slot: QueryMemory) -> dict:
        out = {"query_memory_turns": slot.updates}
        if slot.budget is not None:
            out["adaptive_budget"] = slot.budget.current
        return out

    def import_session(self, key, tensors: dict[str, torch.Tensor]) -> None:
        if "query_memory" not in tensors:
            return
        memory = self.tree.sessions.get(key, self.name, lambda: QueryMemory(self.config.decay))
        if memory.state is None:
            memory.state = tensors["query_memory"].float()
            memory.updates = int(tensors["updates"][0]) if "updates" in tensors else 1
        if memory.budget is None and "adaptive_budget" in tensors:
            memory.budget = AdaptiveBudget(int(tensors["adaptive_budget"][0]))

    # --- admission (scheduler hook, before the request is queued) --------------------------------

    def admit(self, scheduler, req, spec: MemorySpec) -> None:
        if req.rid in self.plans or req.finished():
            return
        if self.markers is None:
            self.markers = RoleMarkers.from_tokenizer(getattr(scheduler, "tokenizer", None), self.config.roles)
        try:
            self.plans.set(req.rid, self._plan(req, spec))
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
            if state.layout == "compact" and self.rope is None:
                from sgl_memory.core.rope import Rope

                try:
                    self.rope = Rope.from_hf_config(scheduler.model_config.hf_config)
                except ValueError as exc:
                    req.set_finish_with_abort(f"{FIELD}.layout compact: {exc}")
                    self.captures.pop(req.rid)

    def branch_ids(self, req):
        # a pruning request matches its session's pruned path, every branch of it (intent/paths.py)
        state = self.plans.get(req.rid)
        return functools.partial(branch_ids, state.namespace) if state is not None and state.enabled else None

    def on_match(self, req, branches) -> None:
        self.plans.get(req.rid).branches = branches

    def branches(self, req):
        state = self.plans.get(req.rid)
        return state.branches if state is not None else ()

    def match_limit(self, req) -> int | None:
        # the rows the scorer reads are computed by the request's own prefill, never taken from the
        # cache, so the kept set does not depend on what the tree held
        state = self.plans.get(req.rid)
        return state.capture_start if state is not None and state.enabled else None

    def _plan(self, req, spec: MemorySpec) -> RequestIntent:
        asked: IntentRequest = spec.part(self.name) or IntentRequest()
        cfg = asked.over(self.config)
        tokens = req.origin_input_ids
        spans = find_spans(tokens, self.markers, cfg.query_tail)
        if cfg.system_prompt == "compressible":
            spans = replace(spans, system_end=0)
        forced = spans.forced_count(len(tokens))
        enabled = cfg.enabled  # the section's, unless the request says `intent: false`
        key, source = None, None
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
        budget, reason = cfg.budget, None
        if cfg.budget_mode == "adaptive" and enabled:
            if cfg.scorer not in ADAPTIVE_SCORERS:
                raise SpecError(
                    f"{FIELD}.budget_mode adaptive follows a scorer's attention mass: use scorer "
                    f"{', '.join(ADAPTIVE_SCORERS)}, not {cfg.scorer!r}"
                )
            budget = self._adaptive(key, cfg).current + forced
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
            namespace=ns,
            ablation=cfg.ablation,
            adaptive=cfg if cfg.budget_mode == "adaptive" and enabled else None,
        )

    def _adaptive(self, key, cfg: IntentConfig) -> AdaptiveBudget:
        """The session's adaptive budget, made at its first request from the configured budget."""
        memory = self.tree.sessions.get(key, self.name, lambda: QueryMemory(self.config.decay))
        if memory.budget is None:
            memory.budget = AdaptiveBudget(min(max(cfg.budget, cfg.budget_floor), cfg.budget_ceiling))
        return memory.budget

    # --- query capture (a capture.py subscriber) -------------------------------------------------

    def capturing(self) -> bool:
        return bool(self.captures)

    def bind(self, rows: list[ExtendRows]) -> list[tuple[QueryCapture, ExtendRows]]:
        """The requests of this forward whose prompt is being prefilled."""
        bound = []
        for r in rows:
            query_capture = self.captures.get(r.rid)
            if query_capture is not None and r.prefix < query_capture.length:
                bound.append((query_capture, r))
        return bound

    def first_read(self, part) -> int:
        return part[0].first_read()

    def take(self, bound, layer, q, k, v) -> None:
        for query_capture, r in bound:
            query_capture.add_rows(layer, q, r)

    # --- the compression event (radix tree, after the last prefill chunk) -----------------------

    def on_checkpoint(self, req, tree) -> RowEdit | None:
        """The compression event: once per request, at the end of its prefill."""
        state: RequestIntent | None = self.plans.get(req.rid)
        if state is None or state.decided or req.finished() or not req.output_ids:
            return None
        state.decided = True
        query_capture = self.captures.pop(req.rid)
        if not state.enabled:
            return None
        t0 = time.perf_counter()
        # SGLang stamps the request's first forward with perf_counter, this process's clock: the
        # event's cost can be set against the prefill it follows (every chunk of it included)
        entered = getattr(getattr(req, "time_stats", None), "forward_entry_time", 0.0)
        state.prefill_ms = (t0 - entered) * 1000 if entered else None
        length = state.prompt_len
        row = tree.row(req)
        slots = row[:length].to(torch.int64)
        live = slots != tree.sentinel
        q_mean = query_capture.q_mean() if query_capture is not None else None
        q_window = query_capture.q_window() if query_capture is not None else torch.zeros(0)
        scorer = scorers.get(state.scorer)
        memory = None
        if q_mean is not None:
            query_memory = self.tree.sessions.get(state.session_key, self.name, lambda: QueryMemory(self.config.decay))
            memory = query_memory.update(q_mean)
            state.memory_turns = query_memory.updates
        n_live = int(live.sum())
        state.live_after = n_live
        if n_live <= state.budget:
            return None
        positions = torch.arange(length)
        forced = (positions < state.spans.system_end) | (positions >= state.spans.query_start)
        candidates = positions[live & ~forced]
        keep = state.budget - int((live & forced).sum())
        if (scorer.needs_queries and q_mean is None) or (scorer.needs_window and not q_window.numel()):
            return None  # no query rows were captured (e.g. the prompt was a full cache hit)
        pool = tree.pool
        cand_slots = slots[candidates]

        def keys_of(slots):
            return lambda: (pool.get_key_buffer(layer)[slots] for layer in range(pool.layer_num))

        query_slots = slots[positions[live & (positions >= state.spans.query_start)]]
        inputs = scorers.ScoringInputs(
            layer_keys=keys_of(cand_slots),
            positions=candidates,
            q_mean=q_mean,
            q_window=q_window,
            memory=memory,
            keep=keep,
            seed=self._seed(state, length),
            sinks=self.config.sinks,
            kernel=self.config.kernel,
            query_keys=keys_of(query_slots),
            head=self.head,
            ablation=state.ablation,
            features={} if self.config.trace_dir and state.scorer == "learned" else None,
            reduce=tree.reduce_heads,
        )
        scores = scorer.score(inputs)
        picked = scorers.select(scores, keep)
        chosen = candidates[picked]
        if state.adaptive is not None:
            self._follow(state, scores, picked, chosen, length)
        if inputs.features:
            self._trace(req, state, candidates, keep, inputs.features)
        kept = torch.cat([positions[live & forced], chosen]).sort().values
        edit = self._apply(req, tree, row, kept, live, pool)
        state.scoring_ms = (time.perf_counter() - t0) * 1000
        if edit is None:
            return None
        state.events, state.freed, state.copied = 1, edit.freed, edit.copied
        state.live_after = int(kept.numel())
        return edit

    @staticmethod
    def _seed(state: RequestIntent, length: int) -> int:
        """The random scorer's seed: from the session and the prompt's length, so the same session
        sent again draws the same set (a request id is fresh per request and would not)."""
        tenant, session = state.session_key or ("", "")
        return zlib.crc32(f"{tenant}\x00{session}\x00{length}".encode())

    def _follow(
        self, state: RequestIntent, scores: torch.Tensor, picked: torch.Tensor, chosen: torch.Tensor, length: int
    ) -> None:
        """budget_mode adaptive: the scorer's mass left out (a distribution over the candidates: the
        rule's shares, or the learned score's softmax, its log-space form) moves the session's budget."""
        scores = scores.double()
        mass = (
            torch.softmax(scores, 0)
            if state.scorer == "learned"
            else scores.clamp_min(0) / scores.clamp_min(0).sum().clamp_min(1e-30)
        )
        mass_out = max(0.0, 1.0 - float(mass[picked].sum()))
        budget = self._adaptive(state.session_key, state.adaptive)
        overlap = budget.after_event(mass_out, chosen, length, state.adaptive)
        state.adaptive_metrics = {
            "mass_beyond_budget": round(mass_out, 6),
            "kept_overlap": None if overlap is None else round(overlap, 6),
            "next_budget": budget.current,
        }

    def _trace(self, req, state: RequestIntent, candidates: torch.Tensor, keep: int, features: dict) -> None:
        """The learned head's inputs at this event, with what labels them later (the prompt's tokens,
        its forced spans, its session and turn): training rows read exactly what inference reads."""
        tensors = dict(
            features,
            tokens=torch.tensor(list(req.origin_input_ids), dtype=torch.int64),
            positions=candidates,
            spans=torch.tensor([state.spans.system_end, state.spans.query_start]),
            keep=torch.tensor([keep]),
        )
        tenant, session = state.session_key or ("", "")
        meta = {"tenant": tenant, "session": session, "turn": str(state.memory_turns), "rid": str(req.rid)}
        capture.write_trace(self.config.trace_dir, req.rid, tensors, meta)

    def _apply(self, req, tree, row, kept, live, pool) -> RowEdit | None:
        """live: [length] bool, the row's positions that held KV before the event."""
        length = live.numel()
        protected = req.kv.cache_protected_len
        state: RequestIntent = self.plans.get(req.rid)
        if state.layout == "dead_slot":
            return self._apply_dead_slot(req, tree, row, kept, live, protected)
        edit = apply_compact(
            row,
            kept,
            length,
            protected,
            tree.sentinel,
            tree.alloc_slots,
            tree.free_real,
            [pool.get_key_buffer(i) for i in range(pool.layer_num)],
            [pool.get_value_buffer(i) for i in range(pool.layer_num)],
            self.rope,
        )
        if edit is None:
            logger.warning("intent pruning: no free KV slots to compact request %s; left unpruned", req.rid)
            return None
        req.kv.cache_protected_len = 0  # every slot of the re-packed row is the request's own now
        self.shifts.set(req.rid, edit.position_shift)  # the engine runs its positions shifted
        return edit

    def _apply_dead_slot(self, req, tree, row, kept, live, protected) -> RowEdit | None:
        """Prune the row and make the pruning the path's: from its first newly dropped position b
        the path is a branch of the session's (intent/paths.py). Kept positions in [b, protected)
        hold slots of the shared path, which other paths still own: their KV is copied into fresh
        slots, so the branch owns every slot it holds and the shared path's stay evictable on
        their own. The next turn's prefill then attends to exactly what this event kept."""
        state: RequestIntent = self.plans.get(req.rid)
        length = live.numel()
        newly = live.clone()
        newly[kept] = False
        dropped = torch.nonzero(newly).flatten()
        if not dropped.numel():
            return None
        b = int(dropped[0])
        shared = kept[(kept >= b) & (kept < protected)]
        if shared.numel():
            fresh = tree.alloc_slots(shared.numel())  # may evict: the request's own path is locked
            if fresh is None:
                logger.warning(
                    "intent pruning: no free KV slots to copy %d kept positions of request %s; left unpruned",
                    shared.numel(),
                    req.rid,
                )
                return None
            fresh = fresh.to(row.device)
            tree_fill.copy_within(tree, fresh, row[shared].to(torch.int64))
            row[shared] = fresh.to(row.dtype)
        edit = apply_dead_slot(row, kept, length, protected, tree.sentinel, tree.free_real)
        edit.copied = int(shared.numel())
        # from b on the row is the request's own: SGLang's insert frees what the tree already held
        # there, its release what the tree never took
        req.kv.cache_protected_len = min(protected, b)
        state.branches = tuple(x for x in state.branches if x[0] < b) + (
            (b, branch_id(state.namespace, int(req.origin_input_ids[b]))),
        )
        return edit

    # --- release: metrics into meta_info -------------------------------------------------------

    def on_release(self, req) -> None:
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
        **({"adaptive_budget": state.adaptive_metrics} if state.adaptive is not None else {}),
        "scorer": state.scorer if state.enabled else None,
        "layout": state.layout if state.enabled else None,
        "freed_slots": state.freed,
        "copied_slots": state.copied,
    }
