"""Text memory (`memory: {mode: "text"}`), on the HTTP side: a session's recorded turns come back as
prompt text instead of KV blocks.

One recording serves both modes: a session's pool keeps the token ids of every turn it holds beside
their KV (pool.MemArtPool.transcript). A text-mode request first asks the scheduler for them (an
internal pass, mode `turns`: one token, nothing stored), decodes them into lines, and ranks the
lines by MiniLM cosine similarity to its last user (or tool) message; each line's embedding is
computed once per session and kept (`LineCache`). The best lines within `placed_tokens` (and at
most `top_k` of them when the request gives it), in the order they were recorded, open that
message under `memory.text_header`. The request then goes on with the positions of what was
placed, which the scheduler leaves out of the turn it records (the lines are the session's memory
already). What precedes the message (the system prompt, an agent's tool docs) stays a prefix the
radix tree reuses; the lines are prefilled as text: the response's `reused_tokens` is 0 and its
`prefill_work_share` 1.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from sgl_memory.core.request import FIELD, SpecError
from sgl_memory.core.sessions import SessionKey, session_key
from sgl_memory.core.spans import QUERY_ROLES, RoleMarkers
from sgl_memory.memart.encoder import embed
from sgl_memory.memart.passes import internal_pass, one_token
from sgl_memory.memart.settings import MemArtConfig

MAX_CACHED_LINES = 1 << 17  # line embeddings kept over all sessions (384 floats each: ~200 MB)
ROLE_LINES = frozenset((*QUERY_ROLES, "system", "assistant"))  # a role name alone on its line is markup


@dataclass(frozen=True)
class Line:
    """One line of a session's recorded text, its embedding and its tokens in the prompt."""

    text: str
    vector: torch.Tensor  # [384] unit norm
    tokens: int  # its tokens, with the line end that joins it to the next


def lines_of(turns: list[dict], decode) -> list[str]:
    """The distinct non-empty lines of the turns' text, in recorded order (markup left out). The
    turns are decoded as one text: a turn may start inside a line (a full-history turn starts with
    the previous answer's last token, whose KV came with it)."""
    seen: dict[str, None] = {}
    for line in decode([t for turn in turns for t in turn["ids"]]).split("\n"):
        line = line.strip()
        if line and line not in ROLE_LINES:
            seen.setdefault(line)
    return list(seen)


def choose(lines: list[Line], query: torch.Tensor, budget: int | None, top_k: int | None) -> list[int]:
    """Indices of the lines most similar to `query` that fit in `budget` tokens together (a line
    that would overflow is passed over so shorter ones can still fill it), at most `top_k`, in
    recorded order."""
    if not lines:
        return []
    scores = torch.stack([line.vector for line in lines]) @ query
    picked, used = [], 0
    for i in torch.argsort(scores, descending=True, stable=True).tolist():
        if top_k is not None and len(picked) >= top_k:
            break
        if budget is None or used + lines[i].tokens <= budget:
            picked.append(i)
            used += lines[i].tokens
    return sorted(picked)


class LineCache:
    """Per session, the lines embedded so far (least recently used sessions forgotten past
    `limit` lines in all): a line is embedded once however many requests rank it."""

    def __init__(self, limit: int = MAX_CACHED_LINES):
        self.limit = limit
        self._sessions: OrderedDict[SessionKey, dict[str, Line]] = OrderedDict()
        self._lock = threading.Lock()

    async def lines(self, owner: SessionKey, texts: list[str], tokenize) -> list[Line]:
        with self._lock:
            known = dict(self._sessions.get(owner, {}))
        new = [t for t in texts if t not in known]
        if new:
            vectors = await asyncio.to_thread(embed, new)
            for text, vector in zip(new, vectors):
                known[text] = Line(text, torch.tensor(vector), len(tokenize(text)) + 1)
        with self._lock:
            self._sessions.pop(owner, None)
            self._sessions[owner] = {t: known[t] for t in texts}  # what the pool no longer holds goes
            total = sum(len(v) for v in self._sessions.values())
            while total > self.limit and len(self._sessions) > 1:
                total -= len(self._sessions.popitem(last=False)[1])
        return [known[t] for t in texts]


CACHE = LineCache()


@dataclass(frozen=True)
class Target:
    """Where the lines go in a prompt (the start of its last user or tool message's text) and
    that message's text, the query the lines are ranked by."""

    at: int
    query: str


def target(ids: list[int], markers: RoleMarkers, decode) -> Target:
    messages = markers.messages(ids)
    asking = [(k, start) for k, (start, role) in enumerate(messages) if role in QUERY_ROLES]
    if not asking:  # no chat markup: the prompt is the query, the lines go first
        return Target(0, decode(ids).strip())
    k, start = asking[-1]
    end = messages[k + 1][0] if k + 1 < len(messages) else len(ids)
    at = start + 1 + len(markers.roles.get(markers.role_at(ids, start) or "user", ()))
    # the header ends at its line end (llama3 puts a special token before it)
    for step in range(3):
        if at + step < end and "\n" in decode([ids[at + step]]):
            at += step + 1
            break
    return Target(at, decode(ids[at:end]).strip())


async def place(request, engine, raw: dict, config: MemArtConfig) -> None:
    """Put the session's most relevant recorded lines into a text-mode request's prompt, and tell
    the scheduler where they are (`text_span`, `text_lines`, `text_ms`)."""
    ids = request.prompt_ids()
    if ids is None and (prompt := request.prompt_text()) is not None:
        ids = engine.encode_prompt(prompt)  # a /generate `text`: the ids SGLang would give it
    if ids is None:
        raise SpecError(f"{FIELD}.memory.mode 'text' needs one prompt, as text or token ids")
    t0 = time.perf_counter()
    owner = {k: raw[k] for k in ("session_id", "tenant") if raw.get(k) is not None}
    turns = await internal_pass(engine, owner, {"mode": "turns"}, one_token(engine), answer="memory_turns")
    where = target(ids, engine.markers(config.roles), engine.decode)
    header = engine.tokenize(config.text_header)
    memory = raw["memory"]
    placed = memory.get("placed_tokens")
    placed = config.placed_tokens if placed is None else placed
    room = engine.context_len() - len(ids) - len(header) - 2
    budget = min(placed, room) if placed else room
    texts = lines_of(turns, engine.decode)
    chosen: list[int] = []
    if texts and budget > 0:
        lines = await CACHE.lines(session_key(raw.get("tenant"), raw["session_id"]), texts, engine.tokenize)
        query = torch.tensor((await asyncio.to_thread(embed, [where.query]))[0])
        chosen = choose(lines, query, budget, memory.get("top_k"))
    inserted = engine.tokenize(config.text_header + "\n".join(texts[i] for i in chosen) + "\n\n") if chosen else []
    request.set_prompt_ids(ids[: where.at] + inserted + ids[where.at :])
    span = [where.at, where.at + len(inserted)]
    ms = round((time.perf_counter() - t0) * 1000, 3)
    request.set_field({**raw, "memory": {**memory, "text_span": span, "text_lines": len(chosen), "text_ms": ms}})
