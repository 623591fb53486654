"""Retrieval: a memory-mode request's admission, its probe's queries scoring the session's blocks, the blocks chosen."""

from __future__ import annotations

import time

from sgl_memory.core.kvhost import KVHost
from sgl_memory.core.spans import after_answer
from sgl_memory.core.views import RequestView, SchedulerView
from sgl_memory.memart.placement import choose
from sgl_memory.memart.placer import Placer
from sgl_memory.memart.pools import SessionPools
from sgl_memory.memart.probes import ProbeAdmission
from sgl_memory.memart.retrieval import score_blocks, top_blocks
from sgl_memory.memart.roles import Roles
from sgl_memory.memart.settings import MemArtConfig, MemArtRequest
from sgl_memory.memart.turns import MemArtTurn, Turns


class Retriever:
    """A memory-mode request at its admission (scheduler thread): where its turn starts, the
    session's blocks scored by its probe's queries (retrieval.py), the top ones with their units
    and headers within the token budgets (placement.choose), handed to the `Placer`."""

    def __init__(
        self,
        config: MemArtConfig,
        tree: KVHost,
        roles: Roles,
        probes: ProbeAdmission,
        pools: SessionPools,
        placer: Placer,
        turns: Turns,
    ):
        self.config, self.tree, self.roles = config, tree, roles
        self.probes, self.pools, self.placer, self.turns = probes, pools, placer, turns

    def admit(
        self, scheduler: SchedulerView, req: RequestView, owner: tuple[str, str], query: MemArtRequest, readonly: bool
    ) -> None:
        state = self.turn(scheduler, req, owner, query, readonly)
        state.windowed = query.windowed
        t0 = time.perf_counter()
        self.retrieve(scheduler, req, state, query)
        state.retrieval_ms = (time.perf_counter() - t0) * 1000

    def turn(
        self, scheduler: SchedulerView, req: RequestView, owner: tuple[str, str], query: MemArtRequest, readonly: bool
    ) -> MemArtTurn:
        """The request's `MemArtTurn`, with where what it adds to the session starts: what the
        client added after the last answer (all of it: two tool results are two messages in some
        templates), else its last message; not the history it resends. A text-mode request's lines
        (placed by the HTTP side, memart/text.py) are left out of what it records."""
        state = self.turns.set(
            req.rid,
            MemArtTurn(
                owner,
                query.mode,
                store=query.store and not readonly,
                recompute="none" if query.mode == "text" else query.recompute or self.config.recompute,
                text_span=query.text_span,
                text_lines=query.text_lines,
            ),
        )
        state.retrieval_ms = query.text_ms  # text mode's retrieval ran on the HTTP side
        ids = list(req.origin_input_ids)
        start = after_answer(self.roles.of(scheduler).messages(ids), len(ids))
        state.turn_start = start if start is not None else self.roles.spans(scheduler, ids).query_start
        return state

    def retrieve(self, scheduler: SchedulerView, req: RequestView, state: MemArtTurn, query: MemArtRequest) -> None:
        probe = self.probes.get(query.probe)
        memory = self.pools.session(state.owner, create=False)
        if probe is None or probe.owner != state.owner or not probe.rows:
            state.refused = "no query pass for this request"
            return
        state.probe_tokens = probe.prefilled
        if memory is None:
            return  # nothing remembered yet
        memory.ingest(self.config.block_size)  # turns the worker has not added yet
        index = memory.index()
        ids = index.ids
        if not ids:
            return
        q = probe.queries()
        scores = score_blocks(
            q,
            index,
            query.scoring or self.config.scoring,
            query.norm or self.config.norm,
            query.agg or self.config.agg,
            self.config.rr_constant,
            reduce=self.tree.reduce_heads,
        )
        limit = getattr(scheduler, "max_req_input_len", None)
        budgets = [limit - len(req.origin_input_ids)] if limit else []
        placed = query.placed_tokens if query.placed_tokens is not None else self.config.placed_tokens
        budgets += [placed] if placed else []
        ranked = [ids[i] for i in top_blocks(scores, query.top_k or self.config.top_k)]
        blocks = memory.take(
            choose(
                memory,
                ranked,
                query.header or self.config.header,
                min(budgets, default=None),
                query.unit or self.config.unit,
            )
        )
        if blocks:
            self.placer.place(req, state, memory, blocks, probe, query)
