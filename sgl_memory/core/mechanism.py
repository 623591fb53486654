"""The contract between the server and a memory mechanism, and the registry of mechanisms.

A mechanism (intent pruning, session persistence, KV memory, KEEP, and the ones to come) is one
package with one class that subclasses `Mechanism` and registers under its name. The class
declares everything the server layers need from it, so that adding a mechanism edits no shared
file: its config section (`settings`), which mechanisms it runs after (`after`: the composition
derives the order from these and refuses a cycle), the repairs of placed KV it carries out
(`repairs`), the keys of the
`sgl_memory` request field it owns (`fields`, `parse_request`, `check_request`), its per-request
metrics (`schema`, `observe`), its HTTP routes (`mount`) and what it does to requests on their
way in (`before_generate`, with the engine API of front.py), and what it does inside the forward
(`subscriber`, `dropper`, and the capabilities below: `Branching`, `PositionShifting`,
`DecodeReading`, `KVPlacing`). The tree (radix_cache.py)
builds the enabled ones into a `composition.Composition`, which calls them at the points of a
request's life below and combines their answers by the rules written there. What a mechanism
sees of SGLang's request and scheduler is views.RequestView and views.SchedulerView. Per-request
state lives in tables of the tree's request store (requests.py), which the composition clears when
a request ends, never on SGLang's request; no mechanism imports another, and a mechanism reaches
another's answer only through the tree (kvhost.KVHost).

Mechanisms are found by importing their modules: each package of sgl-memory that holds one names
its module in its `__init__` (`MECHANISM`), so a new mechanism is a new package and no list
elsewhere names it; a config's `plugins:` names more (any importable module that registers one).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from sgl_memory.core.registry import Registry

if TYPE_CHECKING:
    from sgl_memory.core.capture import Subscriber
    from sgl_memory.core.config import MemoryConfig
    from sgl_memory.core.decode import StepReads
    from sgl_memory.core.front import Engine, Incoming
    from sgl_memory.core.kvhost import Branches, KVHost
    from sgl_memory.core.request import MemorySpec, RequestPart
    from sgl_memory.core.reuse import ReusedKV
    from sgl_memory.core.rows import RowDropper
    from sgl_memory.core.sessions import SessionKey
    from sgl_memory.core.views import RequestView, SchedulerView

REGISTRY: Registry[type[Mechanism]] = Registry("mechanism")

# Mechanism.branch_ids: the request's token ids (int64) -> the key id each takes at a branch of its own
BranchIds = Callable[[np.ndarray], np.ndarray]


class BuildContext(Protocol):
    """What `Mechanism.build` reads of SGLang's TreeCacheBuildContext."""

    model_config: Any  # the served model's (its hf_config: RoPE, heads, layers)
    server_args: Any  # the server's arguments (model path, served name)
    tp_rank: int
    tp_size: int


@dataclass(frozen=True)
class MetricsSchema:
    """How the server aggregates a mechanism's per-request metrics (GET /sgl_memory/stats and the
    per-mechanism request counts in Prometheus). Each name is a key of the dict the mechanism
    attaches to its requests (metrics.attach)."""

    marker: str | None = None  # present in a request's metrics when the mechanism acted on it
    summed: tuple[str, ...] = ()  # numbers summed over requests (stats `totals` and `means`)
    maxed: tuple[str, ...] = ()  # numbers whose largest value is kept (stats `maxima`)
    counted: tuple[str, ...] = ()  # values from a small fixed set, counted per value (stats `counts`)
    flagged: tuple[str, ...] = ()  # set (truthy) on a request that went wrong (stats `flags`)


@dataclass
class RowEdit:
    """What a mechanism did to a request's slot-map row at its checkpoint (Mechanism.on_checkpoint):
    positions pointed at the tree's sentinel slot, slots given back, and whether the row may still
    enter the tree."""

    dropped: torch.Tensor  # positions now pointing at the sentinel
    freed: int
    copied: int = 0  # kept slots of a shared path copied into the row's own (intent's dead_slot)
    position_shift: int = 0  # a re-packed row: model position = SGLang position + shift (Mechanism.position_shift)
    private: bool = False  # the row no longer matches its tokens' positions: the tree keeps it out


class Mechanism(ABC):
    """A memory mechanism: what it declares to the server and what it does at each point of a
    request's life, as the module docstring sets out."""

    name: ClassVar[str]
    # The mechanisms whose hooks run before this one's, where both are registered: the order in which
    # admissions rewrite a request's tokens, and in which checkpoint and release run. Each
    # mechanism's comment says why it runs after those; `ordered` derives one order from every
    # declaration (ties by name) and refuses a cycle. Every `open` runs before the first `admit`.
    after: ClassVar[tuple[str, ...]] = ()
    # the repairs of placed KV (`memory.recompute` values, reuse.ReusedKV.method) it carries out
    repairs: ClassVar[tuple[str, ...]] = ()
    settings: ClassVar[type]  # its config section: a frozen dataclass with an `enabled` field and defaults
    fields: ClassVar[tuple[str, ...]] = ()  # the keys of the `sgl_memory` request field it owns
    schema: ClassVar[MetricsSchema] = MetricsSchema()
    # other mechanism -> why the two cannot run in one server (yet); checked at start-up (composition.check)
    conflicts: ClassVar[dict[str, str]] = {}
    needs_sentinel: ClassVar[bool] = False  # points positions of rows at the tree's sentinel slot (page size 1)
    # why it is not correct under tensor parallelism yet (None: it is), and why it needs page size 1
    # (None: any page size); start-up refuses such a server with the reason (composition.check)
    tp_refusal: ClassVar[str | None] = None
    page_refusal: ClassVar[str | None] = None
    # the server's own passes for another mechanism (request.RequestPart.internal) are not admitted
    # here, unless this is set: persistence keeps what such a pass changed in the session's file
    follows_internal: ClassVar[bool] = False
    # another mechanism whose section turns this one on when this one's section does not say
    # (`enabled` absent): a mechanism that serves another's default (config.from_dict)
    enabled_with: ClassVar[str | None] = None
    # export_session names whose tensors hold KV [layers, tokens, heads, dim]: "k" keys or "v" values,
    # which the session store may quantize like the session's own KV; the rest are stored exactly
    kv_state: ClassVar[dict[str, str]] = {}

    # --- declarations: read by the config, the request parser, the HTTP layer (any process) ------

    @classmethod
    def parse_request(cls, raw: dict[str, Any], internal: bool) -> RequestPart | None:
        """Its part of a request's `sgl_memory` field (`raw`, a dict already checked to hold only
        known keys), a request.RequestPart, or None when the request sets none of `fields`.
        `internal`: the field as the scheduler receives it (it may carry the server's own keys).
        Raises request.SpecError naming the key for a bad value."""
        return None

    @classmethod
    def check_request(cls, part: RequestPart, config: MemoryConfig) -> None:
        """Refuse (request.SpecError) a part this server's config cannot serve, beyond the
        mechanism being off (the parser says that). Called with a part that is not None."""

    @classmethod
    def check_config(cls, config: MemoryConfig) -> None:
        """Refuse (config.ConfigError) a config whose other sections this mechanism's section
        needs and lacks (e.g. a repair mode whose mechanism is off)."""

    @classmethod
    def observe(cls, metrics: dict[str, Any], meta_info: dict[str, Any]) -> None:
        """One finished request's metrics (HTTP process): record this mechanism's Prometheus series."""

    @classmethod
    def mount(cls, app: Any, config: MemoryConfig, engine: Engine) -> None:
        """Add this mechanism's HTTP routes to SGLang's FastAPI app (HTTP process); `engine`
        (front.Engine) sends the mechanism's own passes."""

    @classmethod
    def banner(cls, section: Any) -> str | None:
        """What the server's ready line says of this mechanism, given its section (enabled or not);
        None: nothing."""
        return None

    @classmethod
    async def before_generate(cls, request: Incoming, engine: Engine) -> None:
        """A generate request (front.Incoming) on its way in, before tokenization (HTTP process):
        may send passes of its own first (front.Engine) and rewrite the request's field. Raises
        request.SpecError for a field this server cannot serve (a 400). Called for every registered
        mechanism, enabled or not: a mechanism that is off refuses a request asking for it here."""

    # --- a request's life (scheduler process) ------------------------------------------------------

    @classmethod
    @abstractmethod
    def build(cls, config: Any, tree: KVHost, ctx: BuildContext | None) -> Mechanism:
        """The mechanism for this tree, from its config section (`settings`) and SGLang's TreeCacheBuildContext
        (model config, server args, TP rank; None in unit tests that build a bare tree). Raises
        ValueError for a server it cannot serve (its model, its attention backend); the TP and page
        sizes it cannot serve it declares instead (tp_refusal, page_refusal)."""

    def open(self, scheduler: SchedulerView, req: RequestView, spec: MemorySpec) -> None:
        """Before any mechanism admits the request (scheduler thread): bring its session into this
        server's memory. Persistence loads a session seen by an earlier server from its file and
        hands the other mechanisms their part (the tree's import_session), so that every admission,
        whatever its order, sees the session's state."""

    def admit(self, scheduler: SchedulerView, req: RequestView, spec: MemorySpec) -> None:
        """Before the request is queued (scheduler thread), after the mechanisms it runs after.
        May rewrite `req.origin_input_ids` and `req.extra_key` (through `namespace`), keep its
        per-request state (in the tree's request store, requests.py), put KV into the tree
        (tree_fill.place), or abort the request with a client error."""

    def before_prefill(self, scheduler: SchedulerView, waiting: list[RequestView], running: bool) -> list[RequestView]:
        """Before the scheduler forms a prefill batch (scheduler thread), with its waiting queue in
        order and whether requests are running (they will give their KV slots back when they end):
        a mechanism may bring KV back for requests it deferred at admission. Returns the
        requests that must not run in this batch (their KV is not back yet): they keep their place
        in the queue for the next one. Must not hold back a request forever (the tree lets go of
        every hold when nothing can run)."""
        return []

    def match_limit(self, req: RequestView) -> int | None:
        """The most of the request's first tokens the tree may give it from the cache (None: this
        mechanism sets no limit). A mechanism that reads rows as the prefill computes them (a
        scorer's query rows, a probe's) needs them prefilled by the request itself."""
        return None

    def on_checkpoint(self, req: RequestView, tree: KVHost) -> RowEdit | None:
        """At the end of the request's prefill, before its row is inserted into the tree. Returns the
        RowEdit it made (edits are made in place, through the tree's `row(req)`) or None when it left
        the row as it is. Every mechanism is
        called, by order; at most one returns an edit for a given request (the tree raises if two
        do: their edits would not compose)."""
        return None

    def on_release(self, req: RequestView) -> None:
        """After the tree released the request (scheduler thread): attach its metrics, copy out what
        it keeps (tree_fill.copy_path) and queue the rest of the work for its worker."""

    def on_drop(self, req: RequestView) -> None:
        """The request was aborted before it held a KV row (in the waiting queue, or refused by
        SGLang after admission): the tree never releases it, so `on_release` does not run. Undo
        what `admit` started beyond its request state (the composition ends that): a restore
        being unpacked, a hold."""

    # --- inside the model's forward (scheduler process): asked by the engine through the composition --

    def subscriber(self) -> Subscriber | None:
        """What this mechanism reads of the attention layers' inputs during prefill (capture.py), or
        None. Asked once, when the tree is built."""
        return None

    def dropper(self) -> RowDropper | None:
        """What says which prefill rows later layers stop computing (rows.py), or None. Asked once,
        when the tree is built; a dropper is also a subscriber (it takes the rows it recomputes)."""
        return None

    def export_session(self, key: SessionKey) -> dict[str, torch.Tensor]:
        """What this mechanism holds for the session (tenant, id) that a later server needs to
        continue it, as named host tensors (session persistence stores them next to the session's
        path); {} when it holds nothing. Called off the scheduler thread."""
        return {}

    def import_session(self, key: SessionKey, tensors: dict[str, torch.Tensor]) -> None:
        """Take back what `export_session` gave, on a server that loads the session from its file;
        state this server already holds for the session is newer and is kept (when the file is
        newer, another server sharing the store wrote it, the session is dropped first)."""

    def describe_session(self, state: Any) -> dict[str, int | float | bool | None]:
        """A few numbers about this mechanism's state of a session for an operator's inspector
        (GET /sgl_memory/sessions): sizes and counts, never contents. Called on the scheduler's
        thread with the state the registry holds; {} says nothing."""
        return {}

    def drain(self, timeout: float | None = None) -> bool:
        """Return when the work queued so far is done (flush_cache, a clean shutdown, tests); False
        if `timeout` seconds passed first."""
        return True


# --- capabilities: hooks only some mechanisms answer ------------------------------------------------
# A mechanism that has one subclasses it beside Mechanism; the composition asks only those that do.
# Each hook is answered for at most one mechanism per request (the composition raises if two do).


class Branching(ABC):
    """Its requests' paths may leave the shared tree at branches of their own (intent's pruned paths:
    their KV is not what their tokens alone would give)."""

    @abstractmethod
    def branch_ids(self, req: RequestView) -> BranchIds | None:
        """Where this request's path may leave the shared tree (tree_fill.py, branches): a function
        from the request's token ids (an int64 array) to the key id each would take at a branch of
        its own, or None for a plain path. The tree finds the branches on the path and reports them
        with `on_match`."""

    @abstractmethod
    def on_match(self, req: RequestView, branches: Branches) -> None:
        """The branches (kvhost.Branches) the tree matched on the request's path, for a request
        whose `branch_ids` is not None."""

    @abstractmethod
    def branches(self, req: RequestView) -> Branches:
        """Where the request's key in the tree takes branch ids instead of its tokens
        (kvhost.Branches; () for a plain path): the tree inserts its row under that key."""


class PositionShifting(ABC):
    """It may re-pack a request's KV so that its model positions no longer are SGLang's."""

    @abstractmethod
    def position_shift(self, rid: str) -> int:
        """How far the request's model positions run from SGLang's (a layout that re-packed its KV
        moved them); 0: not at all. Asked for every request of every forward: keep it a lookup."""


class DecodeReading(ABC):
    """It chooses the positions a decode step of a request reads (SentenceKV)."""

    @abstractmethod
    def step_reads(self, rid: str) -> StepReads | None:
        """The positions each decode step of the request reads, per layer (decode.py); None: every
        position. Asked once per decode forward and request: keep it a lookup."""


class KVPlacing(ABC):
    """It places reused KV among a request's new tokens for another mechanism to repair (memory)."""

    @abstractmethod
    def placed_kv(self, req: RequestView) -> ReusedKV | None:
        """The KV this mechanism placed among the request's new tokens for a repair (reuse.py), which
        the repairing mechanism asks the tree for (KVHost.placed_kv); None: none."""


CAPABILITIES: tuple[type, ...] = (Branching, PositionShifting, DecodeReading, KVPlacing)


# the config's top-level keys that are not a mechanism's section (config.py): no mechanism takes them
RESERVED_NAMES = ("plugins", "sessions")


def _check(name: str, cls: type[Mechanism]) -> None:
    if name in RESERVED_NAMES:
        raise ValueError(f"mechanism {name!r}: the name is a config key of its own ({', '.join(RESERVED_NAMES)})")
    if not hasattr(cls, "settings"):
        raise TypeError(f"mechanism {name!r} declares no settings")
    taken = {f: m.name for m in REGISTRY.values() if m.name != name for f in m.fields}
    clash = sorted(set(cls.fields) & set(taken))
    if clash:
        raise ValueError(
            f"mechanism {name!r}: request field key(s) {clash} belong to {sorted({taken[f] for f in clash})}"
        )
    offered = {r: m.name for m in REGISTRY.values() if m.name != name for r in m.repairs}
    twice = sorted(set(cls.repairs) & set(offered))
    if twice:
        raise ValueError(f"mechanism {name!r}: repair(s) {twice} are {sorted({offered[r] for r in twice})}'s")


def register(name: str) -> Callable[[type[Mechanism]], type[Mechanism]]:
    """Class decorator: the mechanism configured by section `name` of the config."""
    return REGISTRY.register(name, _check)


@functools.cache
def builtin() -> tuple[str, ...]:
    """The modules of the mechanisms that ship with sgl-memory: for each package beside the core
    floor whose `__init__` sets `MECHANISM`, that module of the package."""
    top = __name__.split(".")[0]
    found = []
    for info in pkgutil.iter_modules([str(Path(__file__).resolve().parents[1])]):
        if info.ispkg:
            package = importlib.import_module(f"{top}.{info.name}")
            if hasattr(package, "MECHANISM"):
                found.append(f"{package.__name__}.{package.MECHANISM}")
    return tuple(found)


def discover(plugins: tuple[str, ...] = ()) -> None:
    """Import the built-in mechanisms and the `plugins` modules, which registers them."""
    for module in builtin() + tuple(plugins):
        importlib.import_module(module)


def in_order(classes: Iterable[type[Mechanism]]) -> list[type[Mechanism]]:
    """`classes`, each after the ones it runs `after`, directly or through a registered mechanism
    that is not among them (so a subset keeps the whole order); the name breaks ties: among those
    whose predecessors are placed, the first by name goes next. A name that is neither among them
    nor registered is no constraint. Raises ValueError naming the mechanisms of a cycle."""
    given = {cls.name: cls for cls in classes}

    def predecessors(cls: type[Mechanism]) -> set[str]:
        found: set[str] = set()
        stack = list(cls.after)
        while stack:
            name = stack.pop()
            other = given.get(name) or (REGISTRY.get(name) if name in REGISTRY else None)
            if name not in found and other is not None:
                found.add(name)
                stack.extend(other.after)
        return found

    pending = {name: predecessors(cls) & set(given) for name, cls in given.items()}
    placed: list[type[Mechanism]] = []
    while pending:
        ready = sorted(name for name, before in pending.items() if not before - {name})
        if not ready:
            raise ValueError(
                "the mechanisms' `after` declarations form a cycle among "
                + ", ".join(f"{name} (after {', '.join(given[name].after)})" for name in sorted(pending))
            )
        placed.append(given[ready[0]])
        del pending[ready[0]]
        for before in pending.values():
            before.discard(ready[0])
    return placed


def ordered() -> list[type[Mechanism]]:
    """Every registered mechanism, in the order their `after` declarations give (in_order)."""
    return in_order(REGISTRY.values())


def repairer(method: str) -> str | None:
    """The registered mechanism that carries out the repair `method` of placed KV (Mechanism.repairs),
    or None: no mechanism repairs it (`none`, `full`: the placer itself handles those)."""
    return next((cls.name for cls in REGISTRY.values() if method in cls.repairs), None)


def enabled(config: MemoryConfig) -> list[str]:
    """The mechanisms a config switches on, by order."""
    return [cls.name for cls in ordered() if config.section(cls.name).enabled]
