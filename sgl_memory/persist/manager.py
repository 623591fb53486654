"""Session KV persistence in one scheduler process: three tiers of a session's KV.

- hot: its token path in the radix tree (SGLang's own reuse), ordered for eviction by its next use
  (next_use.py);
- warm: its stored form (SessionRecord: token ids + encoded blocks) in host memory, up to
  `warm_bytes`, least recently used dropped first (only once it is on disk; warm.py);
- cold: its safetensors file (store.py), up to `quota_bytes`.

At release (`on_release`, scheduler thread) the KV of the request's path is copied out of the pool:
only the tokens from the first block the stored record does not already hold, so a turn costs a
copy of its own tokens, not of the session. A writer thread encodes the copy into blocks (warm)
and writes the file, off the request's path (writer.py). When a turn opens (`open`) a session this
server does not hold is loaded from its file (loader.py). At admission (`admit`, scheduler thread,
before the request is queued) the prompt is matched against the session's path as text
(textmatch.py, plan.py); when the tree lacks part of what the prompt reuses, slots are reserved for
that part, it is dequantized into them on a thread of its own while the request waits in the queue
(unpack.py), and at a later scheduler step the path is inserted into the tree, so the scheduler's
own prefix match finds it and prefills only the rest (restorer.py). A session a hint says comes
back soon is brought back before its turn arrives (prefetch.py).

Each session has two locks (session.py): `lock` guards its in-memory state (capture, encode,
restore), `io` serialises its file writes and loads; different sessions proceed in parallel.

Servers may share the store (replicas behind a router; one taking over a killed one's sessions).
Each server remembers the generation of a session's file it last read or wrote (store.py). A turn of
a session whose file has moved on since (another server served and stored it) first forgets what
this server holds of the session, every mechanism's state included, and loads the file: the
session continues from its newest stored turn wherever it lands (loader.py). A write that finds the
file moved on (two servers serving one session at once) is refused and counted, never stored over
the other (writer.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from sgl_memory.core import mechanism, metrics, prometheus
from sgl_memory.core.request import KV_HINTS, MemorySpec
from sgl_memory.core.requests import Lifetime
from sgl_memory.persist.identity import cache_spec
from sgl_memory.persist.loader import SessionLoader
from sgl_memory.persist.next_use import NextUse
from sgl_memory.persist.plan import Planner
from sgl_memory.persist.prefetch import Prefetch
from sgl_memory.persist.quant import store_format
from sgl_memory.persist.restorer import Restorer
from sgl_memory.persist.session import RANKS_DIFFER, PersistTurn, Session, Sessions
from sgl_memory.persist.settings import PersistConfig
from sgl_memory.persist.settings import parse_request as parse_agent_hints
from sgl_memory.persist.store import CacheSpec, SessionFiles
from sgl_memory.persist.textmatch import TextCodec
from sgl_memory.persist.warm import WarmTier
from sgl_memory.persist.writer import Writer

if TYPE_CHECKING:
    from sgl_memory.core.kvhost import KVHost
    from sgl_memory.core.views import RequestView, SchedulerView

logger = logging.getLogger(__name__)

RESTORES = prometheus.counter("restores", "Session KV restored into the tree", ["source"])
RESTORED_TOKENS = prometheus.counter("restored_tokens", "Tokens restored from the session store")
RESTORE_SECONDS = prometheus.histogram("restore_seconds", "Session restore time")
# where a session turn's time before its first token went, per turn: `deferred` (its restore
# waited for room), `restore` (its own), `queued` (behind other requests), `prefill` (its own)
WAIT_PARTS = {
    "deferred": "restore_deferred_ms",
    "restore": "restore_ms",
    "queued": "queued_ms",
    "prefill": "turn_prefill_ms",
}
TURN_WAIT_SECONDS = prometheus.histogram(
    "turn_wait_seconds", "Where a session turn's time to its first token went", ["part"], buckets=prometheus.WAITS
)


@mechanism.register("persist")
class SessionPersistence(mechanism.Mechanism):
    """The `persist` mechanism: a session's KV kept across eviction, restarts and model swaps. Its
    hooks hand the work to the pieces built here: the loader, the restorer, the next-use predictor,
    prefetch and the writer."""

    # after memory and keep (intent runs after it): its text-level match may replace a full-history
    # prompt's ids with the stored session's, and it restores their KV; intent then finds its
    # spans in the final tokens. At release it writes the session after memory queued its turn.
    after = ("memory", "keep")
    settings = PersistConfig
    fields = ("agent", KV_HINTS)  # KV_HINTS: SGLang's envelope's actions, put in the field by the HTTP layer
    parse_request = staticmethod(parse_agent_hints)
    follows_internal = True  # an entry write or forget changes the session: its file keeps that
    # at TP > 1 each rank writes its own file; the ranks load and restore a session together or
    # not at all (rank_range in loader.py and Planner.agree; tests/test_tp_server.py)
    schema = mechanism.MetricsSchema(
        marker="text_match",
        summed=(
            "restored_tokens",
            "restore_ms",
            "restore_step_ms",
            "prefetched_tokens",
            "restore_deferred_ms",
            "queued_ms",
            "turn_prefill_ms",
        ),
        counted=("text_match",),
        flagged=("persist_error", "persist_refused"),
    )

    @classmethod
    def observe(cls, metrics: dict, meta_info: dict) -> None:
        if metrics.get("restored_tokens"):
            RESTORES.labels(metrics.get("restored_from") or "unknown").inc()
            RESTORED_TOKENS.inc(metrics["restored_tokens"])
            RESTORE_SECONDS.observe(metrics["restore_ms"] / 1000)
        if metrics.get("turn_prefill_ms") is not None:  # it ran: every part is known
            for part, key in WAIT_PARTS.items():
                TURN_WAIT_SECONDS.labels(part).observe((metrics.get(key) or 0) / 1000)
        if metrics.get("persist_refused"):
            prometheus.REFUSALS.labels(
                cls.name, "ranks" if metrics["persist_refused"] == RANKS_DIFFER else "file"
            ).inc()

    def __init__(self, config: PersistConfig, tree: KVHost, spec: CacheSpec) -> None:
        config = dataclasses.replace(config, quant=store_format(config.quant, spec.dtype))
        self.config, self.tree, self.spec = config, tree, spec
        # what it did for a request, as long as the request (a retracted one is written at its end)
        self.turns = tree.requests.table("persist turns", Lifetime.REQUEST)
        self.files = SessionFiles(config.store_dir(), spec, quant=config.quant, kivi=config.kivi)
        self.sessions = Sessions(tree.sessions, self.name)
        self.text = TextCodec()  # the scheduler's tokenizer, from the first request on (open)
        self.next_use = NextUse(config, tree)
        self.prefetch = Prefetch(config, tree, self.files, self.next_use)
        self.loader = SessionLoader(tree, self.files, self.sessions)
        planner = Planner(config, tree, self.files, self.text, self.loader)
        self.writer = Writer(
            config, tree, self.files, self.sessions, self.text, self.next_use, WarmTier(config, self.sessions), self
        )
        self.restorer = Restorer(config, tree, self.files, self.sessions, planner, self.turns)
        if self.files.removed_partial:
            logger.info("session store: removed %d partial file(s) of writers that died", self.files.removed_partial)
        self.writer.probe()

    @classmethod
    def build(cls, config: PersistConfig, tree: KVHost, ctx: Any) -> SessionPersistence:
        if ctx is None:
            raise ValueError("session persistence needs the scheduler's build context (model and pool layout)")
        spec = cache_spec(ctx.model_config, ctx.server_args, tree, ctx.tp_rank, ctx.tp_size)
        persistence = cls(config, tree, spec)
        logger.info("session store: %s (%s, quant %s)", config.store_dir(), spec.model_id, persistence.config.quant)
        return persistence

    # --- admission: load the session, match the prompt, restore ---------------------------------

    def open(self, scheduler: SchedulerView, req: RequestView, spec: MemorySpec) -> None:
        """Load a session this server has not seen (or dropped) from its file, before any mechanism
        admits the request: the other mechanisms' state in the file goes back to them."""
        if req.rid in self.turns or req.finished() or spec.session_id is None or self.tree.disable:
            return
        if self.text.tokenizer is None:
            self.text.tokenizer = scheduler.tokenizer
        state = self.turns.set(
            req.rid,
            PersistTurn(
                spec.tenant,
                spec.session_id,
                assembled=spec.assembled,
                reads_only=spec.reads_only,
                hints=spec.part(self.name),
            ),
        )
        t0 = time.perf_counter()
        session = self.sessions.get(spec.tenant, spec.session_id, create=False)
        if session is not None and not spec.reads_only:
            state.prefetched_tokens, session.prefetched = session.prefetched, 0
            if self.next_use.came_back(session):
                self.prefetch.unwatch(session)
        self.loader.open(state, session)
        state.step_ms = state.parts_ms["file"] = (time.perf_counter() - t0) * 1000

    def admit(self, scheduler: SchedulerView, req: RequestView, spec: MemorySpec) -> None:
        state: PersistTurn | None = self.turns.get(req.rid)
        if state is None or req.finished() or state.assembled:
            return  # an assembled prompt (recalled blocks before a new turn) is rebuilt by its mechanism
        self.restorer.admit(scheduler, req, spec, state)

    def before_prefill(self, scheduler: SchedulerView, waiting: list[RequestView], running: bool) -> list:
        """Land the restores unpacked since the last step; bring back the sessions expected back
        about now (prefetch); then restore the deferred requests' KV, in the order they came, while
        the holds have room; the rest, and those being unpacked, wait out of this batch (so the
        scheduler does not prefill their histories)."""
        self.restorer.land()
        self.prefetch.run()
        return self.restorer.restore_deferred(waiting, running)

    # --- release: capture the turn, write it off the request's path ------------------------------

    def on_drop(self, req: RequestView) -> None:
        self.restorer.forget(req)

    def on_release(self, req: RequestView) -> None:
        """The turn ended: its next use is learned from its hints, and its KV captured and written."""
        state: PersistTurn | None = self.turns.get(req.rid)
        if state is None:
            return
        self.restorer.forget(req)
        session = self.sessions.get(state.tenant, state.session_id, create=True)
        state.waited(req.time_stats)
        metrics.attach(req, state.metrics(session.error))
        if not state.reads_only:
            self.next_use.finished(session, state.hints)
            self.prefetch.watch(session)
        self.writer.capture(req, state, session)

    @classmethod
    def banner(cls, section: PersistConfig) -> str:
        return f"store {section.store_dir()}" if section.enabled else "no session store"

    def describe_session(self, state: Session) -> dict:
        with state.lock:
            live = len(state.tokens) if state.live is None else int(state.live.sum())
            now = time.monotonic()
            when = self.next_use.next_use(state, now) if state.finished_at is not None else None
            return {
                "path_tokens": len(state.tokens),
                "live_tokens": live,
                "stored_bytes": state.stored_bytes if state.on_disk else 0,
                # seconds until its next turn is expected (null: a turn of it runs, or none comes)
                "expected_back_s": round(when - now, 3) if when is not None and math.isfinite(when) else None,
                # what its last turn's hints left: kept in the pool this many more seconds, leaves it first
                "keep_s": round(state.keep_until - now, 3) if state.keep_until and state.keep_until > now else None,
                "leaves_first": "done" if state.done else "demoted" if state.demoted else None,
            }

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every captured turn is written and every restore started is unpacked
        (flush_cache calls this before it empties the tree)."""
        return self.writer.drain(timeout) and self.restorer.settle(timeout)
