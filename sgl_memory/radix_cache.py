"""The `sgl_memory` radix-cache backend: SGLang's Python RadixCache, the base of our memory features.

With every memory feature off it is SGLang's RadixCache unchanged (tests/test_radix_contract.py holds
it to that). Pruning, memory blocks and persistence attach here in later work, so that the tree stays
the single owner of reusable KV.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.radix_cache import RadixCache

from sgl_memory.config import MemoryConfig, from_env

logger = logging.getLogger(__name__)

BACKEND_NAME = "sgl_memory"


class SglMemoryRadixCache(RadixCache):
    def __init__(self, params, config: MemoryConfig | None = None):
        super().__init__(params)
        self.memory_config = config or MemoryConfig()


def build(ctx) -> SglMemoryRadixCache:
    """Factory for `register_radix_cache_backend` (receives SGLang's TreeCacheBuildContext)."""
    cache = SglMemoryRadixCache(ctx.params, from_env())
    logger.info("sgl-memory radix cache active (page_size=%d)", cache.page_size)
    return cache
