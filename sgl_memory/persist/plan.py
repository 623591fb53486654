"""Deciding a restore at admission: what of the session's stored path the request's prompt reuses
(matched as text, the prompt possibly rewritten), where its KV is, and the same on every TP rank."""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_memory.core import tree_fill
from sgl_memory.core.sessions import digest63
from sgl_memory.persist import textmatch
from sgl_memory.persist.loader import SessionLoader
from sgl_memory.persist.session import RANKS_DIFFER, PersistTurn, Session
from sgl_memory.persist.settings import PersistConfig
from sgl_memory.persist.store import SessionFiles, SessionRecord

if TYPE_CHECKING:
    from sgl_memory.core.kvhost import KVHost
    from sgl_memory.core.views import RequestView, SchedulerView

logger = logging.getLogger(__name__)


@dataclass
class Restore:
    """A restore decided, not done: the request's first `reuse` tokens, of which the tree holds
    what `match` found; the rest is decoded from `record` when it is placed."""

    req: object
    key: object
    match: object
    reuse: int
    record: SessionRecord | None  # None: the tree holds all of it (hot), nothing to decode
    live: torch.Tensor | None  # of the first `reuse` positions
    branches: tuple[tuple[int, int], ...]
    source: str

    @property
    def missing(self) -> int:
        return max(0, self.reuse - self.match.device_prefix_len)

    def cut(self, tree: KVHost, reuse: int) -> Restore:
        """The same restore of the first `reuse` tokens only."""
        branches = tuple(b for b in self.branches if b[0] < reuse)
        key = tree.key(self.req.origin_input_ids[:reuse], self.req.extra_key, self.req.cache_salt, branches)
        live = None if self.live is None else self.live[:reuse]
        return Restore(self.req, key, self.match, reuse, self.record, live, branches, self.source)


class Planner:
    """Decides what of a session's stored path a request reuses and where that KV is (the tree,
    the warm tier or the session's file), agreed among the tensor-parallel ranks."""

    def __init__(
        self,
        config: PersistConfig,
        tree: KVHost,
        files: SessionFiles,
        text: textmatch.TextCodec,
        loader: SessionLoader,
    ) -> None:
        self.config, self.tree, self.files, self.text, self.loader = config, tree, files, text, loader

    def match_text(self, scheduler: SchedulerView, req: RequestView, session: Session, state: PersistTurn) -> None:
        if self.text.tokenizer is None:
            return  # --skip-tokenizer-init: token-level reuse only
        stored = session.tokens
        if session.text is None:
            session.text = self.text.decode(stored)
        prompt = list(req.origin_input_ids)
        result = textmatch.match(
            stored,
            session.text,
            prompt,
            self.text.decode(prompt),
            self.text.decode,
            self.text.encode,
            self.config.match_threshold,
        )
        state.text_match = result.outcome
        limit = getattr(scheduler, "max_req_input_len", None)
        if result.input_ids != prompt and not req.return_logprob and (limit is None or len(result.input_ids) <= limit):
            req.origin_input_ids = array("q", result.input_ids)
            req.origin_input_ids_unpadded = req.origin_input_ids
        ids = list(req.origin_input_ids)
        state.reuse = (
            result.reuse if ids[: result.reuse] == stored[: result.reuse] else tree_fill.common_prefix(stored, ids)
        )

    def plan(self, req: RequestView, session: Session, state: PersistTurn, source: str) -> Restore | None:
        """What of the session's path the request reuses, and where its KV is: the tree (hot) or the
        session's record (warm, or read from its file now); None when the stored path does not
        match."""
        tree = self.tree
        reuse = state.reuse - state.reuse % tree.page_size
        if reuse <= 0:
            return None
        with session.lock:
            stored, live = session.branches, session.live
        branches = stored
        key = tree.key(req.origin_input_ids[:reuse], req.extra_key, req.cache_salt, branches)
        match = tree.match(key)  # (re)takes the sentinel of a pruning tree
        if tree.sentinel is None and (branches or live is not None):
            # a pruned path past its first branch is only found by a pruning request, which this
            # server does not serve; before it the path is a plain one
            dead = torch.nonzero(~live).flatten() if live is not None else torch.zeros(0)
            reuse = min([reuse] + [pos for pos, _ in branches[:1]] + [int(d) for d in dead[:1]])
            branches, live = (), None
            key = tree.key(req.origin_input_ids[:reuse], req.extra_key, req.cache_salt)
            match = tree.match(key)
        if match.device_prefix_len >= reuse:
            return Restore(req, key, match, reuse, None, live, branches, source)  # hot: the tree holds it
        with session.lock:
            session.encode_pending(self.files)
            record = session.record
            if record is None:
                t0 = time.perf_counter()
                with session.io:
                    record = session.record = self.loader.read(state)
                state.parts_ms["file"] = state.parts_ms.get("file", 0.0) + (time.perf_counter() - t0) * 1000
                source = "disk"
            if (
                record is None
                or record.token_ids[:reuse] != list(req.origin_input_ids[:reuse])
                or record.branches != stored
            ):
                return None
        return Restore(req, key, match, reuse, record, None if live is None else live[:reuse], branches, source)

    def agree(
        self, req: RequestView, prompt: tuple[array, array], plan: Restore | None, state: PersistTurn
    ) -> Restore | None:
        """The restore every tensor-parallel rank does (each decided from its own copy of the
        session): of the same prompt (a text match that rewrote it on some ranks only is undone),
        as many tokens as the rank that can restore the fewest. `plan` itself without tensor
        parallelism."""
        (ids, reuse), (ids_high, _) = self.tree.rank_range(
            [digest63(array("q", req.origin_input_ids).tobytes()), plan.reuse if plan else 0]
        )
        if ids != ids_high:
            logger.error(
                "session store: the tensor-parallel ranks matched the prompt to different stored paths; "
                "restoring none, the turn is served by normal prefill"
            )
            req.origin_input_ids, req.origin_input_ids_unpadded = prompt
            state.refused = RANKS_DIFFER
            return None
        if plan is None or reuse <= 0:
            return None
        return plan.cut(self.tree, reuse) if reuse < plan.reuse else plan
