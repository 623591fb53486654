"""Session persistence's settings: the `persist:` config section, and a request's `agent` hints
(`sgl_memory.agent`), which order the sessions' eviction."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sgl_memory.core.config import require
from sgl_memory.core.request import RequestPart, flag, number, object_at

MAX_HINT_MS = 24 * 3600 * 1000  # a day: the longest tool duration or keep-for a client may state


@dataclass(frozen=True)
class PersistConfig:
    """Per-session persistent KV store: see sgl_memory/persist/README.md."""

    # store sessions' KV and restore it when the tree lacks it (sessions named by an id); on by
    # default: it changes no answer beyond the restore's measured agreement (docs/persistence.md)
    enabled: bool = True
    # the session store, one folder per model, one head file and its chunks per session; empty: the
    # user's cache directory, $XDG_CACHE_HOME/sgl-memory/sessions (else ~/.cache/sgl-memory/sessions)
    dir: str = ""
    # q8 by default: a Q4 restore changed half of the session's greedy answers (bench/persist_restart);
    # bf16 / fp32: unquantized (the pool's dtype: exact)
    quant: Literal["q4", "q8", "bf16", "fp32"] = "q8"
    kivi: bool = True  # keys grouped per channel over tokens (KIVI), values per token: see persist/README.md
    write_policy: Literal["on_finish", "off"] = "on_finish"  # off: restore from the store, never write
    quota_bytes: int = 8 << 30  # disk; least recently used session files go first
    warm_bytes: int = 1 << 30  # host memory for stored-form session KV (the warm tier)
    match_threshold: float = 0.5  # DIVERGE reuses the stored path when this share of its text matches
    # KV held in the tree for waiting requests (restored, or matched hot) until they run, as a share of
    # the pool; a restore past it waits for room (the rest of the pool is for the requests that run)
    hold_fraction: float = 0.5
    # which idle sessions leave the pool first under pressure (their KV is in the warm or cold tier):
    # hints, the one its `agent` hints expect back furthest ahead (done first), the rest by last use;
    # learned, the same with the gaps a session's turns came back after for a session without hints
    # (bench/many_agents at 4x: no better than last use, TTFT p99 worse: not the default); last_use,
    # SGLang's LRU, hints ignored (also what an operator's own --radix-eviction-policy keeps)
    eviction: Literal["hints", "learned", "last_use"] = "hints"
    max_keep_ms: float = 300_000  # the longest `agent.cache_ttl_ms` honoured (a keep-for never blocks eviction)
    # a session whose `agent.expected_tool_duration_ms` is this close is brought back into the pool
    # before its turn arrives (prefetch; 0: off), when the pool has room
    prefetch_ms: float = 250

    def store_dir(self) -> Path:
        """The session store's folder: `dir`, or the user's cache directory's."""
        if self.dir:
            return Path(self.dir).expanduser()
        return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "sgl-memory" / "sessions"

    def validate(self, path: str) -> None:
        require(self.quota_bytes >= 0, f"{path}.quota_bytes", "an integer >= 0")
        require(self.warm_bytes >= 0, f"{path}.warm_bytes", "an integer >= 0")
        require(0.0 <= self.match_threshold <= 1.0, f"{path}.match_threshold", "a number in [0, 1]")
        require(0.0 <= self.hold_fraction <= 1.0, f"{path}.hold_fraction", "a number in [0, 1]")
        require(0.0 <= self.max_keep_ms <= MAX_HINT_MS, f"{path}.max_keep_ms", f"a number in [0, {MAX_HINT_MS}]")
        require(0.0 <= self.prefetch_ms <= MAX_HINT_MS, f"{path}.prefetch_ms", f"a number in [0, {MAX_HINT_MS}]")


AGENT_KEYS = ("expected_tool_duration_ms", "cache_ttl_ms", "done")


@dataclass(frozen=True)
class AgentHints(RequestPart):
    """`sgl_memory.agent`: what the client knows of the session's next turn after this one (the
    names of SGLang RFC #24656's `agent_hints`). The server uses them to choose which idle session
    leaves the KV pool first; they never change an answer."""

    expected_tool_duration_ms: float | None = None  # the tool this turn calls returns after about this long
    cache_ttl_ms: float | None = None  # keep the session in the pool this long after the turn (bounded: max_keep_ms)
    done: bool | None = None  # the session has no next turn: its KV leaves the pool first


def parse_request(raw: dict, internal: bool = False) -> AgentHints | None:
    body, where = object_at(raw, "agent", AGENT_KEYS)
    if body is None:
        return None
    return AgentHints(
        number(body.get("expected_tool_duration_ms"), 0, MAX_HINT_MS, f"{where}.expected_tool_duration_ms"),
        number(body.get("cache_ttl_ms"), 0, MAX_HINT_MS, f"{where}.cache_ttl_ms"),
        flag(body.get("done"), f"{where}.done"),
    )
