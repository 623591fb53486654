"""The warm tier's bound: sessions' stored form (token ids + encoded blocks) in host memory, up to
`warm_bytes`, those whose hints said done or demote dropped first, then least recently used, and only
once it is on disk."""

from __future__ import annotations

from sgl_memory.core import prometheus
from sgl_memory.persist.session import Sessions
from sgl_memory.persist.settings import PersistConfig

WARM_BYTES = prometheus.gauge("store_warm_bytes", "Stored-form session KV in host memory")


class WarmTier:
    """Keeps the stored form held in host memory within `warm_bytes`."""

    def __init__(self, config: PersistConfig, sessions: Sessions) -> None:
        self.config, self.sessions = config, sessions

    def trim(self) -> int:
        """Drop the stored form of sessions that are safely on disk (done or demoted ones first, then
        the least recently used); returns
        the bytes of stored form left in memory (also the `store_warm_bytes` gauge)."""
        # a stable sort: the sessions' own order (least recently used first) within each group
        sessions = sorted(self.sessions.all(), key=lambda s: not (s.done or s.demoted))
        total = sum(s.record.nbytes() for s in sessions if s.record is not None)
        for session in sessions:
            if total <= self.config.warm_bytes:
                break
            if session.record is not None and session.on_disk and session.lock.acquire(blocking=False):
                try:
                    if not session.pending:
                        total -= session.record.nbytes()
                        session.record = None
                finally:
                    session.lock.release()
        WARM_BYTES.set(total)
        return total
