"""Loading a session from its file when a turn opens: a session this server does not hold, or one
another server stored since this one last read or wrote it; at TP > 1 every rank loads or none."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sgl_memory.core import prometheus
from sgl_memory.persist.session import RANKS_DIFFER, PersistTurn, Session, Sessions
from sgl_memory.persist.store import SessionFiles, SessionRecord, StoreError

if TYPE_CHECKING:
    from sgl_memory.core.kvhost import KVHost

logger = logging.getLogger(__name__)

SUPERSEDED = prometheus.counter(
    "sessions_superseded", "Sessions reloaded from their file: another server stored them since"
)


class SessionLoader:
    """Loads a session's file, checked, into memory and the other mechanisms' state in it back to
    them, when a turn finds the session missing here or moved on in its file."""

    def __init__(self, tree: KVHost, files: SessionFiles, sessions: Sessions) -> None:
        self.tree, self.files, self.sessions = tree, files, sessions

    def open(self, state: PersistTurn, session: Session | None) -> None:
        """Before any mechanism admits the turn: load its session unless this server holds its
        newest stored turn. `session`: what this server holds of it (None: nothing)."""
        # each tensor-parallel rank reads its own file: every rank reloads where one must, or none
        _, (superseded, missing) = self.tree.rank_range(
            [session is not None and self._superseded(session), session is None]
        )
        if session is not None and (superseded or missing):
            if superseded:
                logger.info(
                    "session store: session %r (tenant %r) was stored by another server since this one last "
                    "did: reloading it",
                    state.session_id,
                    state.tenant,
                )
                SUPERSEDED.inc()
            self.sessions.drop(session.key())  # every mechanism's state of it is older than the file
            session = None
        if session is None:
            state.loaded = self._load(state) is not None

    def _superseded(self, session: Session) -> bool:
        """Whether the session's file holds a generation this server neither read nor wrote."""
        with session.lock:
            if session.pending or session.state_changed or not session.io.acquire(blocking=False):
                return False  # a turn of its own is being stored: that write checks the file instead
            try:
                current = self.files.generation(session.tenant, session.session_id)
            finally:
                session.io.release()
            return current > 0 and current != session.generation  # 0: no file (never written, or removed for the quota)

    def _load(self, state: PersistTurn) -> Session | None:
        """A session seen by an earlier server (or dropped from memory): its file, checked."""
        session = self.sessions.get(state.tenant, state.session_id, create=True)
        with session.lock, session.io:
            if session.tokens:  # another request of the session got here first
                return session
            record = self.read(state)
            if not self._every_rank_read_it(record, state):
                if record is not None:
                    session.generation = record.generation  # the next write replaces this file, not conflicts with it
                return None
            if record is None:
                return None
            session.adopt(record)
            session.on_disk, session.stored_bytes = True, self.files.size(state.tenant, state.session_id)
        self.tree.import_session(session.key(), record.state)
        record.state = {}  # the mechanisms hold it now; the warm tier keeps the path only
        return session

    def _every_rank_read_it(self, record: SessionRecord | None, state: PersistTurn) -> bool:
        """Whether every tensor-parallel rank read the same stored history (each its own file of
        it). A rank whose file lags (its write failed, or has not landed) or failed its checks
        makes every rank load none: ranks that held different paths or states would compute
        different batches."""
        low, high = self.tree.rank_range([record.history_digest() if record is not None else 0])
        if low == high:
            return True
        logger.error(
            "session store: the tensor-parallel ranks' files of session %r (tenant %r) hold different "
            "turns; loading none, the turn is served by normal prefill",
            state.session_id,
            state.tenant,
        )
        state.refused = RANKS_DIFFER
        return False

    def read(self, state: PersistTurn) -> SessionRecord | None:
        """The session's file, checked; a file that fails a check is refused (logged, reported)."""
        try:
            return self.files.read(state.tenant, state.session_id)
        except StoreError as exc:
            logger.error(
                "session store: refused the file of session %r (tenant %r): %s; the turn is served by normal prefill",
                state.session_id,
                state.tenant,
                exc,
            )
            state.refused = str(exc)
            return None
