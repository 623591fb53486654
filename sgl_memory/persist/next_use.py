"""When a session's next turn is expected, for eviction by next use: learned from the gaps its turns
came back after and from its last turn's hints, and given to the tree as the order of its path."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from sgl_memory.core import prometheus
from sgl_memory.persist.session import Session
from sgl_memory.persist.settings import AgentHints, PersistConfig

if TYPE_CHECKING:
    from sgl_memory.core.kvhost import KVHost

NEXT_USE_ERROR = prometheus.histogram(
    "next_use_error_seconds", "How far a session's turn came from when it was expected (hints or learned gaps)"
)


class NextUse:
    """Predicts each session's next use: learns the gaps its turns come back after (and the
    server's), reads its last turn's hints, and orders its path in the tree by it."""

    GAP_WEIGHT = 0.5  # of the newest gap in a session's moving average (the server's: the same)

    def __init__(self, config: PersistConfig, tree: KVHost) -> None:
        self.config, self.tree = config, tree
        self.gap: float | None = None  # the gaps every session's turns came back after (a moving average)

    def came_back(self, session: Session) -> bool:
        """A turn of the session arrived: learn the gap it came back after. False when no turn of it
        had ended (nothing to learn)."""
        if session.finished_at is None:
            return False
        now = time.monotonic()
        predicted = None if session.done or session.demoted else self.expected(session)
        if predicted is not None:
            NEXT_USE_ERROR.observe(abs(now - predicted))
        gap = now - session.finished_at
        session.gap = gap if session.gap is None else self.GAP_WEIGHT * gap + (1 - self.GAP_WEIGHT) * session.gap
        self.gap = gap if self.gap is None else self.GAP_WEIGHT * gap + (1 - self.GAP_WEIGHT) * self.gap
        session.finished_at = session.expected_at = session.keep_until = None
        session.done = session.demoted = False
        return True

    def finished(self, session: Session, hints: AgentHints | None) -> None:
        """A turn of the session ended: its hints say when the next comes (or that none does)."""
        now = time.monotonic()
        session.finished_at, session.expected_at, session.keep_until = now, None, None
        session.done = session.demoted = False
        if hints is not None:
            if hints.expected_tool_duration_ms is not None:
                session.expected_at = now + hints.expected_tool_duration_ms / 1000
            if hints.cache_ttl_ms is not None:
                session.keep_until = now + min(hints.cache_ttl_ms, self.config.max_keep_ms) / 1000
            session.done, session.demoted = bool(hints.done), bool(hints.demote)

    def expected(self, session: Session) -> float | None:
        """When the idle session's next turn is expected (time.monotonic): its last turn's hint,
        else, with `eviction: learned`, that turn's end plus the gaps its turns came back after
        (this session's, else the server's); None when nothing says."""
        if session.expected_at is not None:
            return session.expected_at
        if self.config.eviction != "learned":
            return None
        gap = session.gap if session.gap is not None else self.gap
        return session.finished_at + gap if gap is not None and session.finished_at is not None else None

    def next_use(self, session: Session, now: float) -> float:
        """The eviction order's next use (NextUseStrategy): now while a turn of it runs or a keep-for
        lasts; inf for a session that is done or demoted; when it is expected, and a session expected back
        already and not back yet as that much later; without any expectation, as far ahead as its
        last use is behind (LRU)."""
        if session.finished_at is None or (session.keep_until is not None and now < session.keep_until):
            return now
        if session.done or session.demoted:
            return math.inf
        when = self.expected(session)
        if when is None:
            return 2 * now - session.finished_at
        return when if when >= now else 2 * now - when

    def expect(self, node: object, session: Session) -> None:
        """The tree orders the session's path ending at `node` by its next use (unless `last_use`)."""
        if self.config.eviction != "last_use":
            self.tree.expect(node, lambda now: self.next_use(session, now))
