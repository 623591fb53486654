"""Prefetch: the KV of a session whose hint says its tool returns within `prefetch_ms` is brought
back into the tree before its next turn arrives, once, when the pool has room."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sgl_memory.core import prometheus, tree_fill
from sgl_memory.persist.next_use import NextUse
from sgl_memory.persist.restorer import decode
from sgl_memory.persist.session import Session
from sgl_memory.persist.settings import PersistConfig
from sgl_memory.persist.store import ANY_NAMESPACE, SessionFiles, StoreError

if TYPE_CHECKING:
    from sgl_memory.core.kvhost import KVHost
    from sgl_memory.core.sessions import SessionKey

PREFETCHED_TOKENS = prometheus.counter(
    "prefetched_tokens", "Session KV tokens brought back before their turn arrived (agent hints)"
)


class Prefetch:
    """Keeps the sessions a hint says come back at a time, and brings each one's stored path back
    into the tree just before (from the warm tier or its file), ordered for eviction by next use."""

    def __init__(self, config: PersistConfig, tree: KVHost, files: SessionFiles, next_use: NextUse) -> None:
        self.config, self.tree, self.files, self.next_use = config, tree, files, next_use
        # sessions a hint says come back at a time: their KV is brought back just before (run)
        self._expected_back: dict[SessionKey, Session] = {}

    def watch(self, session: Session) -> None:
        """A turn of the session ended: if its hint says when the next comes, bring it back then.
        Off at TP > 1: the ranks' clocks would not decide it at the same step."""
        if session.expected_at is not None and self.config.prefetch_ms > 0 and self.tree.tp_size == 1:
            self._expected_back[session.key()] = session

    def unwatch(self, session: Session) -> None:
        """A turn of the session arrived: nothing to bring back for it."""
        self._expected_back.pop(session.key(), None)

    def run(self) -> None:
        """Bring back the KV of each session whose hint says it returns within `prefetch_ms`, once,
        if the tree lacks it and the pool has room; it is then ordered for eviction by its expected
        return, which is about now. Its next turn then finds it in the tree (`prefetched_tokens`)."""
        if not self._expected_back:
            return
        now = time.monotonic()
        for key, session in list(self._expected_back.items()):
            if session.expected_at is None or session.finished_at is None:
                self._expected_back.pop(key)
            elif session.expected_at - self.config.prefetch_ms / 1000 <= now:
                self._expected_back.pop(key)
                session.prefetched = self._bring_back_idle(session)
                PREFETCHED_TOKENS.inc(session.prefetched)

    def _bring_back_idle(self, session: Session) -> int:
        """Restore an idle session's stored path into the tree (whole pages); the tokens restored."""
        tree = self.tree
        with session.lock:
            tokens, live, branches, extra_key = session.tokens, session.live, session.branches, session.extra_key
        n = len(tokens) - len(tokens) % tree.page_size
        if not n or extra_key == ANY_NAMESPACE or (tree.sentinel is None and (branches or live is not None)):
            return 0  # no path, or one only a pruning server restores: left to its turn's admission
        key = tree.key(tokens[:n], extra_key, None, branches)
        match = tree.match(key)
        have = match.device_prefix_len
        if have >= n or tree.room() < n - have:
            return 0
        with session.lock:
            record = session.record
        if record is None:
            try:
                with session.io:
                    record = self.files.read(session.tenant, session.session_id)
            except StoreError:
                return 0  # the turn's admission reads it again, and refuses it with the reason
        if record is None:
            return 0  # no file yet (its turn is still being written) or no more (the quota dropped it)
        if record.token_ids[:n] != list(tokens[:n]) or record.branches != branches:
            return 0
        keys, values = decode(self.files, self.tree, record, have, n)
        if not tree_fill.place(tree, key, match, keys, values, None if live is None else live[have:n]):
            return 0
        self.next_use.expect(tree.match(key).last_device_node, session)
        return n - have
