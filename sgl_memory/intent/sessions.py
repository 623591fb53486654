"""Which session a request belongs to, and that session's QueryMemory (its slot in the tree's
session registry, sgl_memory/core/sessions.py).

QueryMemory (IntentKV eq. 2) is one post-RoPE query row per layer and query head, updated once per
request as an EMA of the mean query over the actionable span and projected back to unit norm along
the head dimension; without the projection its norm grows with the number of turns and the softmax
of the rule score collapses onto one key.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from sgl_memory.core.sessions import SessionKey, SessionRegistry
from sgl_memory.intent.settings import IntentConfig

# Where a session key came from, strongest first (IntentKV appendix A).
KEY_SOURCES = ("session_id", "sglang_session", "session_span", "prefix_hash", "request")
NAMED_SOURCES = ("session_id", "sglang_session")  # of those, the ones a client gave; the rest are derived


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


@dataclass
class AdaptiveBudget:
    """A session's history budget that follows the session (IntentKV leaves this as future work).

    After each compression event: when the scorer's mass on the candidates left out is above
    `grow_at` (evidence is being cut), the budget grows by `step`; else when the event kept again
    at least `shrink_at` of what the session's previous event kept (the kept set barely changes),
    it shrinks by `step`; always within [floor, ceiling]."""

    current: int
    kept: torch.Tensor | None = None  # the previous event's kept history positions
    length: int = 0  # the previous event's prompt length

    def after_event(self, mass_out: float, kept: torch.Tensor, length: int, cfg) -> float | None:
        """Update from one event; returns the overlap with the previous event (None: the first)."""
        overlap = None
        if self.kept is not None and self.kept.numel():
            now = kept[kept < self.length]
            overlap = float(torch.isin(self.kept, now).sum()) / self.kept.numel()
        if mass_out > cfg.grow_at:
            self.current = min(cfg.budget_ceiling, math.ceil(self.current * cfg.budget_step))
        elif overlap is not None and overlap >= cfg.shrink_at:
            self.current = max(cfg.budget_floor, math.floor(self.current / cfg.budget_step))
        self.kept, self.length = kept, length
        return overlap


class QueryMemory:
    """m <- unit(decay * m + (1 - decay) * q_mean); the first update is unit(q_mean). The session's
    adaptive budget (budget_mode adaptive) lives with it."""

    def __init__(self, decay: float):
        self.decay = decay
        self.state: torch.Tensor | None = None  # [layers, heads, head_dim], float32
        self.updates = 0
        self.budget: AdaptiveBudget | None = None

    def update(self, q_mean: torch.Tensor) -> torch.Tensor:
        q_mean = q_mean.float()
        if self.state is None or self.state.shape != q_mean.shape:
            self.state = unit_rows(q_mean)
        else:
            self.state = unit_rows(self.decay * self.state + (1.0 - self.decay) * q_mean)
        self.updates += 1
        return self.state


class SessionMemories:
    """The sessions' QueryMemory slots of one pruner in the tree's session registry: made at a
    session's first use, its adaptive budget, and their export to and import from a persisted
    session (kept with the session by persistence)."""

    def __init__(self, registry: SessionRegistry, name: str, decay: float):
        self.registry, self.name, self.decay = registry, name, decay

    def memory(self, key: SessionKey) -> QueryMemory:
        """The session's QueryMemory, made empty at its first request."""
        return self.registry.get(key, self.name, lambda: QueryMemory(self.decay))

    def has_turns(self, key: SessionKey) -> bool:
        """Whether a turn of the session ran with pruning (it updated the session's QueryMemory)."""
        memory = self.registry.get(key, self.name)
        return memory is not None and memory.updates > 0

    def budget(self, key: SessionKey, cfg: IntentConfig) -> AdaptiveBudget:
        """The session's adaptive budget, made at its first request from the configured budget."""
        memory = self.memory(key)
        if memory.budget is None:
            memory.budget = AdaptiveBudget(min(max(cfg.budget, cfg.budget_floor), cfg.budget_ceiling))
        return memory.budget

    def export(self, key: SessionKey) -> dict[str, torch.Tensor]:
        memory = self.registry.get(key, self.name)
        state = memory.state if memory is not None else None  # read once: update() replaces it whole
        if state is None:
            return {}
        out = {"query_memory": state, "updates": torch.tensor([memory.updates])}
        if memory.budget is not None:
            out["adaptive_budget"] = torch.tensor([memory.budget.current])
        return out

    @staticmethod
    def describe(state: QueryMemory) -> dict[str, int]:
        out = {"query_memory_turns": state.updates}
        if state.budget is not None:
            out["adaptive_budget"] = state.budget.current
        return out

    def restore(self, key: SessionKey, tensors: dict[str, torch.Tensor]) -> None:
        if "query_memory" not in tensors:
            return
        memory = self.memory(key)
        if memory.state is None:
            memory.state = tensors["query_memory"].float()
            memory.updates = int(tensors["updates"][0]) if "updates" in tensors else 1
        if memory.budget is None and "adaptive_budget" in tensors:
            memory.budget = AdaptiveBudget(int(tensors["adaptive_budget"][0]))
