"""Which session a request belongs to, and that session's QueryMemory (its slot in the tree's
session registry, sgl_memory/sessions.py).

QueryMemory (IntentKV eq. 2) is one post-RoPE query row per layer and query head, updated once per
request as an EMA of the mean query over the actionable span and projected back to unit norm along
the head dimension; without the projection its norm grows with the number of turns and the softmax
of the rule score collapses onto one key.
"""

from __future__ import annotations

import hashlib

import torch

from sgl_memory.sessions import SessionKey

# Where a session key came from, strongest first (IntentKV appendix A).
KEY_SOURCES = ("session_id", "sglang_session", "session_span", "prefix_hash", "request")


def resolve_key(
    session_id: str | None,
    tenant: str | None,
    sglang_session: str | None,
    token_ids,
    session_span: tuple[int, int] | None,
    prefix_tokens: int,
    rid: str,
) -> tuple[SessionKey, str]:
    """(key, source) for a request. An explicit session id is the session every mechanism shares;
    the other sources name sessions with a NUL-led id, which no client session id can spell."""
    ns = tenant or ""
    if session_id:
        return (ns, session_id), "session_id"
    if sglang_session:
        return (ns, "\x00sglang:" + sglang_session), "sglang_session"
    if session_span is not None and session_span[1] > session_span[0]:
        return (ns, "\x00span:" + _digest(token_ids[session_span[0] : session_span[1]])), "session_span"
    if len(token_ids) >= prefix_tokens:
        return (ns, "\x00prefix:" + _digest(token_ids[:prefix_tokens])), "prefix_hash"
    return (ns, "\x00request:" + rid), "request"


def _digest(token_ids) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


class QueryMemory:
    """m <- unit(decay * m + (1 - decay) * q_mean); the first update is unit(q_mean)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.state: torch.Tensor | None = None  # [layers, heads, head_dim], float32
        self.updates = 0

    def update(self, q_mean: torch.Tensor) -> torch.Tensor:
        q_mean = q_mean.float()
        if self.state is None or self.state.shape != q_mean.shape:
            self.state = unit_rows(q_mean)
        else:
            self.state = unit_rows(self.decay * self.state + (1.0 - self.decay) * q_mean)
        self.updates += 1
        return self.state
