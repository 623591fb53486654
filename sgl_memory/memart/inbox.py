"""A session pool's ingest inbox: finished turns waiting to be added, added one ingest at a time, in order."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# a submitted turn: tokens, positions, keys, values, tag (MemArtPool.submit)
Submitted = tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, "tuple | None"]


class Inbox:
    """The turns submitted to a pool and not added yet, oldest first, and the one ingest at a time
    that adds them, so turns stay in order whoever ingests (the memory worker, a retrieval)."""

    def __init__(self, lock: threading.Lock):
        self.lock = lock  # the pool's: it guards the queue with the blocks
        self.queue: deque[Submitted] = deque()
        self.ingesting = threading.Lock()  # one ingest at a time: turns stay in order

    def submit(self, turn: Submitted) -> None:
        with self.lock:
            self.queue.append(turn)

    def ingest(self, add: Callable[[list[int], torch.Tensor, torch.Tensor, torch.Tensor, tuple | None], None]) -> None:
        """add(tokens, positions, keys, values, tag) every submitted turn, in order: waiting for the
        turn another ingest is adding, then adding the rest here."""
        with self.ingesting:
            while True:
                with self.lock:
                    if not self.queue:
                        return
                    tokens, positions, keys, values, tag = self.queue.popleft()
                try:
                    add(tokens, positions, keys, values, tag)
                except Exception:  # one bad turn must not stop the session's others
                    logger.exception("memory: adding a turn failed")

    def busy(self) -> bool:
        return bool(self.queue) or self.ingesting.locked()
