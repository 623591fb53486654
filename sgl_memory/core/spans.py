"""The forced set of a request, found in its token ids from the chat template's role markers.

Two spans always stay live: the protected system prefix (the first message when it is a system
message) and the actionable query span (the latest user, tool or function message, through the end
of the prompt so the assistant header that follows it stays too). Qwen renders tool results as a
user message holding `<tool_response>`, so "latest user message" covers them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Per template family: the token that opens a message header, and where the role name sits after it.
FAMILIES = {
    "chatml": "<|im_start|>",
    "llama3": "<|start_header_id|>",
}
QUERY_ROLES = ("user", "tool", "function", "ipython")


@dataclass(frozen=True)
class Spans:
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

    @classmethod
    def from_tokenizer(cls, tokenizer, family: str) -> RoleMarkers:
        if family not in FAMILIES or tokenizer is None:
            return cls(None, {})
        opener = tokenizer.convert_tokens_to_ids(FAMILIES[family])
        if opener is None or opener == getattr(tokenizer, "unk_token_id", None):
            return cls(None, {})
        roles = {r: tuple(tokenizer.encode(r, add_special_tokens=False)) for r in ("system", *QUERY_ROLES)}
        return cls(opener, roles)

    def role_at(self, token_ids, pos: int) -> str | None:
        for role, ids in self.roles.items():
            if ids and tuple(token_ids[pos + 1 : pos + 1 + len(ids)]) == ids:
                return role
        return None


def find_spans(token_ids, markers: RoleMarkers, query_tail: int) -> Spans:
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
