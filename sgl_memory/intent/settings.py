"""IntentKV's settings: the `intent:` config section and the per-request overrides of it (the
pruning keys of the `sgl_memory` field: budget, budget_mode, system_prompt, scorer, layout, ablation,
and `intent: false`, which leaves intent out of the request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sgl_memory.core.config import MAX_BUDGET, choices, require
from sgl_memory.core.request import FIELD, RequestPart, choice, flag, integer
from sgl_memory.core.spans import RoleFamily


@dataclass(frozen=True)
class IntentConfig:
    """Cross-turn intent pruning (IntentKV): see sgl_memory/intent/README.md."""

    enabled: bool = False  # a request whose live prompt exceeds the budget is pruned after its prefill
    # always: every request prunes; pressure: a capacity lever, a request prunes only while the pool
    # is under pressure (the tree evicted within `pressure_window_s`) and it has history over the
    # budget, or when its session pruned before (its later turns follow the pruned path), so that
    # sessions stay in the pool at their budget instead of leaving it whole
    when: Literal["always", "pressure"] = "always"
    pressure_window_s: float = 60.0  # when pressure: how recent an eviction still counts as pressure (seconds)
    budget: int = 2048  # prompt positions kept live per request after its prefill (see budget_mode)
    # total: the budget counts the forced set (system prefix, latest message) too; history: it
    # counts only the compressible history between them, the forced set is kept on top (IntentKV's
    # budget, which lets a budget sit below an agent's tool docs)
    # adaptive: a history budget per session that follows it (intent/sessions.py AdaptiveBudget),
    # starting at `budget`, within [budget_floor, budget_ceiling]
    budget_mode: Literal["total", "history", "adaptive"] = "total"
    budget_floor: int = 128  # the least an adaptive budget shrinks to
    budget_ceiling: int = 8192  # the most an adaptive budget grows to
    grow_at: float = 0.3  # the scorer's mass on the candidates left out above which the budget grows
    shrink_at: float = 0.9  # the share of the last event's kept history kept again above which it shrinks
    budget_step: float = 1.25  # the factor of one change
    # forced: the system prompt (an agent's tool docs sit there) always stays live; compressible: it
    # competes with the history for the budget, only the latest message is forced
    system_prompt: Literal["forced", "compressible"] = "forced"
    # which history positions stay live: the QueryMemory rule max-pooled over `kernel` positions
    # (memory_pool), as published (memory), this turn's query alone (query), the rule plus the learned
    # head (learned), or a baseline (streaming_llm, snapkv, h2o, random)
    scorer: Literal["memory", "memory_pool", "query", "learned", "streaming_llm", "snapkv", "h2o", "random"] = (
        "memory_pool"
    )
    # learned (Phase 2, intent/head.py): the head's safetensors file; "" = the head shipped for the
    # served model (sgl_memory/intent/heads/), if there is one
    head: str = ""
    ablation: Literal["none", "memory", "x_attn", "residual"] = "none"  # the learned head's Appendix-B switches
    # training data: every compression event of scorer learned writes the head's inputs and the
    # prompt's tokens there, one safetensors file per request (scripts/train_pruner.py reads them)
    trace_dir: str = ""
    # dead_slot: pruned positions point at a sentinel slot and the pruned path stays reusable in the
    # radix tree; compact: kept KV re-packed and re-rotated (the published baselines' path, no reuse)
    layout: Literal["dead_slot", "compact"] = "dead_slot"
    decay: float = 0.9  # QueryMemory EMA weight of the past
    session_capacity: int = 1024  # QueryMemory entries kept (LRU)
    roles: RoleFamily = "chatml"  # how message boundaries are found in tokens
    query_tail: int = 32  # forced tail when no role marker is found
    session_prefix_tokens: int = 64  # N of the "hash of the first N input tokens" session key
    window: int = 32  # SnapKV / H2O observation window (last prompt query rows)
    kernel: int = 7  # max-pool smoothing width of SnapKV and memory_pool
    sinks: int = 4  # StreamingLLM attention-sink tokens

    def validate(self, path: str) -> None:
        require(1 <= self.budget <= MAX_BUDGET, f"{path}.budget", f"an integer in [1, {MAX_BUDGET}]")
        require(self.pressure_window_s > 0.0, f"{path}.pressure_window_s", "a number > 0")
        require(0.0 <= self.decay < 1.0, f"{path}.decay", "a number in [0, 1)")
        require(
            1 <= self.budget_floor <= self.budget_ceiling <= MAX_BUDGET,
            f"{path}.budget_floor / budget_ceiling",
            f"integers with 1 <= floor <= ceiling <= {MAX_BUDGET}",
        )
        require(0.0 < self.grow_at <= 1.0, f"{path}.grow_at", "a number in (0, 1]")
        require(0.0 < self.shrink_at <= 1.0, f"{path}.shrink_at", "a number in (0, 1]")
        require(self.budget_step > 1.0, f"{path}.budget_step", "a number > 1")
        require(self.session_capacity >= 1, f"{path}.session_capacity", "an integer >= 1")
        for name in ("query_tail", "session_prefix_tokens", "window", "kernel"):
            require(getattr(self, name) >= 1, f"{path}.{name}", "an integer >= 1")
        require(self.kernel % 2 == 1, f"{path}.kernel", "an odd integer >= 1")
        require(self.sinks >= 0, f"{path}.sinks", "an integer >= 0")


OVERRIDES = (
    "budget",
    "budget_mode",
    "system_prompt",
    "scorer",
    "layout",
    "ablation",
    "when",
)  # request keys over the section
# `intent: false`: intent takes no part in the request, as on a server without it: no compression
# event, no QueryMemory update, its prompt matched in the tree as far as the tree holds it (intent
# otherwise prefills the latest message itself, to read its queries), the session's pruned path not
# followed
FIELDS = (*OVERRIDES, "intent")


@dataclass(frozen=True)
class IntentRequest(RequestPart):
    """A request's pruning overrides (None: the server's value)."""

    budget: int | None = None
    budget_mode: str | None = None
    system_prompt: str | None = None
    scorer: str | None = None
    layout: str | None = None
    ablation: str | None = None
    when: str | None = None
    enabled: bool | None = None  # the `intent` key


def parse_request(raw: dict, internal: bool = False) -> IntentRequest | None:
    if not any(k in raw for k in FIELDS):
        return None
    named = {k: choice(raw.get(k), choices(IntentConfig, k), f"{FIELD}.{k}") for k in OVERRIDES if k != "budget"}
    return IntentRequest(
        budget=integer(raw.get("budget"), 1, MAX_BUDGET, f"{FIELD}.budget"),
        enabled=flag(raw.get("intent"), f"{FIELD}.intent"),
        **named,
    )
