"""The contract between the server and a memory mechanism, and the registry of mechanisms.

A mechanism (intent pruning, session persistence, KV memory, KEEP, and the ones to come) is one
package with one class that subclasses `Mechanism` and registers under its name. The class
declares everything the server layers need from it, so that adding a mechanism edits no shared
file: its config section (`settings`), where it runs among the others (`order`), the keys of the
`sgl_memory` request field it owns (`fields`, `parse_request`, `check_request`), its per-request
metrics (`schema`, `observe`), its HTTP routes (`mount`) and what it does to requests on their
way in (`before_generate`, with the engine API of front.py), and what it does inside the forward
(`subscriber`, `dropper`, `position_shift`, `step_reads`, `placed_kv`). The tree (radix_cache.py)
builds the enabled ones into a `composition.Composition`, which calls them at the points of a
request's life below and combines their answers by the rules written there. What a mechanism
sees of SGLang's request and scheduler is views.RequestView and views.SchedulerView. Per-request
state lives in the mechanism or in a `slots.Slot` beside SGLang's request, never on it; no mechanism
imports another, and a mechanism reaches another's answer only through the tree (kvhost.KVHost).

Mechanisms are found by importing their modules: each package of sgl-memory that holds one names
its module in its `__init__` (`MECHANISM`), so a new mechanism is a new package and no list
elsewhere names it; a config's `plugins:` names more (any importable module that registers one).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from sgl_memory.core.capture import Subscriber
    from sgl_memory.core.decode import StepReads
    from sgl_memory.core.reuse import ReusedKV
    from sgl_memory.core.rows import RowDropper
    from sgl_memory.core.views import RequestView, SchedulerView

REGISTRY: dict[str, type[Mechanism]] = {}


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
    name: ClassVar[str]
    # Where the mechanism's admission runs among the others (lower first): the order in which they
    # rewrite a request's tokens. Checkpoint and release run in the same order. Each mechanism's
    # value says why it sits there (every `open` runs before the first `admit`).
    order: ClassVar[int]
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
    def parse_request(cls, raw: dict, internal: bool) -> Any:
        """Its part of a request's `sgl_memory` field (`raw`, a dict already checked to hold only
        known keys), a request.RequestPart, or None when the request sets none of `fields`.
        `internal`: the field as the scheduler receives it (it may carry the server's own keys).
        Raises request.SpecError naming the key for a bad value."""
        return None

    @classmethod
    def check_request(cls, part, config) -> None:
        """Refuse (request.SpecError) a part this server's config cannot serve, beyond the
        mechanism being off (the parser says that). Called with a part that is not None."""

    @classmethod
    def check_config(cls, config) -> None:
        """Refuse (config.ConfigError) a config whose other sections this mechanism's section
        needs and lacks (e.g. a repair mode whose mechanism is off)."""

    @classmethod
    def observe(cls, metrics: dict, meta_info: dict) -> None:
        """One finished request's metrics (HTTP process): record this mechanism's Prometheus series."""

    @classmethod
    def mount(cls, app, config, engine) -> None:
        """Add this mechanism's HTTP routes to SGLang's FastAPI app (HTTP process); `engine`
        (front.Engine) sends the mechanism's own passes."""

    @classmethod
    async def before_generate(cls, request, engine) -> None:
        """A generate request (front.Incoming) on its way in, before tokenization (HTTP process):
        may send passes of its own first (front.Engine) and rewrite the request's field. Raises
        request.SpecError for a field this server cannot serve (a 400). Called for every registered
        mechanism, enabled or not: a mechanism that is off refuses a request asking for it here."""

    # --- a request's life (scheduler process) ------------------------------------------------------

    @classmethod
    @abstractmethod
    def build(cls, config, tree, ctx) -> Mechanism:
        """The mechanism for this tree, from its config section and SGLang's TreeCacheBuildContext
        (model config, server args, TP rank; None in unit tests that build a bare tree). Raises
        ValueError for a server it cannot serve (its model, its attention backend); the TP and page
        sizes it cannot serve it declares instead (tp_refusal, page_refusal)."""

    def open(self, scheduler: SchedulerView, req: RequestView, spec) -> None:
        """Before any mechanism admits the request (scheduler thread): bring its session into this
        server's memory. Persistence loads a session seen by an earlier server from its file and
        hands the other mechanisms their part (the tree's import_session), so that every admission,
        whatever its order, sees the session's state."""

    def admit(self, scheduler: SchedulerView, req: RequestView, spec) -> None:
        """Before the request is queued (scheduler thread), after the mechanisms of lower order.
        May rewrite `req.origin_input_ids` and `req.extra_key` (through `namespace`), keep its
        per-request state, put KV into the tree (tree_fill.place), or abort the request with a
        client error."""

    def before_prefill(self, scheduler: SchedulerView, waiting: list[RequestView], running: bool) -> list:
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

    def branch_ids(self, req: RequestView) -> Any:
        """Where this request's path may leave the shared tree (tree_fill.py, branches): a function
        from the request's token ids (an int64 array) to the key id each would take at a branch of
        its own, or None for a plain path. The tree finds the branches on the path and reports them
        with `on_match`."""
        return None

    def on_match(self, req: RequestView, branches) -> None:
        """The branches (kvhost.Branches) the tree matched on the request's path, for a request
        whose `branch_ids` is not None."""

    def branches(self, req: RequestView):
        """Where the request's key in the tree takes branch ids instead of its tokens
        (kvhost.Branches; () for a plain path): the tree inserts its row under that key. At most one
        mechanism branches a given request's path (the tree raises if two do)."""
        return ()

    def on_checkpoint(self, req: RequestView, tree) -> RowEdit | None:
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
        SGLang after admission): the tree never releases it, so `on_release` does not run. Drop
        the per-request state `admit` kept outside the req."""

    # --- inside the model's forward (scheduler process): asked by the engine through the composition --

    def subscriber(self) -> Subscriber | None:
        """What this mechanism reads of the attention layers' inputs during prefill (capture.py), or
        None. Asked once, when the tree is built."""
        return None

    def dropper(self) -> RowDropper | None:
        """What says which prefill rows later layers stop computing (rows.py), or None. Asked once,
        when the tree is built; a dropper is also a subscriber (it takes the rows it recomputes)."""
        return None

    def position_shift(self, rid: str) -> int:
        """How far the request's model positions run from SGLang's (a layout that re-packed its KV
        moved them); 0: not at all. Asked for every request of every forward: keep it a lookup."""
        return 0

    def step_reads(self, rid: str) -> StepReads | None:
        """The positions each decode step of the request reads, per layer (decode.py); None: every
        position. Asked once per decode forward and request: keep it a lookup."""
        return None

    def placed_kv(self, req: RequestView) -> ReusedKV | None:
        """The KV this mechanism placed among the request's new tokens for a repair (reuse.py), which
        the repairing mechanism asks the tree for (KVHost.placed_kv); None: none."""
        return None

    def export_session(self, key) -> dict[str, torch.Tensor]:
        """What this mechanism holds for the session (tenant, id) that a later server needs to
        continue it, as named host tensors (session persistence stores them next to the session's
        path); {} when it holds nothing. Called off the scheduler thread."""
        return {}

    def import_session(self, key, tensors: dict[str, torch.Tensor]) -> None:
        """Take back what `export_session` gave, on a server that loads the session from its file;
        state this server already holds for the session is newer and is kept (when the file is
        newer, another server sharing the store wrote it, the session is dropped first)."""

    def describe_session(self, slot) -> dict[str, int | float | bool]:
        """A few numbers about this mechanism's slot of a session for an operator's inspector
        (GET /sgl_memory/sessions): sizes and counts, never contents. Called on the scheduler's
        thread with the slot the registry holds; {} says nothing."""
        return {}

    def drain(self, timeout: float | None = None) -> bool:
        """Return when the work queued so far is done (flush_cache, a clean shutdown, tests); False
        if `timeout` seconds passed first."""
        return True


# the config's top-level keys that are not a mechanism's section (config.py): no mechanism takes them
RESERVED_NAMES = ("plugins", "sessions")


def register(name: str):
    """Class decorator: the mechanism configured by section `name` of the config."""

    def wrap(cls: type[Mechanism]) -> type[Mechanism]:
        if name in RESERVED_NAMES:
            raise ValueError(f"mechanism {name!r}: the name is a config key of its own ({', '.join(RESERVED_NAMES)})")
        for attr in ("order", "settings"):
            if not hasattr(cls, attr):
                raise TypeError(f"mechanism {name!r} declares no {attr}")
        taken = {f: m.name for m in REGISTRY.values() if m.name != name for f in m.fields}
        clash = sorted(set(cls.fields) & set(taken))
        if clash:
            raise ValueError(
                f"mechanism {name!r}: request field key(s) {clash} belong to {sorted({taken[f] for f in clash})}"
            )
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return wrap


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


def ordered() -> list[type[Mechanism]]:
    """Every registered mechanism, by order (the name breaks ties)."""
    return sorted(REGISTRY.values(), key=lambda cls: (cls.order, cls.name))


def enabled(config) -> list[str]:
    """The mechanisms a config switches on, by order."""
    return [cls.name for cls in ordered() if config.section(cls.name).enabled]
