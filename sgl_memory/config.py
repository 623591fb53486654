"""Typed sgl-memory configuration, one dataclass per mechanism, loaded from YAML.

Loading is strict: an unknown key or a value of the wrong type or outside its allowed set stops
start-up with a message naming the key path and what is allowed. Later mechanisms add their own
section dataclass and one field on `MemoryConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

CONFIG_ENV = "SGLMEMORY_CONFIG"  # how the launcher hands the file to SGLang's child processes
MAX_BUDGET = (1 << 31) - 1  # beyond any context length; keeps every metric inside 64-bit JSON integers
MAX_HOPS = 64  # keep's importance propagation rounds (it stops earlier once its set is stable)


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class IntentConfig:
    """Cross-turn intent pruning (IntentKV): see sgl_memory/intent/README.md."""

    enabled: bool = False
    budget: int = 2048  # prompt positions kept live per request after its prefill (see budget_mode)
    # total: the budget counts the forced set (system prefix, latest message) too; history: it
    # counts only the compressible history between them, the forced set is kept on top (IntentKV's
    # budget, which lets a budget sit below an agent's tool docs)
    # adaptive: a history budget per session that follows it (intent/sessions.py AdaptiveBudget),
    # starting at `budget`, within [budget_floor, budget_ceiling]
    budget_mode: Literal["total", "history", "adaptive"] = "total"
    budget_floor: int = 128
    budget_ceiling: int = 8192
    grow_at: float = 0.3  # the scorer's mass on the candidates left out above which the budget grows
    shrink_at: float = 0.9  # the share of the last event's kept history kept again above which it shrinks
    budget_step: float = 1.25  # the factor of one change
    # forced: the system prompt (an agent's tool docs sit there) always stays live; compressible: it
    # competes with the history for the budget, only the latest message is forced
    system_prompt: Literal["forced", "compressible"] = "forced"
    scorer: Literal["memory", "memory_pool", "query", "learned", "streaming_llm", "snapkv", "h2o", "random"] = "memory_pool"
    # learned (Phase 2, intent/head.py): the head's safetensors file; "" = the head shipped for the
    # served model (sgl_memory/intent/heads/), if there is one
    head: str = ""
    ablation: Literal["none", "memory", "x_attn", "residual"] = "none"  # the learned head's Appendix-B switches
    # training data: every compression event of scorer learned writes the head's inputs and the
    # prompt's tokens there, one safetensors file per request (scripts/train_pruner.py reads them)
    trace_dir: str = ""
    layout: Literal["dead_slot", "compact"] = "dead_slot"
    decay: float = 0.9  # QueryMemory EMA weight of the past
    session_capacity: int = 1024  # QueryMemory entries kept (LRU)
    roles: Literal["chatml", "llama3", "none"] = "chatml"  # how message boundaries are found in tokens
    query_tail: int = 32  # forced tail when no role marker is found
    session_prefix_tokens: int = 64  # N of the "hash of the first N input tokens" session key
    window: int = 32  # SnapKV / H2O observation window (last prompt query rows)
    kernel: int = 7  # max-pool smoothing width of SnapKV and memory_pool
    sinks: int = 4  # StreamingLLM attention-sink tokens

    def validate(self, path: str) -> None:
        _require(1 <= self.budget <= MAX_BUDGET, f"{path}.budget", f"an integer in [1, {MAX_BUDGET}]")
        _require(0.0 <= self.decay < 1.0, f"{path}.decay", "a number in [0, 1)")
        _require(1 <= self.budget_floor <= self.budget_ceiling <= MAX_BUDGET, f"{path}.budget_floor / budget_ceiling",
                 f"integers with 1 <= floor <= ceiling <= {MAX_BUDGET}")  # fmt: skip
        _require(0.0 < self.grow_at <= 1.0, f"{path}.grow_at", "a number in (0, 1]")
        _require(0.0 < self.shrink_at <= 1.0, f"{path}.shrink_at", "a number in (0, 1]")
        _require(self.budget_step > 1.0, f"{path}.budget_step", "a number > 1")
        _require(self.session_capacity >= 1, f"{path}.session_capacity", "an integer >= 1")
        for name in ("query_tail", "session_prefix_tokens", "window", "kernel"):
            _require(getattr(self, name) >= 1, f"{path}.{name}", "an integer >= 1")
        _require(self.kernel % 2 == 1, f"{path}.kernel", "an odd integer >= 1")
        _require(self.sinks >= 0, f"{path}.sinks", "an integer >= 0")


@dataclass(frozen=True)
class PersistConfig:
    """Per-session persistent KV store: see sgl_memory/persist/README.md."""

    enabled: bool = False
    dir: str = "~/.cache/sgl-memory/sessions"
    # q8 by default: a Q4 restore changed half of the session's greedy answers (bench/persist_restart);
    # bf16 / fp32: unquantized (the pool's dtype: exact)
    quant: Literal["q4", "q8", "bf16", "fp32"] = "q8"
    kivi: bool = True  # keys grouped per channel over tokens (KIVI), values per token: see persist/README.md
    write_policy: Literal["on_finish", "off"] = "on_finish"  # off: restore from the store, never write
    quota_bytes: int = 8 << 30  # disk; least recently used session files go first
    warm_bytes: int = 1 << 30  # host memory for stored-form session KV (the warm tier)
    match_threshold: float = 0.5  # DIVERGE reuses the stored path when this share of its text matches

    def validate(self, path: str) -> None:
        _require(self.quota_bytes >= 0, f"{path}.quota_bytes", "an integer >= 0")
        _require(self.warm_bytes >= 0, f"{path}.warm_bytes", "an integer >= 0")
        _require(0.0 <= self.match_threshold <= 1.0, f"{path}.match_threshold", "a number in [0, 1]")


@dataclass(frozen=True)
class MemArtConfig:
    """KV memory blocks retrieved per request (MemArt): see sgl_memory/memart/README.md."""

    enabled: bool = False
    block_size: int = 16
    top_k: int = 1024  # ranked blocks considered; placed_tokens decides what is placed
    norm: Literal["softmax", "rr"] = "softmax"
    agg: Literal["sum", "max"] = "max"
    capacity_blocks: int = 4096  # per session; beyond it the eviction policy drops (or merges) blocks
    pool_bytes: int = 4 << 30  # host memory of all sessions' pools; least recently used sessions go first
    eviction: Literal["lru", "fifo", "merge"] = "lru"
    scoring: Literal["exact", "aabb"] = "exact"  # a block's logit: its best key's, or the AABB bound
    score_layers: float = 0.5  # the share of layers, from the first, whose queries score blocks
    score_tokens: Literal["text", "query", "all"] = "text"  # text: the last user turn without markup
    roles: Literal["chatml", "llama3", "none"] = "chatml"  # chat template family that marks turns
    placement: Literal["first", "after_system"] = "first"  # where the blocks go in the prompt
    rr_constant: float = 60.0  # c in 1 / (rank + c)
    cut: Literal["tokens", "lines"] = "lines"  # lines: a block also ends after each line end; tokens: block_size alone
    # placed with each chosen block: the first block of its turn (turn), of its line (line, where
    # blocks are cut at lines), or both; a block from the middle of a turn then has its context
    header: Literal["none", "turn", "line", "turn_line"] = "none"
    # what a chosen block brings with it: nothing more (block), or the rest of its line (line: a
    # dialogue turn, a tool result's row, whole; needs cut: lines)
    unit: Literal["block", "line"] = "line"
    placed_tokens: int = 2048  # memory tokens placed at most per request, units and headers included (0: top_k alone bounds them)
    # what repairs the placed blocks' KV (computed in other contexts): none (reused as placed), keep
    # and cacheblend (recompute a selected share, sgl_memory/keep; needs keep.enabled), full (the
    # blocks' tokens prefilled again in the request's context)
    recompute: Literal["none", "keep", "cacheblend", "full"] = "none"
    # memory entries written by key (POST /sgl_memory/memory/write, memart/entries.py): grouped by
    # MiniLM sentence embeddings (an entry joins the nearest group at cosine >= group_threshold); a
    # group unchanged for static_after writes gets a joint KV and is retrieved as one unit
    groups: bool = True
    group_threshold: float = 0.4
    static_after: int = 3

    def validate(self, path: str) -> None:
        _require(self.block_size >= 1, f"{path}.block_size", "an integer >= 1")
        _require(-1 <= self.group_threshold <= 1, f"{path}.group_threshold", "a number in [-1, 1]")
        _require(self.static_after >= 1, f"{path}.static_after", "an integer >= 1")
        _require(self.top_k >= 1, f"{path}.top_k", "an integer >= 1")
        _require(self.capacity_blocks >= 1, f"{path}.capacity_blocks", "an integer >= 1")
        _require(self.pool_bytes >= 1, f"{path}.pool_bytes", "an integer >= 1")
        _require(self.rr_constant >= 0, f"{path}.rr_constant", "a number >= 0")
        _require(0 < self.score_layers <= 1, f"{path}.score_layers", "a number in (0, 1]")
        _require(self.placed_tokens >= 0, f"{path}.placed_tokens", "an integer >= 0")
        _require(self.unit != "line" or self.cut == "lines", f"{path}.unit", "block, or line with cut: lines (lines are known where blocks are cut at them)")


@dataclass(frozen=True)
class KeepConfig:
    """Recomputation of the placed memory blocks that matter (KEEP, and CacheBlend as its baseline):
    see sgl_memory/keep/README.md."""

    enabled: bool = False
    # share of the placed segments (keep) or tokens (cacheblend) recomputed at layer 1; layer 0
    # recomputes all of them, and layer l the share ratio ** (1 + decay * (l - 1) / (layers - 2)),
    # each layer's set inside the one before (a row dropped at a layer has no hidden state after it)
    ratio: float = 0.3
    decay: float = 0.5
    hops: int = 4  # importance propagation rounds of keep (1: the new turn's attention alone)
    # drop the rows no later layer recomputes from the hidden states (the speed-up, on backends that
    # attend a row layout); false: write the placed KV over them at full cost (the same attention)
    compact: bool = True
    # how the placed KV reaches each layer (keep/loading.py): when the layer starts (sync), while the
    # layer before computes (next_layer), or that plus preloading the rows no later layer
    # recomputes while the loader is idle (balanced, KEEP's layer-balanced loading)
    loading: Literal["sync", "next_layer", "balanced"] = "balanced"
    tier_bandwidth: float = 0.0  # bytes/s of a simulated slower tier for the placed KV (0: none)
    trace_dir: str = ""  # diagnostics: each repaired request's memory KV and selections, one file per request

    def validate(self, path: str) -> None:
        _require(0.0 <= self.ratio <= 1.0, f"{path}.ratio", "a number in [0, 1]")
        _require(self.decay >= 0.0, f"{path}.decay", "a number >= 0")
        _require(1 <= self.hops <= MAX_HOPS, f"{path}.hops", f"an integer in [1, {MAX_HOPS}]")
        _require(self.tier_bandwidth >= 0.0, f"{path}.tier_bandwidth", "a number >= 0 (bytes per second; 0: no simulated tier)")


@dataclass(frozen=True)
class MemoryConfig:
    intent: IntentConfig = field(default_factory=IntentConfig)
    persist: PersistConfig = field(default_factory=PersistConfig)
    memory: MemArtConfig = field(default_factory=MemArtConfig)
    keep: KeepConfig = field(default_factory=KeepConfig)

    def validate(self, path: str) -> None:
        if self.memory.recompute in REPAIRS and not self.keep.enabled:
            raise ConfigError(f"memory.recompute: {self.memory.recompute!r} needs keep.enabled: true")


REPAIRS = ("keep", "cacheblend")  # the recompute modes the keep mechanism carries out


def choices(section: type, name: str) -> tuple[str, ...]:
    """The allowed values of a named option (a Literal field): the one list the request field's
    validation reads too. Each is the key set of its mechanism's registry (a unit test holds them equal)."""
    return typing.get_args(typing.get_type_hints(section)[name])


def _require(ok: bool, key: str, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: invalid value; allowed: {allowed}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: {', '.join(map(str, choices))}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: true, false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: {value!r} is not allowed; expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: {value!r} is not allowed; expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: {value!r} is not allowed; expected a string")
        return value
    raise TypeError(f"unsupported config field type {tp} at {key}")


def _build(cls: type, data: Any, path: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in hints:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{where}: unknown key; allowed keys: {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate:
        validate(path)
    return obj


def from_dict(data: dict | None) -> MemoryConfig:
    return _build(MemoryConfig, data, "")


def load(path: str | os.PathLike | None) -> MemoryConfig:
    if path is None:
        return MemoryConfig()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read memory config {p}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None


def from_env() -> MemoryConfig:
    """The config of this server, in any of its processes (the launcher exports the path), read
    once per process: a server serves the config it started with. Read again per request, a file
    edited (or rewritten by another run) while the server runs made the HTTP process refuse what
    its scheduler serves."""
    return _load_once(os.environ.get(CONFIG_ENV) or None)


@functools.cache
def _load_once(path: str | None) -> MemoryConfig:
    return load(path)
