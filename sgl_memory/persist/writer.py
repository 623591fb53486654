"""Writing sessions: a turn's KV captured off the pool at release (scheduler thread), then encoded
into the stored form and written to the session's file on a writer thread, within the quota."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sgl_memory.core import mechanism, prometheus, tree_fill
from sgl_memory.core.worker import Worker
from sgl_memory.persist.next_use import NextUse
from sgl_memory.persist.session import Captured, PersistTurn, Session, Sessions
from sgl_memory.persist.settings import PersistConfig
from sgl_memory.persist.store import SessionFiles, SessionRecord, StoreError, WriteConflict
from sgl_memory.persist.textmatch import TextCodec
from sgl_memory.persist.warm import WarmTier

if TYPE_CHECKING:
    from sgl_memory.core.kvhost import KVHost
    from sgl_memory.core.views import RequestView

logger = logging.getLogger(__name__)

WRITE_ERRORS = prometheus.counter("write_errors", "Session file writes that failed")
WRITE_CONFLICTS = prometheus.counter(
    "write_conflicts", "Session turns not stored: another server stored the session meanwhile"
)
STORE_BYTES = prometheus.gauge("store_bytes", "Session files on disk")


class Writer:
    """Captures each turn's KV that the stored record lacks at release, and on its own thread
    encodes it, writes the session's file (with the other mechanisms' state of the session) and
    keeps the store within `quota_bytes`."""

    def __init__(
        self,
        config: PersistConfig,
        tree: KVHost,
        files: SessionFiles,
        sessions: Sessions,
        text: TextCodec,
        next_use: NextUse,
        warm: WarmTier,
        owner: mechanism.Mechanism,
    ) -> None:
        self.config, self.tree, self.files, self.sessions = config, tree, files, sessions
        self.text, self.next_use, self.warm = text, next_use, warm
        self.owner = owner  # the mechanism whose file this is: its own state is not exported into it
        self._worker = Worker(
            "sgl-memory-persist", self._write, lambda s: f"session {s.session_id!r} (tenant {s.tenant!r})"
        )

    def probe(self) -> None:
        """Say at start-up when the store cannot be written (the server serves anyway)."""
        try:
            self.files.root.mkdir(parents=True, exist_ok=True)
            probe = self.files.root / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            logger.error(
                "session store %s is not writable (%s): sessions are kept in memory only and every "
                "write is retried and reported; the server keeps serving",
                self.files.root,
                exc,
            )

    def capture(self, req: RequestView, state: PersistTurn, session: Session) -> None:
        """Capture the turn: the KV of the request's path that the stored record lacks, off the pool
        now (the slots are the tree's to evict), encoded and written by the worker."""
        if self.config.write_policy == "off" or self.tree.disable or state.reads_only:
            return
        if state.assembled:
            # its path is assembled (recalled blocks before a new turn), not the session's history:
            # the stored path stays, and what the turn changed in the other mechanisms is written
            with session.lock:
                session.state_changed = True
            self._worker.submit(session)
            return
        path = tree_fill.held_path(self.tree, req)
        if not len(path):
            return
        self.next_use.expect(path.node, session)
        live = tree_fill.path_live(self.tree, path)
        live = None if bool(live.all()) else live
        with session.lock:
            same = self._same_prefix(session, path, live, req.extra_key)
            if same == len(path) == len(session.tokens):
                return
            start = same // self.files.block_size * self.files.block_size
            kv = tree_fill.copy_path(self.tree, path, start, as_stored=True)
            session.pending.append(Captured(path.tokens, start, kv.keys, kv.values, live, path.branches, req.extra_key))
            session.tokens, session.text, session.live, session.branches, session.extra_key = (
                path.tokens,
                None,
                live,
                path.branches,
                req.extra_key,
            )
        self._worker.submit(session)

    def _same_prefix(
        self, session: Session, path: tree_fill.HeldPath, live: torch.Tensor | None, extra_key: str | None
    ) -> int:
        """How many leading positions of the stored path the new one holds with the same KV (same
        namespace, tokens, branches and live mask), so only the rest is copied and encoded again."""
        if (session.record is None and not session.pending) or session.extra_key != extra_key:
            return 0
        if session.record is not None and (session.record.quant, session.record.kivi) != (
            self.config.quant,
            self.config.kivi,
        ):
            return 0  # written with other settings: re-encode all of it
        same = tree_fill.common_prefix(session.tokens, path.tokens)
        differ = set(session.branches) ^ set(path.branches)  # the keys part at the first branch not shared
        if differ:
            same = min(same, min(pos for pos, _ in differ))
        if session.live is not None or live is not None:
            old = session.live[:same] if session.live is not None else torch.ones(same, dtype=torch.bool)
            new = live[:same] if live is not None else torch.ones(same, dtype=torch.bool)
            differ = torch.nonzero(old != new).flatten()
            same = int(differ[0]) if differ.numel() else same
        return same

    def _write(self, session: Session) -> None:
        """The writer thread's work for one session: its captured turns encoded, its file written."""
        with session.lock:
            if not session.pending and not session.state_changed:
                return  # an earlier queue entry of this session wrote it already
            session.state_changed = False
            session.encode_pending(self.files)
            if session.record is None and session.tokens:  # the warm tier dropped the path: it is on disk
                with session.io:
                    try:
                        session.record = self.files.read(session.tenant, session.session_id)
                    except StoreError as exc:
                        logger.error(
                            "session store: cannot re-read session %r (tenant %r) to write its state: %s",
                            session.session_id,
                            session.tenant,
                            exc,
                        )
                        return
            if session.record is None:  # a session of memory-mode turns only: its state, no path
                session.record = SessionRecord([], "", [], self.config.quant, self.config.kivi, self.files.block_size)
            record = session.record
            record.text = self.text.decode(record.token_ids) if self.text.tokenizer is not None else ""
            # what the other mechanisms hold for the session now (this turn's included: release
            # runs them first, by order, or their state changed before the turn ended)
            record.state, record.state_kv = self.tree.export_session(session.key(), skip=self.owner)
            if session.tokens is record.token_ids:  # no newer turn: the next admission needs this text
                session.text = record.text
        with session.io:
            try:
                self.files.write(session.tenant, session.session_id, record, base=session.generation)
                session.generation = record.generation
            except WriteConflict as exc:
                WRITE_CONFLICTS.inc()
                logger.warning(
                    "session store: %s: this turn of session %r (tenant %r) is not stored; its next turn "
                    "continues from the stored one",
                    exc,
                    session.session_id,
                    session.tenant,
                )
                return
            except OSError as exc:
                WRITE_ERRORS.inc()
                session.error = f"writing the session file failed: {exc}"
                logger.error(
                    "session store: %s (session %r, tenant %r); it stays in memory, the server keeps serving",
                    session.error,
                    session.session_id,
                    session.tenant,
                )
                return
            finally:
                record.state, record.state_kv = {}, {}  # the mechanisms hold it; the warm tier keeps the path only
        session.on_disk, session.error = True, None
        session.stored_bytes = self.files.size(session.tenant, session.session_id)
        for path in self.files.enforce_quota(self.config.quota_bytes):
            logger.info("session store: quota %d bytes: removed %s", self.config.quota_bytes, path.name)
            for other in self.sessions.all():
                if self.files.path(other.tenant, other.session_id) == path:
                    other.on_disk, other.stored_bytes = False, 0
        STORE_BYTES.set(self.files.disk_bytes)
        self.warm.trim()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every captured turn is written; False if `timeout` passed first."""
        return self._worker.drain(timeout)
