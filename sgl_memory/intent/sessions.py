"""Sessions: which agent a request belongs to, and that session's QueryMemory.

QueryMemory (IntentKV eq. 2) is one post-RoPE query row per layer and query head, updated once per
request as an EMA of the mean query over the actionable span and projected back to unit norm along
the head dimension; without the projection its norm grows with the number of turns and the softmax
of the rule score collapses onto one key.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch

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
) -> tuple[str, str]:
    """(key, source) for a request; the tenant namespaces every key so tenants never share one."""
    ns = f"{tenant or ''}\x00"
    if session_id:
        return ns + "id:" + session_id, "session_id"
    if sglang_session:
        return ns + "sglang:" + sglang_session, "sglang_session"
    if session_span is not None and session_span[1] > session_span[0]:
        return ns + "span:" + _digest(token_ids[session_span[0] : session_span[1]]), "session_span"
    if len(token_ids) >= prefix_tokens:
        return ns + "prefix:" + _digest(token_ids[:prefix_tokens]), "prefix_hash"
    return ns + "request:" + rid, "request"


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


class SessionStore:
    """LRU map from session key to QueryMemory; safe to use from several threads."""

    def __init__(self, capacity: int, decay: float):
        self.capacity = capacity
        self.decay = decay
        self._items: OrderedDict[str, QueryMemory] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def get(self, key: str) -> QueryMemory:
        with self._lock:
            memory = self._items.get(key)
            if memory is None:
                memory = self._items[key] = QueryMemory(self.decay)
                while len(self._items) > self.capacity:
                    self._items.popitem(last=False)
                    self.evictions += 1
            else:
                self._items.move_to_end(key)
            return memory

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
