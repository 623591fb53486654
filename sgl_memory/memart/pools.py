"""The scheduler's session pools: made on first use, bounded together by memory.pool_bytes, fed by one worker."""

from __future__ import annotations

import logging

import torch

from sgl_memory.core import prometheus
from sgl_memory.core.kvhost import KVHost
from sgl_memory.core.rope import Rope
from sgl_memory.core.worker import Worker
from sgl_memory.memart.entries import ALONE, EntryBook
from sgl_memory.memart.pool import MemArtPool
from sgl_memory.memart.settings import MemArtConfig

logger = logging.getLogger(__name__)

MAX_SESSIONS = 1024  # session pools kept; the least recently used beyond are dropped

# Prometheus series (scheduler process: the pools)
POOL_BYTES = prometheus.gauge("memory_pool_bytes", "Host memory of the KV memory pools")
POOL_BLOCKS = prometheus.gauge("memory_pool_blocks", "Blocks in the KV memory pools")
POOL_TOKENS = prometheus.gauge("memory_pool_tokens", "Tokens stored in the KV memory pools")


class SessionPools:
    """Every session's `MemArtPool`, kept in the tree's session registry under the mechanism's
    name (`MAX_SESSIONS` at most): made on first use with the config's shape, all of them within
    `memory.pool_bytes`, their turns added off the request's path by one worker thread, their
    gauges, and what persistence stores of them (export, import, describe)."""

    def __init__(self, config: MemArtConfig, tree: KVHost, rope: Rope, layers: int, name: str):
        self.config, self.tree, self.rope, self.layers, self.name = config, tree, rope, layers, name
        tree.sessions.limit(name, MAX_SESSIONS, keep=lambda pool: pool.busy())
        self.line_ends: frozenset[int] | None = None  # memory.cut lines: from the tokenizer, at the first request
        self._worker = Worker("sgl-memory-memart", self._work, lambda m: f"a session memory of {len(m.blocks)} blocks")

    def session(self, owner: tuple[str, str], create: bool) -> MemArtPool | None:
        # grouping off: no entry reaches the threshold, so each is a group of its own and never static
        book = lambda: EntryBook(self.config.group_threshold if self.config.groups else ALONE, self.config.static_after)  # noqa: E731
        make = (
            (
                lambda: MemArtPool(
                    self.config.capacity_blocks,
                    self.config.eviction,
                    self.config.block_size,
                    rope=self.rope,
                    score_layers=self.layers,
                    book=book(),
                    norm_ties=self.tree.tp_size == 1,
                )
            )
            if create
            else None
        )
        pool = self.tree.sessions.get(owner, self.name, make)
        if pool is not None:
            pool.line_ends = self.line_ends
        return pool

    def submit(self, memory: MemArtPool) -> None:
        """Have the worker add the pool's submitted turns."""
        self._worker.submit(memory)

    def drain(self, timeout: float | None = None) -> bool:
        return self._worker.drain(timeout)

    def _work(self, memory: MemArtPool) -> None:
        memory.ingest(self.config.block_size)
        self.bound(memory)

    def bound(self, current: MemArtPool) -> None:
        """All pools together within memory.pool_bytes: the least recently used sessions' pools are
        dropped whole; if the session just added to is still over, its own blocks are evicted by policy."""
        pools = self.tree.sessions.states(self.name)
        total = sum(pool.bytes for _, pool in pools)
        for owner, pool in pools:
            if total <= self.config.pool_bytes:
                break
            if pool is not current and not pool.busy():
                self.tree.sessions.pop(owner, self.name)
                total -= pool.bytes
                logger.info(
                    "memory: pool_bytes %d reached: dropped the memory of session %r", self.config.pool_bytes, owner[1]
                )
        if total > self.config.pool_bytes:
            current.trim(max(0, current.bytes - (total - self.config.pool_bytes)))
        pools = [pool for _, pool in self.tree.sessions.states(self.name)]
        POOL_BYTES.set(sum(m.bytes for m in pools))
        POOL_BLOCKS.set(sum(len(m.blocks) for m in pools))
        POOL_TOKENS.set(sum(m.tokens for m in pools))

    # --- the session's pool, kept with the session by persistence ---------------------------------

    def export(self, key: tuple[str, str]) -> dict[str, torch.Tensor]:
        memory = self.session(key, create=False)
        if memory is None:
            return {}
        memory.ingest(self.config.block_size)  # turns still queued belong to it
        return memory.export()

    @staticmethod
    def describe(state: MemArtPool) -> dict:
        with state.lock:
            return {
                "memory_turns": state.turns,
                "memory_blocks": len(state.blocks),
                "memory_tokens": state.tokens,
                "memory_bytes": state.bytes,
            }

    def load(self, key: tuple[str, str], tensors: dict[str, torch.Tensor]) -> None:
        memory = self.session(key, create=True)
        if not memory.blocks and not memory.turns:
            memory.load(tensors)
            self.bound(memory)


def line_ends(tokenizer: object) -> frozenset[int]:
    """The token ids whose text ends a line (memory.cut lines)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return frozenset(i for i, text in enumerate(texts) if text.endswith("\n"))
