"""The per-request `sgl_memory` field: parsing and validation shared by the HTTP layer and the scheduler.

Clients send it as a top-level object on the native `/generate` body and on the OpenAI bodies;
the HTTP layer moves it into SGLang's `custom_params`, which is how it reaches the scheduler. Every
mechanism reads the one parsed `MemorySpec`; named options are checked against the config's lists.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from sgl_memory.config import MAX_BUDGET, MAX_HOPS, REPAIRS, IntentConfig, MemoryConfig, MemArtConfig, choices

FIELD = "sgl_memory"
MAX_ID_LEN = 256
# ids name sessions in the radix tree, in QueryMemory and in the session store: printable, no path syntax
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]*")


class SpecError(ValueError):
    """A bad `sgl_memory` field; the message is what the client sees with the 400."""


@dataclass(frozen=True)
class MemArtQuery:
    """`sgl_memory.memory`: the request carries only its new turn and the server places the
    session's relevant memory blocks before it (sgl_memory/memart)."""

    mode: str = "retrieve"
    top_k: int | None = None  # None: the server's memory.top_k
    norm: str | None = None
    agg: str | None = None
    scoring: str | None = None
    placement: str | None = None
    store: bool = True  # False: this turn is not added to the session's memory
    header: str | None = None  # None: the server's memory.header
    unit: str | None = None  # None: the server's memory.unit
    placed_tokens: int | None = None  # None: the server's memory.placed_tokens (0: no cap)
    recompute: str | None = None  # None: the server's memory.recompute
    recompute_ratio: float | None = None  # None: the server's keep.ratio
    hops: int | None = None  # None: the server's keep.hops
    probe: str | None = None  # internal: the id of the query pass the HTTP hook ran first
    # internal, the memory entries API (memart/writes.py): mode "write" records the prompt as the
    # entry `entry` (with its sentence `embedding`) or as the joint KV of group `group` at `version`;
    # mode "forget" drops the entries `forget`
    entry: str | None = None
    embedding: tuple[float, ...] | None = None
    group: int | None = None
    version: int | None = None
    forget: tuple[str, ...] = ()


MEMORY_MODES = ("retrieve",)
INTERNAL_MODES = ("probe", "write", "forget")  # sent by the server's own HTTP side only
MAX_TOP_K = 1 << 16
PRUNING_FIELDS = ("budget", "budget_mode", "system_prompt", "scorer", "layout", "ablation")


@dataclass(frozen=True)
class MemorySpec:
    session_id: str | None = None
    tenant: str | None = None
    budget: int | None = None
    scorer: str | None = None
    layout: str | None = None
    memory: MemArtQuery | None = None
    budget_mode: str | None = None
    system_prompt: str | None = None
    ablation: str | None = None
    # reads the session as its next turn would and changes nothing: no pruning event, nothing
    # recorded, captured or inserted into the tree (scoring a continuation under the session's state)
    readonly: bool = False

    @property
    def is_probe(self) -> bool:
        """The query pass the HTTP hook runs before a memory-mode request (memart/probe.py): it
        computes its prompt for KV memory's retrieval and leaves nothing behind, so no other
        mechanism acts on it."""
        return self.memory is not None and self.memory.mode == "probe"

    @property
    def reads_only(self) -> bool:
        """A pass that changes no session state: a readonly request, a probe, or a forget of no keys
        (the entries API reading a session's book; persistence loads the session for it, and writes nothing)."""
        return self.readonly or self.is_probe or (self.memory is not None and self.memory.mode == "forget" and not self.memory.forget)

    @property
    def is_internal(self) -> bool:
        """A pass the server's HTTP side sends for KV memory (a probe, an entry write or forget):
        no mechanism but memory (and persistence, which keeps what it changed) acts on it."""
        return self.memory is not None and self.memory.mode in INTERNAL_MODES

    def intent(self, base: IntentConfig) -> IntentConfig:
        """The server's intent config with this request's overrides."""
        overrides = {k: getattr(self, k) for k in PRUNING_FIELDS if getattr(self, k) is not None}
        return replace(base, **overrides)


def check_id(value, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise SpecError(f"{FIELD}.{name} must be a non-empty string of at most {MAX_ID_LEN} characters")
    if not ID_PATTERN.fullmatch(value) or ".." in value:
        raise SpecError(
            f"{FIELD}.{name} {value!r} is refused: use letters, digits and . _ : @ + = - "
            "(starting with a letter or digit, no '..')"
        )
    return value


def _choice(value, choices, where: str):
    """A named option: checked as a string first, so an object or a list is a 400, not a TypeError."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in choices:
        raise SpecError(f"{where} {value!r} is unknown; allowed: {', '.join(choices)}")
    return value


def _memory(raw, internal: bool) -> MemArtQuery | None:
    if raw is None:
        return None
    where = f"{FIELD}.memory"
    if not isinstance(raw, dict):
        raise SpecError(f"{where} must be an object")
    allowed = ("mode", "top_k", "norm", "agg", "scoring", "placement", "store", "header", "unit", "placed_tokens", "recompute",
               "recompute_ratio", "hops")  # fmt: skip
    allowed += ("probe", "entry", "embedding", "group", "version", "forget") if internal else ()
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    mode = _choice(raw.get("mode", "retrieve"), MEMORY_MODES + (INTERNAL_MODES if internal else ()), f"{where}.mode")
    top_k = raw.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_TOP_K):
        raise SpecError(f"{where}.top_k must be an integer in [1, {MAX_TOP_K}], got {top_k!r}")
    placed = raw.get("placed_tokens")
    if placed is not None and (isinstance(placed, bool) or not isinstance(placed, int) or not 0 <= placed <= MAX_BUDGET):
        raise SpecError(f"{where}.placed_tokens must be an integer in [0, {MAX_BUDGET}], got {placed!r}")
    for name in ("norm", "agg", "scoring", "placement", "header", "unit", "recompute"):
        _choice(raw.get(name), choices(MemArtConfig, name), f"{where}.{name}")
    ratio = raw.get("recompute_ratio")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1):
        raise SpecError(f"{where}.recompute_ratio must be a number in [0, 1], got {ratio!r}")
    hops = raw.get("hops")
    if hops is not None and (isinstance(hops, bool) or not isinstance(hops, int) or not 1 <= hops <= MAX_HOPS):
        raise SpecError(f"{where}.hops must be an integer in [1, {MAX_HOPS}], got {hops!r}")
    store = raw.get("store", True)
    if not isinstance(store, bool):
        raise SpecError(f"{where}.store must be true or false, got {store!r}")
    probe = raw.get("probe")
    if probe is not None and not isinstance(probe, str):
        raise SpecError(f"{where}.probe must be a string")
    return MemArtQuery(mode, top_k, raw.get("norm"), raw.get("agg"), raw.get("scoring"), raw.get("placement"), store,
                       header=raw.get("header"), unit=raw.get("unit"), placed_tokens=placed, recompute=raw.get("recompute"), recompute_ratio=None if ratio is None else float(ratio), hops=hops,
                       probe=probe, entry=raw.get("entry"), group=raw.get("group"), version=raw.get("version"),
                       embedding=None if raw.get("embedding") is None else tuple(raw["embedding"]),
                       forget=tuple(raw.get("forget", ())))  # fmt: skip


def parse(raw, internal: bool = False) -> MemorySpec:
    """`internal`: the field as the scheduler receives it, which may carry the HTTP hook's probe id."""
    if raw is None:
        return MemorySpec()
    if not isinstance(raw, dict):
        raise SpecError(f"{FIELD} must be an object, got {type(raw).__name__}")
    allowed = ("session_id", "tenant", *PRUNING_FIELDS, "memory", "readonly")
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise SpecError(f"{FIELD}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    budget = raw.get("budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET):
        raise SpecError(f"{FIELD}.budget must be an integer in [1, {MAX_BUDGET}], got {budget!r}")
    scorer = _choice(raw.get("scorer"), choices(IntentConfig, "scorer"), f"{FIELD}.scorer")
    layout = _choice(raw.get("layout"), choices(IntentConfig, "layout"), f"{FIELD}.layout")
    budget_mode = _choice(raw.get("budget_mode"), choices(IntentConfig, "budget_mode"), f"{FIELD}.budget_mode")
    system_prompt = _choice(raw.get("system_prompt"), choices(IntentConfig, "system_prompt"), f"{FIELD}.system_prompt")
    ablation = _choice(raw.get("ablation"), choices(IntentConfig, "ablation"), f"{FIELD}.ablation")
    memory = _memory(raw.get("memory"), internal)
    readonly = raw.get("readonly", False)
    if not isinstance(readonly, bool):
        raise SpecError(f"{FIELD}.readonly must be true or false, got {readonly!r}")
    if readonly and raw.get("session_id") is None:
        raise SpecError(f"{FIELD}.readonly needs {FIELD}.session_id: it reads a session")
    if memory is not None and raw.get("session_id") is None:
        raise SpecError(f"{FIELD}.memory needs {FIELD}.session_id: memory belongs to a session")
    return MemorySpec(
        session_id=check_id(raw.get("session_id"), "session_id"),
        tenant=check_id(raw.get("tenant"), "tenant"),
        budget=budget,
        scorer=scorer,
        layout=layout,
        memory=memory,
        budget_mode=budget_mode,
        system_prompt=system_prompt,
        ablation=ablation,
        readonly=readonly,
    )


def check_served(spec: MemorySpec, config: MemoryConfig) -> None:
    """A request that asks for a mechanism this server runs without is refused, naming the config
    key: serving it without the behaviour asked for would drop the request's intent silently."""
    asked = [f"{FIELD}.{name}" for name in PRUNING_FIELDS if getattr(spec, name) is not None]
    if asked and not config.intent.enabled:
        raise SpecError(f"{', '.join(asked)}: intent pruning is off on this server (intent.enabled: false)")
    if spec.memory is not None and not config.memory.enabled:
        raise SpecError(f"{FIELD}.memory: KV memory is off on this server (memory.enabled: false)")
    if spec.memory is not None and spec.memory.unit == "line" and config.memory.cut != "lines":
        raise SpecError(f"{FIELD}.memory.unit 'line': this server cuts memory blocks by tokens, not at lines "
                        "(memory.cut: tokens), so it does not know its blocks' lines")  # fmt: skip
    if spec.memory is not None and spec.memory.recompute in REPAIRS and not config.keep.enabled:
        raise SpecError(f"{FIELD}.memory.recompute {spec.memory.recompute!r}: the repair of memory blocks is off on this "
                        "server (keep.enabled: false)")  # fmt: skip


# The wire format: the raw field travels in SGLang's `custom_params` as a JSON string under FIELD
# (SGLang passes custom_params through to the scheduler's sampling params untouched).


def encode(custom_params: dict | None, raw) -> dict:
    """custom_params with the raw field put in (a new dict; the caller's is not changed)."""
    return {**(custom_params or {}), FIELD: json.dumps(raw)}


def decode(custom_params: dict | None):
    """The raw field out of custom_params (None when absent); a SpecError when it is not JSON."""
    raw = (custom_params or {}).get(FIELD)
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{FIELD} is not valid JSON: {exc}") from None
    return raw


def of_request(req) -> MemorySpec:
    """The spec a scheduler request carries in its custom_params (the HTTP layer put it there)."""
    return parse(decode(getattr(req.sampling_params, "custom_params", None)), internal=True)
