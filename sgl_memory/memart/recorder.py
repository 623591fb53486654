"""Recording: a session turn's KV copied off the KV pool into its session's pool, prompt and answer."""

from __future__ import annotations

import torch

from sgl_memory.core import tree_fill
from sgl_memory.core.kvhost import KVHost
from sgl_memory.core.views import RequestView
from sgl_memory.memart.pool import MemArtPool
from sgl_memory.memart.pools import SessionPools
from sgl_memory.memart.turns import MemArtTurn


class Recorder:
    """What a request adds to its session, recorded: the turn's prompt part copied at the end of
    its prefill, before intent (later by order) prunes the row, so what pruning drops stays
    recallable as KV; the answer copied off the tree at release; both submitted to the pool."""

    def __init__(self, tree: KVHost, pools: SessionPools):
        self.tree, self.pools = tree, pools

    def turn_start(self, state: MemArtTurn, memory: MemArtPool, tokens: list[int]) -> int:
        if state.mode == "record":
            # a full-history request: what the session's last one did not hold already
            return tree_fill.common_prefix(memory.path, tokens)
        if state.mode == "write":
            return 0  # the prompt is the entry's text
        # what it added after the last answer (admit): the history it carries was recorded when it
        # was new, and the system message and the placed blocks are not the turn
        return state.turn_start

    def checkpoint(self, req: RequestView, tree: KVHost, state: MemArtTurn | None) -> None:
        """Copy the turn's prompt part off the pool at the end of its prefill."""
        if state is None or not state.store or state.prompt_kv is not None:
            return
        if req.finished() or not req.output_ids or tree.disable:
            return  # not the end of the prefill
        prompt = list(req.origin_input_ids)
        start = self.turn_start(state, self.pools.session(state.owner, create=True), prompt)
        # a prefix matched from a pruned path may hold dead positions: the live mask leaves them out
        slots = tree.row(req)[start : len(prompt)].to(torch.int64)
        state.prompt_kv, state.prompt_kv_start = leave_out(tree_fill.copy_slots(tree, slots), start, state), start

    def record(self, req: RequestView, state: MemArtTurn, memory: MemArtPool) -> bool:
        """Submit the turn's KV to the pool (its worker or the caller adds it); False if none."""
        # tokens whose KV exists (the last output token has none), under the request's own key
        path = tree_fill.held_path(self.tree, req)
        prompt = list(req.origin_input_ids)
        if state.prompt_kv is not None:
            # the prompt as it was before pruning, then the answer off the tree (never pruned)
            start, kv, tokens = state.prompt_kv_start, state.prompt_kv, prompt
            if len(path) > len(prompt) and path.tokens[: len(prompt)] == prompt:
                tail = tree_fill.copy_path(self.tree, path, len(prompt))
                tokens = path.tokens
                kv = tree_fill.PathKV(
                    torch.cat([kv.keys, tail.keys], 1),
                    torch.cat([kv.values, tail.values], 1),
                    torch.cat([kv.live, tail.live]),
                )
            state.prompt_kv = None
        else:  # released before its prefill ended (aborted, or a prefill-only write): what the tree holds of it
            start, tokens = self.turn_start(state, memory, path.tokens), path.tokens
            kv = leave_out(tree_fill.copy_path(self.tree, path, start), start, state) if len(path) > start else None
        if state.mode == "record":
            memory.path = tokens
        if kv is None or len(tokens) <= start:
            return False
        if state.mode == "write" and len(tokens) > len(prompt):  # the entry is its text, not an answer
            n = len(prompt) - start
            tokens, kv = tokens[: len(prompt)], tree_fill.PathKV(kv.keys[:, :n], kv.values[:, :n], kv.live[:n])
        live = kv.live
        positions = torch.arange(start, len(tokens))[live]
        kept = [t for t, keep in zip(tokens[start:], live.tolist()) if keep]
        if kept:
            memory.submit(kept, positions, kv.keys[:, live], kv.values[:, live], state.tag)
        return bool(kept)


def leave_out(kv: tree_fill.PathKV, start: int, state: MemArtTurn) -> tree_fill.PathKV:
    """KV of positions from `start` without a text-mode request's placed lines (memart/text.py):
    they are the session's memory already, and recording them again would repeat them in it."""
    if state.text_span is not None:
        a, b = (max(0, p - start) for p in state.text_span)
        kv.live[a:b] = False
    return kv
