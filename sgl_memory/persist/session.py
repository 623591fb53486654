"""A session as persistence holds it in memory, this mechanism's sessions in the tree's registry, and
what persistence did for one request (its `PersistTurn`, in the tree's request store).

Each session has two locks: `lock` guards its in-memory state (capture, encode, restore),
`io` serialises its file writes and loads; different sessions proceed in parallel.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sgl_memory.core.sessions import session_key
from sgl_memory.persist.settings import AgentHints
from sgl_memory.persist.store import ANY_NAMESPACE, SessionFiles, SessionRecord

if TYPE_CHECKING:
    from sgl_memory.core.sessions import SessionKey, SessionRegistry

MAX_SESSIONS = 4096  # sessions whose token path is kept in memory; the rest are re-read from disk


@dataclass
class Captured:
    """One turn's path as copied off the pool at release: its KV from `start` (a block boundary)."""

    tokens: list[int]
    start: int
    keys: torch.Tensor
    values: torch.Tensor
    live: torch.Tensor | None  # of the whole path; None: every position is live
    branches: tuple[tuple[int, int], ...]
    extra_key: str | None


@dataclass
class Session:
    """One session's KV as this server holds it: its newest path, its stored form (the warm tier),
    the turns captured and not yet written, its file's state and when its next turn is expected."""

    tenant: str | None
    session_id: str
    tokens: list[int] = field(default_factory=list)  # newest known path (record + pending)
    text: str | None = None  # decode(tokens), computed when first needed
    live: torch.Tensor | None = None  # of `tokens`, as the record's
    branches: tuple[tuple[int, int], ...] = ()
    extra_key: str | None = ANY_NAMESPACE
    record: SessionRecord | None = None  # the warm tier; lags `tokens` while `pending` is not empty
    pending: list[Captured] = field(default_factory=list)
    state_changed: bool = False  # another mechanism's state of the session changed since the last write
    on_disk: bool = False
    generation: int = 0  # of the session's file as this server last read or wrote it (store.py)
    stored_bytes: int = 0  # of its file, as this server last wrote or read it (0: none on disk)
    error: str | None = None  # the last write's failure, reported at the session's next turn
    # when its next turn is expected (eviction by next use): its last turn's end (time.monotonic),
    # the gaps its turns came back after (a moving average), and the last turn's hints
    finished_at: float | None = None
    gap: float | None = None
    expected_at: float | None = None
    keep_until: float | None = None
    done: bool = False
    demoted: bool = False  # its last turn's hint: not back soon (leaves the pool and host memory first)
    prefetched: int = 0  # tokens brought back before its next turn arrived (prefetch), reported by that turn
    lock: threading.Lock = field(default_factory=threading.Lock)
    io: threading.Lock = field(default_factory=threading.Lock)

    def adopt(self, record: SessionRecord) -> None:
        self.tokens, self.text, self.record = record.token_ids, record.text, record
        self.live, self.branches, self.extra_key = record.live, record.branches, record.extra_key
        self.generation = record.generation

    def key(self) -> SessionKey:
        return session_key(self.tenant, self.session_id)

    def encode_pending(self, files: SessionFiles) -> None:
        """Fold the captured turns into the stored form; caller holds session.lock."""
        for c in self.pending:
            self.record = files.continued(
                self.record,
                c.tokens,
                c.start,
                c.keys,
                c.values,
                extra_key=c.extra_key,
                branches=c.branches,
                live=c.live,
            )
        self.pending.clear()


class Sessions:
    """This mechanism's sessions in the tree's session registry: found or made by (tenant, id),
    listed least recently used first, and which of them must stay in memory."""

    def __init__(self, registry: SessionRegistry, name: str) -> None:
        self.registry, self.name = registry, name
        # a session stays in memory while it holds turns that are nowhere else (not yet written, or
        # a write failed); the rest are re-read from disk when they come back
        registry.limit(
            name,
            MAX_SESSIONS,
            keep=lambda s: bool(s.pending) or s.state_changed or (bool(s.tokens) and not s.on_disk),
        )

    def get(self, tenant: str | None, session_id: str, create: bool) -> Session | None:
        make = (lambda: Session(tenant, session_id)) if create else None
        return self.registry.get(session_key(tenant, session_id), self.name, make)

    def all(self) -> list[Session]:
        """Every session held, least recently used first (a snapshot)."""
        return [session for _, session in self.registry.states(self.name)]

    def drop(self, key: SessionKey) -> None:
        """Forget the session: every mechanism's state of it (SessionRegistry.drop)."""
        self.registry.drop(key)


@dataclass
class PersistTurn:
    """What persistence did for one request, kept in its `turns` table (SessionPersistence)."""

    tenant: str | None
    session_id: str
    text_match: str | None = None
    restored_tokens: int = 0
    step_ms: float = 0.0  # the scheduler thread's time on the restore (every request waited for it)
    off_step_ms: float = 0.0  # the unpack thread's (dequantizing and the pool write, at TP 1)
    # where the restore's time went: the file (read and checked), the text match, dequantizing, the pool write
    parts_ms: dict[str, float] = field(default_factory=dict)
    restored_from: str | None = None
    refused: str | None = None
    reuse: int = 0  # stored tokens the (possibly rewritten) prompt repeats
    loaded: bool = False  # this request loaded the session from its file
    assembled: bool = (
        False  # a prompt assembled by a mechanism (MemorySpec.assembled): its path is not the session's history
    )
    reads_only: bool = False  # a pass that changes nothing (MemorySpec.reads_only): loads, never writes
    hints: AgentHints | None = None  # sgl_memory.agent: when the session's next turn comes
    prefetched_tokens: int = 0  # of the session's KV brought back before this turn arrived
    # how long its restore waited for room (deferred at admission, until restored or given up): the
    # part of a slow turn's wait that is the holds' or the pool's, not its own restore's
    deferred_since: float | None = None
    deferred_ms: float = 0.0
    # where the rest of its wait for its first token went (`waited`): queued behind other requests
    # (neither its restore nor its wait for room) and its own prefill; None until it is known
    opened_at: float = field(default_factory=time.perf_counter)  # when persistence first saw it
    queued_ms: float | None = None
    prefill_ms: float | None = None

    def defer(self, now: float) -> None:
        if self.deferred_since is None:
            self.deferred_since = now

    def undefer(self, now: float) -> None:
        if self.deferred_since is not None:
            self.deferred_ms += (now - self.deferred_since) * 1000
            self.deferred_since = None

    @property
    def restore_ms(self) -> float:
        """Its restore's time, on the scheduler's step and the unpack thread's (0: nothing restored)."""
        return self.step_ms + self.off_step_ms if self.restored_tokens else 0.0

    def waited(self, time_stats: object) -> None:
        """Split its time from admission to its first token with SGLang's stamps of its first forward
        and its prefill's end (perf_counter, this process's clock, as `opened_at`): what its restore's
        wait for room and its restore did not take of the time before its first forward was queued."""
        entered = getattr(time_stats, "forward_entry_time", 0.0)
        finished = getattr(time_stats, "prefill_finished_time", 0.0)
        if not entered or not finished:
            return  # it never ran (aborted while queued)
        self.queued_ms = max(0.0, (entered - self.opened_at) * 1000 - self.deferred_ms - self.restore_ms)
        self.prefill_ms = (finished - entered) * 1000

    def metrics(self, error: str | None) -> dict:
        return {
            "text_match": self.text_match,
            "restored_tokens": self.restored_tokens,
            "restore_ms": round(self.restore_ms, 3),
            "restore_step_ms": round(self.step_ms, 3) if self.restored_tokens else 0.0,
            "restored_from": self.restored_from,
            "prefetched_tokens": self.prefetched_tokens,
            "restore_deferred_ms": round(self.deferred_ms, 3),
            "queued_ms": None if self.queued_ms is None else round(self.queued_ms, 3),
            "turn_prefill_ms": None if self.prefill_ms is None else round(self.prefill_ms, 3),
            "restore_parts_ms": {k: round(v, 3) for k, v in self.parts_ms.items()} if self.restored_tokens else None,
            "persist_refused": self.refused,
            "persist_error": error,
        }


# why a turn loaded or restored nothing at TP > 1: the ranks' files (or the paths they matched) differ
RANKS_DIFFER = "the tensor-parallel ranks' copies of the session differ"
