"""Restoring a session's KV into the tree at admission: the request's reused prefix held until it
runs, what the tree lacks of it dequantized into reserved slots (on the unpack thread at TP 1), and
the requests that find no room deferred to a later prefill batch, in arrival order."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

import torch

from sgl_memory.core import prometheus, tree_fill
from sgl_memory.core.request import MemorySpec
from sgl_memory.persist import textmatch
from sgl_memory.persist.plan import Planner, Restore
from sgl_memory.persist.session import PersistTurn, Sessions
from sgl_memory.persist.settings import PersistConfig
from sgl_memory.persist.store import ANY_NAMESPACE, SessionFiles, SessionRecord
from sgl_memory.persist.unpack import Unpacker

if TYPE_CHECKING:
    from sgl_memory.core.kvhost import KVHost
    from sgl_memory.core.requests import RequestTable
    from sgl_memory.core.views import RequestView, SchedulerView

logger = logging.getLogger(__name__)

DEFERRED = prometheus.counter(
    "restores_deferred", "Session restores deferred at admission: the held KV of waiting requests was at its bound"
)
DEFERRED_SECONDS = prometheus.histogram(
    "restore_deferred_seconds", "How long a deferred restore's request waited for room before its KV was restored"
)


def decode(
    files: SessionFiles, tree: KVHost, record: SessionRecord, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the record's positions [start, end) in the pool's dtype."""
    return files.decode(record, start, end, dtype=tree.pool.get_key_buffer(tree.layers()[0]).dtype)


class Restorer:
    """Brings a request's reused prefix of its session back into the tree and holds it there until
    the request runs; defers the requests the holds or the pool have no room for, and lands the
    restores the unpack thread finished."""

    def __init__(
        self,
        config: PersistConfig,
        tree: KVHost,
        files: SessionFiles,
        sessions: Sessions,
        planner: Planner,
        turns: RequestTable[PersistTurn],
    ) -> None:
        self.config, self.tree, self.files, self.sessions, self.planner = config, tree, files, sessions, planner
        self.turns = turns  # what persistence does for each request (SessionPersistence.turns)
        # requests whose restore waits for room among the holds (restore_deferred), in arrival order,
        # with where their session's KV was at admission (memory, or read from disk)
        self._deferred: dict[object, str] = {}
        # a request's restore is unpacked off the scheduler's step; at TP > 1 every rank must land a
        # restore at the same step, so there it is unpacked in the step that places it
        self._unpacker = Unpacker() if tree.tp_size == 1 else None

    def admit(self, scheduler: SchedulerView, req: RequestView, spec: MemorySpec, state: PersistTurn) -> None:
        """Match the prompt against the session's path and restore what it reuses, or defer it."""
        t0 = time.perf_counter()
        session = self.sessions.get(spec.tenant, spec.session_id, create=False)
        prompt, plan = (req.origin_input_ids, req.origin_input_ids_unpadded), None
        if session is not None and session.tokens:  # else a new session
            if session.extra_key not in (ANY_NAMESPACE, req.extra_key):
                # stored under another namespace (another KV-memory assembly, another client key):
                # its KV was computed in another context and must not be found from this one
                state.text_match = textmatch.DISCARD
            else:
                self.planner.match_text(scheduler, req, session, state)
                state.parts_ms["match"] = (time.perf_counter() - t0) * 1000
                if state.text_match != textmatch.DISCARD:
                    plan = self.planner.plan(req, session, state, "disk" if state.loaded else "memory")
        plan = self.planner.agree(req, prompt, plan, state)
        # a turn that waits for room is not passed over by the turns that come after it: their
        # restores queue behind it (restore_deferred goes in arrival order)
        if plan is not None and (self._waiting_for_room() or not self._bring_back(plan, state)):
            # restored before a later prefill batch: unpacked by then, or when the holds and the pool have room
            self._deferred[req] = plan.source
            if self._unpacker is None or not self._unpacker.running(req):
                DEFERRED.inc()
                # it waits for room from here: this admission's own time (the file, the match) is
                # its restore's (step_ms), not counted twice
                state.defer(time.perf_counter())
        state.step_ms += (time.perf_counter() - t0) * 1000

    def _bring_back(self, plan: Restore, state: PersistTurn, final: bool = False) -> bool:
        """Hold the request's reused prefix in the tree until it runs, restoring first what the tree
        lacks of it. False, with nothing held, when the holds have no room for it (`_room_to_hold`),
        the pool has no free slots for it while requests run or are held that will free some, or
        its restore was started on the unpack thread (it lands at a later step, `land`): the
        request then waits in the queue (restore_deferred). `final`: nothing runs or is held that
        would free slots, so a request the pool has no room for is served by prefill instead."""
        tree = self.tree
        if not self._room_to_hold(plan.reuse):
            return False
        if not plan.missing:
            tree.hold(plan.req, plan.match.last_device_node, plan.reuse)
            return True
        if not final and tree.room() < plan.missing:
            return False  # checked before reserving: a request that waits for slots evicts nothing
        have = plan.match.device_prefix_len
        reserved = tree_fill.reserve(tree, plan.key, plan.match, None if plan.live is None else plan.live[have:])
        if reserved is None:
            if not final:
                return False  # the requests that run (or are held) will give their slots back
            logger.warning(
                "session store: no free KV slots to restore %d tokens of session %r, and no request runs "
                "or is held that would free some; prefilling instead",
                plan.missing,
                state.session_id,
            )
            return True
        # a record is never changed in place (a turn makes a new one): it is read without the session's lock
        unpack = functools.partial(self._unpack, plan.record, have, plan.reuse, reserved)
        if self._unpacker is not None and not final:
            self._unpacker.start(plan.req, plan.reuse, (plan, reserved), unpack)
            return False
        try:
            state.parts_ms.update(unpack())
        except BaseException:
            tree_fill.release(tree, reserved)
            raise
        self._landed(plan, reserved, state)
        return True

    def _unpack(self, record: SessionRecord, start: int, stop: int, reserved: tree_fill.Reserved) -> dict[str, float]:
        """Dequantize the record's positions [start, stop) into the reserved slots; the time of each part."""
        t0 = time.perf_counter()
        keys, values = decode(self.files, self.tree, record, start, stop)
        t1 = time.perf_counter()
        tree_fill.write(self.tree, reserved, keys, values)
        return {"dequantize": (t1 - t0) * 1000, "pool_write": (time.perf_counter() - t1) * 1000}

    def _landed(self, plan: Restore, reserved: tree_fill.Reserved, state: PersistTurn) -> None:
        """The restored path goes into the tree, held for its request."""
        tree_fill.insert(self.tree, reserved)
        self.tree.hold(plan.req, self.tree.match(plan.key).last_device_node, plan.reuse)
        state.restored_tokens, state.restored_from = plan.missing, plan.source

    def land(self) -> None:
        """Insert the restores the unpack thread finished into the tree, each held for its request,
        whatever their requests' places in the queue: a finished restore's slots are the pool's
        again only through the tree. A restore that failed gives its slots back; its request is
        served by prefill."""
        if self._unpacker is None:
            return
        for job in self._unpacker.finished():
            plan, reserved = job.context
            state = self.turns.get(job.owner.rid)
            self._undefer(job.owner, state)
            try:
                parts = job.future.result()
            except Exception:
                logger.exception(
                    "session store: restoring session %r failed; prefilling instead",
                    state.session_id if state is not None else None,
                )
                tree_fill.release(self.tree, reserved)
                continue
            t0 = time.perf_counter()
            self._landed(plan, reserved, state)
            state.parts_ms.update(parts)
            state.off_step_ms += sum(parts.values())
            state.step_ms += (time.perf_counter() - t0) * 1000

    def _waiting_for_room(self) -> bool:
        """Some deferred request waits for room (not only for its own restore's unpacking)."""
        for req in self._deferred:
            state = self.turns.get(req.rid)
            if state is not None and state.deferred_since is not None:
                return True
        return False

    def _room_to_hold(self, tokens: int) -> bool:
        """Whether the holds take `tokens` more: within `hold_fraction` of the pool, or nothing is
        held (the first request waiting is never turned away). A restore being unpacked counts as
        held: it is, as soon as it lands."""
        held = self.tree.held_tokens() + (self._unpacker.tokens() if self._unpacker is not None else 0)
        return not held or held + tokens <= self.config.hold_fraction * self.tree.pool_tokens

    def restore_deferred(self, waiting: list[RequestView], running: bool) -> list[RequestView]:
        """Restore the deferred requests' KV, in the order they came, while the holds have room; the
        rest, and those being unpacked, wait out of this batch (so the scheduler does not prefill
        their histories): returned."""
        if not self._deferred:
            return []
        queued, back = set(waiting), []
        for req in list(self._deferred):
            state = self.turns.get(req.rid)
            if req not in queued or req.finished() or state is None:
                self.forget(req)  # aborted, or it left the queue another way
                continue
            if self._unpacker is not None and self._unpacker.running(req):
                back.append(req)
                continue
            if back or not self._room_to_hold(state.reuse):  # checked before any file is read
                back.append(req)  # in arrival order: none is restored past one still waiting
                continue
            t0 = time.perf_counter()
            session = self.sessions.get(state.tenant, state.session_id, create=False)
            ids = (req.origin_input_ids, req.origin_input_ids_unpadded)
            plan = self.planner.plan(req, session, state, self._deferred[req]) if session is not None else None
            plan = self.planner.agree(req, ids, plan, state)
            final = not running and not self.tree.held_tokens()
            if plan is not None and not self._bring_back(plan, state, final):
                back.append(req)  # no free slots yet, or its restore is being unpacked
                if self._unpacker is not None and self._unpacker.running(req):
                    self._waited(state, t0)  # its restore began at t0: from then on it waits for its own
                continue
            self._undefer(req, state, t0)
            state.step_ms += (time.perf_counter() - t0) * 1000
        return back

    def _undefer(self, req: RequestView, state: PersistTurn | None, since: float | None = None) -> None:
        """The request's restore waits no more (restored, or it left the queue): its wait counted."""
        self._deferred.pop(req, None)
        self._waited(state, since)

    @staticmethod
    def _waited(state: PersistTurn | None, since: float | None = None) -> None:
        """The request's wait for room ends (its restore runs, or it waits no more), at `since`
        (default now): a restore's own time from then on is its restore's, counted once."""
        if state is not None and state.deferred_since is not None:
            state.undefer(time.perf_counter() if since is None else since)
            DEFERRED_SECONDS.observe(state.deferred_ms / 1000)

    def forget(self, req: RequestView) -> None:
        """The request left the queue: a restore being unpacked for it ends and gives its slots back."""
        self._undefer(req, self.turns.get(req.rid))
        job = self._unpacker.abandon(req) if self._unpacker is not None else None
        if job is not None:
            tree_fill.release(self.tree, job.context[1])

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every restore started is unpacked; False if `timeout` passed first."""
        return self._unpacker is None or self._unpacker.settle(timeout)
