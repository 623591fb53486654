"""Session persistence's settings: the `persist:` config section, and a request's hints (`sgl_memory.agent`,
and the actions of SGLang's `kv_hints` envelope this server implements), which order the sessions' eviction."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sgl_memory.core.config import require
from sgl_memory.core.request import KV_HINTS, RequestPart, SpecError, flag, integer, number, object_at, only

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
    # auto: q8 (a Q4 restore changed half of the session's greedy answers, bench/persist_restart), or
    # an 8-bit pool's own format (its bytes: no requantizing); bf16 / fp32 / fp8_* / int8: KV as a pool
    # of that dtype holds it (exact there); a file of any format restores into any pool dtype
    quant: Literal["auto", "q4", "q8", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8"] = "auto"
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


AGENT_KEYS = ("expected_tool_duration_ms", "cache_ttl_ms", "done", "demote")
# SGLang's envelope (kv_hints.py): the actions implemented here, named after RFC #27574's hints; the
# HTTP layer checks the envelope's shape and hands its actions over as the field's KV_HINTS
KV_HINT_VERSION = "1"
KV_HINT_PAYLOADS: dict[str, tuple[str, ...]] = {
    "retain": ("ttl_ms",),
    "pin": ("ttl_ms",),
    "prefetch": ("in_ms",),
    "demote": (),
    "done": (),
}


@dataclass(frozen=True)
class AgentHints(RequestPart):
    """`sgl_memory.agent` (the names of SGLang RFC #24656's `agent_hints`) and SGLang's `kv_hints`
    actions: what the client knows of the session's next turn after this one. The server uses them
    to choose which idle session leaves the KV pool (and host memory) first; they never change an
    answer."""

    expected_tool_duration_ms: float | None = None  # the tool this turn calls returns after about this long
    cache_ttl_ms: float | None = None  # keep the session in the pool this long after the turn (bounded: max_keep_ms)
    done: bool | None = None  # the session has no next turn: its KV leaves the pool first
    demote: bool | None = None  # not back soon: its KV leaves the pool first, and host memory once on disk


def parse_request(raw: dict, internal: bool = False) -> AgentHints | None:
    """The `agent` object's hints, and what the envelope's actions add where the object is silent
    (the object's own keys win, as the field's session id wins over the header's)."""
    body, where = object_at(raw, "agent", AGENT_KEYS)
    given = {**kv_hint_actions(raw.get(KV_HINTS)), **(body or {})}
    if body is None and not given:
        return None
    return AgentHints(
        number(given.get("expected_tool_duration_ms"), 0, MAX_HINT_MS, f"{where}.expected_tool_duration_ms"),
        number(given.get("cache_ttl_ms"), 0, MAX_HINT_MS, f"{where}.cache_ttl_ms"),
        flag(given.get("done"), f"{where}.done"),
        flag(given.get("demote"), f"{where}.demote"),
    )


def kv_hint_actions(actions: object) -> dict:
    """The envelope's actions as `agent` keys: `retain` / `pin` {ttl_ms} keep the session (the
    longest of them), `prefetch` {in_ms} says when it is back, `demote` and `done` (no payload).
    A payload of the wrong shape is a SpecError naming the field; an action of a type or version
    this server does not implement is ignored, as the envelope's contract says."""
    if actions is None:
        return {}
    if not isinstance(actions, list):
        raise SpecError(f"{KV_HINTS}.actions must be a list")
    out: dict = {}
    for i, action in enumerate(actions):
        if not isinstance(action, dict):
            raise SpecError(f"{KV_HINTS}.actions[{i}] must be an object")
        kind, payload = action.get("type"), action.get("payload")
        if kind not in KV_HINT_PAYLOADS or action.get("version") != KV_HINT_VERSION:
            continue
        where = f"{KV_HINTS}.actions[{i}].payload"
        if payload is None:
            payload = {}
        if not isinstance(payload, dict):
            raise SpecError(f"{where} must be an object")
        only(payload, KV_HINT_PAYLOADS[kind], where)
        for key in KV_HINT_PAYLOADS[kind]:
            if key not in payload:
                raise SpecError(f"{where}.{key} is required for a {kind!r} action")
        if kind in ("retain", "pin"):
            ttl = integer(payload["ttl_ms"], 1, MAX_HINT_MS, f"{where}.ttl_ms")
            out["cache_ttl_ms"] = max(out.get("cache_ttl_ms", 0), ttl)
        elif kind == "prefetch":
            out["expected_tool_duration_ms"] = integer(payload["in_ms"], 0, MAX_HINT_MS, f"{where}.in_ms")
        else:
            out[kind] = True
    return out
