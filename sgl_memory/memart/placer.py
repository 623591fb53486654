"""Placement: the chosen blocks into the radix tree under a key of their own, the prompt rewritten around them."""

from __future__ import annotations

import hashlib
import logging
from array import array

import torch

from sgl_memory.core import tree_fill
from sgl_memory.core.kvhost import KVHost, namespace
from sgl_memory.core.mechanism import repairer
from sgl_memory.core.requests import Lifetime
from sgl_memory.core.reuse import ReusedKV
from sgl_memory.core.rope import Rope
from sgl_memory.core.views import RequestView
from sgl_memory.memart.blocks import Block
from sgl_memory.memart.placement import assemble
from sgl_memory.memart.pool import MemArtPool
from sgl_memory.memart.queries import Probe
from sgl_memory.memart.settings import MemArtConfig, MemArtRequest
from sgl_memory.memart.turns import MemArtTurn

logger = logging.getLogger(__name__)


class Placer:
    """Places a retrieval's blocks: their KV (re-rotated, placement.assemble) into the tree under an
    extra key naming tenant, session and block set, the request's token ids rewritten to hold
    them, and, for a repair, the placed KV kept by request id for the repairer until release."""

    def __init__(self, config: MemArtConfig, tree: KVHost, rope: Rope):
        self.config, self.tree, self.rope = config, tree, rope
        # the KV placed for a request's repair, for the repairer, until the request's row is released
        self.placed = tree.requests.table("memory placed", Lifetime.ROW)

    def place(
        self,
        req: RequestView,
        state: MemArtTurn,
        memory: MemArtPool,
        blocks: list[Block],
        probe: Probe,
        query: MemArtRequest,
    ) -> None:
        """[system message] [blocks] [the rest of the prompt], a conversation's own order; or
        [blocks] [prompt] (MemArt's concatenation). Reused as placed (`recompute: none`), the
        blocks are a prefix hit; with a repair or a full recompute they are prefilled as part of
        the request, and only the system message comes from the tree."""
        prompt = list(req.origin_input_ids)
        units = memory.book.unit_turns()  # entries and static groups: placed whole, one segment each
        after_system = (query.placement or self.config.placement) == "after_system"
        system = probe.system_end if after_system and probe.system_kv is not None else 0
        memory_tokens = [t for b in blocks for t in b.tokens]
        tokens = prompt[:system] + memory_tokens
        if state.recompute == "starts" and not system and int(blocks[0].positions[0]) == 0:
            # the first block began its turn's prompt: its first token was computed at position 0,
            # the attention sink that `starts` restores, so the blocks are reused as placed
            state.recompute = "none"
        digest = hashlib.blake2b(array("q", [b.id for b in blocks]).tobytes(), digest_size=12).hexdigest()
        names = [state.owner[1], digest]
        placed = tokens
        if state.recompute != "none":
            # a full recompute of these blocks is the same KV for every request that places them
            # (their tokens in this order); a repair's depends on the request's turn too
            names += [state.recompute] + ([query.probe] if repairer(state.recompute) else [])
            placed = tokens[:system]
        extra_key = namespace(req.extra_key, "memory", *names)
        key = self.tree.key(placed, extra_key, req.cache_salt)
        match = self.tree.match(key)
        have = match.device_prefix_len
        if have < len(placed):
            if state.recompute != "none":
                keys, values = probe.system_kv.keys, probe.system_kv.values
            else:
                keys, values = assemble(blocks, self.rope, at=system)
                if system:
                    system_k, system_v = probe.system_kv.keys, probe.system_kv.values
                    keys, values = (
                        torch.cat([system_k.to(keys.dtype), keys], 1),
                        torch.cat([system_v.to(values.dtype), values], 1),
                    )
            if not tree_fill.place(self.tree, key, match, keys[:, have:], values[:, have:]):
                state.refused = "no free KV slots for the memory blocks"
                logger.warning(
                    "memory: no free KV slots for %d memory tokens of session %r; answering without memory",
                    len(placed),
                    state.owner[1],
                )
                return
        if repairer(state.recompute):
            keys, values = assemble(blocks, self.rope, at=system)
            lines = (query.unit or self.config.unit) == "line"  # a placed line is one segment
            placed_kv = ReusedKV(system, keys, values, memory.segments(blocks, units, lines), state.recompute)
            self.placed.set(req.rid, placed_kv)
        req.origin_input_ids = array("q", tokens + prompt[system:])
        req.origin_input_ids_unpadded = req.origin_input_ids
        # SGLang resolved the client's logprob_start_len against the prompt it sent (it also caps
        # the prefix match there): from the system message on, the prompt now sits after the blocks,
        # so input log-probabilities stay those of the client's own tokens
        if req.logprob_start_len >= system:
            req.logprob_start_len += len(tokens) - system
        req.extra_key = extra_key
        state.memory_start, state.memory_end, state.retrieved_blocks = system, len(tokens), len(blocks)
        if state.turn_start >= system:
            state.turn_start += len(memory_tokens)
        state.retrieved_turns = sorted(set().union(*(b.turns() for b in blocks)))
        state.retrieved_spans = [span for b in blocks for span in b.spans()]
        placed = {units[t] for b in blocks for t in b.turns() if t in units}
        if placed:
            state.units = {
                "retrieved_entries": sum(kind == "entry" for kind, _ in placed),
                "retrieved_static_groups": sum(kind == "joint" for kind, _ in placed),
            }
