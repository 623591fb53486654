"""The background worker of a mechanism: work that must not run on the scheduler's thread.

Persistence encodes and writes session files; KV memory removes the rotation of a turn's keys and
cuts them into blocks. Both take items in order on one daemon thread, survive a failing item, and
let flush_cache wait until everything submitted so far is done.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Worker:
    """One daemon thread that runs a mechanism's submitted items in order, survives a failing item
    and lets a caller wait until every item submitted so far is done (`drain`)."""

    def __init__(self, name: str, work: Callable[[object], None], describe: Callable[[object], str] = repr):
        self.name, self._work, self._describe = name, work, describe
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._queued = 0
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, item: Any) -> None:
        with self._idle:
            self._queued += 1
        self._queue.put(item)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every item submitted so far is done; False if `timeout` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                self._work(item)
            except Exception:  # the worker must outlive any one item's failure
                logger.exception("%s: failed on %s", self.name, self._describe(item))
            finally:
                with self._idle:
                    self._queued -= 1
                    self._idle.notify_all()
