"""The forced set of a request, found in its token ids from the chat template's role markers.

Two spans always stay live: the protected system prefix (the first message when it is a system
message) and the actionable query span (the latest user, tool or function message, through the end
of the prompt so the assistant header that follows it stays too). Qwen renders tool results as a
user message holding `<tool_response>`, so "latest user message" covers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Literal

# Per template family: the token that opens a message header, and where the role name sits after it.
FAMILIES = {
    "chatml": "<|im_start|>",
    "llama3": "<|start_header_id|>",
}
# a mechanism's `roles` setting: one of FAMILIES, or "none" (no role markers: the fallbacks)
RoleFamily = Literal["chatml", "llama3", "none"]
QUERY_ROLES = ("user", "tool", "function", "ipython")


@dataclass(frozen=True)
class Spans:
    """The forced set of one request's tokens: its protected system prefix and its actionable query
    span, and how they were found."""

    system_end: int  # [0, system_end) is the protected system prefix
    query_start: int  # [query_start, len) is the actionable query span
    source: str  # "roles" when found from markers, "tail" for the fallback
    session_span: tuple[int, int] | None = None  # the first user message: the task that names a session

    def forced_count(self, length: int) -> int:
        return self.system_end + (length - self.query_start)


@dataclass(frozen=True)
class RoleMarkers:
    """Token ids of one family's message opener and of each role name that may follow it."""

    opener: int | None
    roles: dict[str, tuple[int, ...]]
    tool_result: tuple[tuple[int, ...], ...] = ()  # what may follow a user role name where the message is a tool result

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, family: str) -> RoleMarkers:
        if family not in FAMILIES or tokenizer is None:
            return cls(None, {})
        opener = tokenizer.convert_tokens_to_ids(FAMILIES[family])
        if opener is None or opener == getattr(tokenizer, "unk_token_id", None):
            return cls(None, {})
        roles = {r: tuple(tokenizer.encode(r, add_special_tokens=False)) for r in ("system", "assistant", *QUERY_ROLES)}
        # Qwen's tool results are user messages that open with it after the role's line end; its
        # ">" may merge with the next newline, or the whole tag be one added token
        tool = tuple(
            tuple(tokenizer.encode(t, add_special_tokens=False)) for t in ("\n<tool_response>", "\n<tool_response")
        )
        return cls(opener, roles, tool)

    def role_at(self, token_ids: Sequence[int], pos: int) -> str | None:
        for role, ids in self.roles.items():
            if ids and tuple(token_ids[pos + 1 : pos + 1 + len(ids)]) == ids:
                return role
        return None

    def messages(self, token_ids: Sequence[int]) -> list[tuple[int, str | None]]:
        """(start, role) of each message, in order; a tool result rendered as a user message (Qwen)
        has the role "tool"."""
        if self.opener is None:
            return []
        out = []
        for i, t in enumerate(token_ids):
            if t == self.opener:
                role = self.role_at(token_ids, i)
                at = i + 1 + len(self.roles.get("user", ()))
                if role == "user" and any(
                    tuple(token_ids[at : at + len(tag)]) == tag for tag in self.tool_result if tag
                ):
                    role = "tool"
                out.append((i, role))
        return out


def after_answer(messages: list[tuple[int, str | None]], length: int) -> int | None:
    """Where what the client added after the model's last answer starts, in a prompt of `length`
    tokens whose `RoleMarkers.messages` are given: the message after the last assistant message
    before the prompt's own assistant header (None when the prompt holds no answer, or without role
    markers). A turn's new part: its answer was taken when it was generated, the history before it
    when it was new."""
    # the prompt's own assistant header (the generation prompt, or an answer's prefix) is not history
    history = messages[:-1] if messages and messages[-1][1] == "assistant" else messages
    answers = [k for k, (_, role) in enumerate(history) if role == "assistant"]
    if not answers:
        return None
    k = answers[-1] + 1
    return messages[k][0] if k < len(messages) else length


def find_spans(token_ids: Sequence[int], markers: RoleMarkers, query_tail: int) -> Spans:
    n = len(token_ids)
    tail = Spans(0, max(0, n - query_tail), "tail", None)
    if markers.opener is None:
        return tail
    openers = [i for i, t in enumerate(token_ids) if t == markers.opener]
    if not openers:
        return tail
    query = next((i for i in reversed(openers) if markers.role_at(token_ids, i) in QUERY_ROLES), None)
    if query is None:
        return tail
    system_end = 0
    if markers.role_at(token_ids, openers[0]) == "system" and len(openers) > 1:
        system_end = openers[1]
    users = [i for i in openers if markers.role_at(token_ids, i) == "user"]
    session_span = None
    if users:
        after = [i for i in openers if i > users[0]]
        session_span = (users[0], after[0] if after else n)
    return Spans(min(system_end, query), query, "roles", session_span)
