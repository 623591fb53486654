"""Edit admission: the entries API's passes (memart/writes.py) and text mode's read of a session's
turns (memart/text.py) on the scheduler side, and their answers."""

from __future__ import annotations

import torch

from sgl_memory.core.kvhost import namespace
from sgl_memory.core.views import RequestView
from sgl_memory.memart.pool import MemArtPool
from sgl_memory.memart.pools import SessionPools
from sgl_memory.memart.settings import MemArtConfig, MemArtRequest
from sgl_memory.memart.turns import MemArtTurn, Turns


class EntryEdits:
    """An entry write's or forget's pass: the session's book changes at its admission, in request
    order (a write's KV is its prompt, computed alone and recorded at release under its tag), and
    its answer is the book as it then stands. A `turns` pass (text mode's) changes nothing: its
    answer is the token ids the session's pool holds."""

    def __init__(self, pools: SessionPools, turns: Turns):
        self.pools, self.turns = pools, turns

    def admit(self, req: RequestView, owner: tuple[str, str], query: MemArtRequest) -> None:
        state = self.turns.set(req.rid, MemArtTurn(owner, query.mode, store=query.mode == "write"))
        # its own key: an entry's KV is its text's alone and must not be matched by another path
        req.extra_key = namespace(req.extra_key, f"memory-{query.mode}")
        if query.mode == "turns":  # a read (answered at release, `transcript`): one token, never stored
            req.skip_radix_cache_insert = True
            return
        memory = self.pools.session(owner, create=True)
        with memory.lock:
            if query.mode == "forget":
                for key in query.forget:
                    memory.drop_turns(memory.book.forget(key).stale)
            elif query.entry is not None:
                embedding = None if query.embedding is None else torch.tensor(query.embedding, dtype=torch.float32)
                change = memory.book.write(query.entry, list(req.origin_input_ids), embedding)
                memory.drop_turns(change.stale)
                state.tag = change.tag
            else:
                state.tag = ("joint", query.group, query.version)
        if query.mode == "forget":
            req.skip_radix_cache_insert = True

    @staticmethod
    def answer(memory: MemArtPool, req: RequestView) -> dict:
        """An entries pass's answer: the book as it stands, and the groups that just became static,
        with the tokens of their joint KV (the HTTP side sends that pass next, memart/writes.py)."""
        with memory.lock:
            out = memory.book.summary()
            out["due"] = [
                {"group": g.id, "version": g.version, "tokens": memory.book.joint_tokens(g)} for g in memory.book.due()
            ]
        out["prefill_tokens"] = len(req.origin_input_ids) - req.cached_tokens
        return {"memory_book": out}

    @staticmethod
    def transcript(memory: MemArtPool | None, config: MemArtConfig) -> dict:
        """A `turns` pass's answer: the token ids of every turn the session's pool holds, in order
        (text mode's lines come from them, memart/text.py)."""
        if memory is None:
            return {"memory_turns": []}
        memory.ingest(config.block_size)  # turns the worker has not added yet
        return {"memory_turns": [{"turn": turn, "ids": ids} for turn, ids in memory.transcript()]}
