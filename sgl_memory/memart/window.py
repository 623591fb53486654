"""Memory mode for clients that resend the whole history (`memory.window`), on the HTTP side.

Agent frameworks send the full message list every turn. With `memory.window: N` the server serves
such a request of a session as memory mode by itself: the prompt it sends on keeps the system
message, the latest user message that is not a tool result (the task) and the last messages that
fit in N tokens; the older turns come back from the session's KV memory by retrieval, as for a
client that sends only its new turn. The response's `sgl_memory.windowed_tokens` says how many
tokens of history were left out.

Leaving history out is safe only where the session's memory holds it, so a request is windowed
only when it continues the session's previous request as this process saw it (that prompt is a
prefix of this one): everything before was recorded when it was new (the previous requests'
prompts and their answers), and what the client added since the last answer is never cut (it is
the turn this request records). The first request of a session, a history the client edited, and
the first request after a restart go through whole (and are recorded whole).

Not windowed: a prompt sent as text (only token ids are cut: an OpenAI chat request comes as ids),
a request that reads prompt log-probabilities (their positions are the client's), a batch, and a
request that asks for memory mode itself.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from sgl_memory.core.sessions import SessionKey, digest63, session_key
from sgl_memory.core.spans import QUERY_ROLES, RoleMarkers, after_answer

MAX_SESSIONS = 4096  # sessions whose last prompt is remembered; the least recently used beyond are forgotten


@dataclass(frozen=True)
class Cut:
    """A windowed prompt: the ids that go on and how many history tokens were left out."""

    ids: list[int]  # what goes on: the system message, the task, the window
    dropped: int  # history tokens left out


def cut(ids: list[int], markers: RoleMarkers, window: int) -> Cut | None:
    """The prompt without the history older than the last `window` tokens, cut at the start of an
    exchange (an assistant message: tool results keep their call) or, where even the last exchange
    is longer, at the latest user or tool message. Never cut: the system message, the latest user
    message that is not a tool result, and what follows the last answer. None when nothing is left out."""
    messages = markers.messages(ids)
    history = messages[:-1] if messages and messages[-1][1] == "assistant" else messages  # not the generation prompt
    queries = [start for start, role in history if role in QUERY_ROLES]
    if not queries:
        return None
    system_end = messages[1][0] if messages[0][1] == "system" and len(messages) > 1 else 0
    newest = after_answer(messages, len(ids))  # from the same scan
    last = min(queries[-1], newest) if newest is not None else queries[-1]
    candidates = [start for start, role in history if role == "assistant" and system_end < start <= last] + [last]
    start = next((c for c in candidates if len(ids) - c <= window), last)
    tasks = [(k, s) for k, (s, role) in enumerate(messages) if role == "user" and system_end <= s < start]
    task: list[int] = []
    if tasks:
        k, s = tasks[-1]
        task = ids[s : messages[k + 1][0]]
    kept = ids[:system_end] + task + ids[start:]
    dropped = len(ids) - len(kept)
    return Cut(kept, dropped) if dropped > 0 else None


def _digest(ids) -> int:
    return digest63(array("q", ids).tobytes())


class LastPrompts:
    """Per session, the prompt of its last request as the client sent it (length and digest)."""

    def __init__(self, limit: int = MAX_SESSIONS):
        self.limit = limit
        self._last: OrderedDict[SessionKey, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def continues(self, owner: SessionKey, ids: list[int]) -> bool:
        """Whether `ids` start with the session's last prompt."""
        with self._lock:
            before = self._last.get(owner)
        return before is not None and before[0] <= len(ids) and _digest(ids[: before[0]]) == before[1]

    def remember(self, owner: SessionKey, ids: list[int]) -> None:
        with self._lock:
            self._last.pop(owner, None)
            self._last[owner] = (len(ids), _digest(ids))
            while len(self._last) > self.limit:
                self._last.popitem(last=False)


LAST = LastPrompts()


def window(request, engine, config, spec) -> int:
    """Cut a full-history request of a session down to its window (`config`: the memory section;
    `spec`: the request's parsed field). Returns the history tokens left out (0: it goes whole)."""
    if (
        not config.window
        or spec.session_id is None
        or spec.part("memory") is not None
        or request.reads_prompt_logprobs()
    ):
        return 0
    ids = request.prompt_ids()
    if ids is None:
        return 0
    owner = session_key(spec.tenant, spec.session_id)
    continues = LAST.continues(owner, ids)
    if not spec.readonly:  # a readonly request adds nothing to the memory: the next must not lean on it
        LAST.remember(owner, ids)
    if not continues:
        return 0
    found = cut(ids, engine.markers(config.roles), config.window)
    if found is None:
        return 0
    request.set_prompt_ids(found.ids)
    return found.dropped
