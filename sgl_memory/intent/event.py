"""The compression event: once per request, at the end of its prefill (the radix tree's checkpoint,
after the last prefill chunk), the session's QueryMemory is updated, the scorer (scorers.py) picks
the candidates to keep, the adaptive budget follows what it left out, the learned head's inputs are
traced, and the kept set goes into the row (apply.py)."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator

import torch

from sgl_memory.core import capture, kv_rows
from sgl_memory.core.capture import QueryCapture
from sgl_memory.core.kvhost import KVHost
from sgl_memory.core.mechanism import RowEdit
from sgl_memory.core.requests import RequestTable
from sgl_memory.core.views import RequestView
from sgl_memory.intent import scorers
from sgl_memory.intent.apply import RowLayout
from sgl_memory.intent.head import PrunerHead
from sgl_memory.intent.planner import RequestIntent
from sgl_memory.intent.sessions import SessionMemories
from sgl_memory.intent.settings import IntentConfig


class Compressor:
    """Runs a request's compression event (IntentPruner.on_checkpoint) from its plan (`plans`) and
    its captured query rows (`captures`, taken here), and records in the plan what it did."""

    def __init__(
        self,
        config: IntentConfig,
        head: PrunerHead | None,
        memories: SessionMemories,
        layout: RowLayout,
        plans: RequestTable[RequestIntent],
        captures: RequestTable[QueryCapture],
    ):
        self.config, self.head = config, head
        self.memories, self.layout = memories, layout
        self.plans, self.captures = plans, captures

    def on_checkpoint(self, req: RequestView, tree: KVHost) -> RowEdit | None:
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
            query_memory = self.memories.memory(state.session_key)
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

        def keys_of(slots: torch.Tensor) -> Callable[[], Iterator[torch.Tensor]]:
            return lambda: (kv_rows.values(pool.get_key_buffer(layer)[slots]) for layer in range(pool.layer_num))

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
        edit = self.layout.apply(req, state, tree, row, kept, live, pool)
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
        budget = self.memories.budget(state.session_key, state.adaptive)
        overlap = budget.after_event(mass_out, chosen, length, state.adaptive)
        state.adaptive_metrics = {
            "mass_beyond_budget": round(mass_out, 6),
            "kept_overlap": None if overlap is None else round(overlap, 6),
            "next_budget": budget.current,
        }

    def _trace(
        self, req: RequestView, state: RequestIntent, candidates: torch.Tensor, keep: int, features: dict
    ) -> None:
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
