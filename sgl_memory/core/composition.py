"""The enabled mechanisms of one server, composed: the one place that says in which order their
hooks run and how their answers combine.

The tree (engine/radix_cache.py) builds one `Composition` from the config once it has checked
that the enabled mechanisms can run together at its tensor-parallel size and page size (`check`),
and the engine asks the composition, never a mechanism by name and never a module-level registry.

Each method below applies one hook's rule: who is asked, in which order, and how their answers
combine; docs/architecture.md ("How mechanisms compose") has them as one table, and
tests/test_composition.py holds the code to it. "At most one" rules fail loudly: two mechanisms
that both edit a row (or branch a path, or choose a decode step's reads) for one request do not
compose, which is an error in the mechanisms, not in the request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from sgl_memory.core.config import ConfigError, MemoryConfig
from sgl_memory.core.mechanism import (
    REGISTRY,
    BranchIds,
    Branching,
    DecodeReading,
    KVPlacing,
    Mechanism,
    PositionShifting,
    enabled,
    in_order,
)
from sgl_memory.core.requests import RequestStore

if TYPE_CHECKING:
    from sgl_memory.core.decode import StepReads
    from sgl_memory.core.kvhost import Branches, KVHost
    from sgl_memory.core.mechanism import RowEdit
    from sgl_memory.core.request import MemorySpec
    from sgl_memory.core.reuse import ReusedKV
    from sgl_memory.core.sessions import SessionKey
    from sgl_memory.core.views import RequestView, SchedulerView

A = TypeVar("A")


def only_one(answers: Iterable[tuple[str, A]], what: str) -> A | None:
    """The one non-empty answer of (mechanism name, answer) pairs, or None; two raise naming both."""
    given = [(name, answer) for name, answer in answers if answer]
    if len(given) > 1:
        raise RuntimeError(f"{' and '.join(name for name, _ in given)} each {what}; at most one mechanism may")
    return given[0][1] if given else None


def scale_refusals(cls: type[Mechanism]) -> tuple[str | None, str | None]:
    """Why the mechanism refuses a page size > 1 and a TP size > 1 (None: it serves it)."""
    page = cls.page_refusal or (
        "it points single positions at the tree's sentinel slot" if cls.needs_sentinel else None
    )
    return page, cls.tp_refusal


def problems(config: MemoryConfig, tp_size: int = 1, page_size: int = 1) -> list[str]:
    """Why the enabled mechanisms cannot run together, or not at this tensor-parallel size and page
    size, one line each (empty: they can)."""
    names = enabled(config)
    found = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            why = REGISTRY[a].conflicts.get(b) or REGISTRY[b].conflicts.get(a)
            if why:
                found.append(f"{a}.enabled and {b}.enabled together are not supported yet: {why}")
    for name in names:
        page, tp = scale_refusals(REGISTRY[name])
        if tp_size > 1 and tp:
            found.append(f"{name} is not correct under tensor parallelism yet (TP size {tp_size}): {tp}")
        if page_size > 1 and page:
            found.append(f"{name} needs page size 1 (got {page_size}): {page}")
    return found


def check(config: MemoryConfig, tp_size: int = 1, page_size: int = 1) -> None:
    """The start-up guard: a ConfigError naming every problem (`problems`). The tree calls it with
    the sizes SGLang resolved; our launcher calls it before anything starts, and again once it has
    resolved them."""
    found = problems(config, tp_size, page_size)
    if found:
        raise ConfigError("; ".join(found))


class Composition:
    """The built mechanisms of one tree, in the order their declarations give
    (mechanism.in_order), the rules of the module docstring, and the end of each request's state
    (the tree's request store: requests.py) when the request ends."""

    def __init__(self, mechanisms: list[Mechanism], requests: RequestStore | None = None):
        rank = {cls.name: i for i, cls in enumerate(in_order(type(m) for m in mechanisms))}
        self.mechanisms = sorted(mechanisms, key=lambda m: rank[m.name])
        self.requests = requests if requests is not None else RequestStore()
        # asked once: every subscriber is fed each prefill forward; a row is dropped when a dropper
        # drops it and no other subscriber reads it (engine/layers.py)
        self.subscribers = [s for m in self.mechanisms if (s := m.subscriber()) is not None]
        self.droppers = [d for m in self.mechanisms if (d := m.dropper()) is not None]
        # asked per forward and request: only the mechanisms that answer at all
        self._branching = [m for m in self.mechanisms if isinstance(m, Branching)]
        self._shifting = [m for m in self.mechanisms if isinstance(m, PositionShifting)]
        self._reading = [m for m in self.mechanisms if isinstance(m, DecodeReading)]
        self._placing = [m for m in self.mechanisms if isinstance(m, KVPlacing)]

    def __bool__(self) -> bool:
        return bool(self.mechanisms)

    def get(self, name: str) -> Mechanism | None:
        return next((m for m in self.mechanisms if m.name == name), None)

    # --- a request's life ---------------------------------------------------------------------------

    def admit(self, scheduler: SchedulerView, req: RequestView, spec: MemorySpec) -> None:
        """The mechanisms the request admits, by order, every `open` before the first `admit`; an
        abort stops the rest, and the refused request's state ends here: it never runs."""
        admitting = [m for m in self.mechanisms if spec.admits(m)]
        for m in admitting:
            m.open(scheduler, req, spec)
        for m in admitting:
            if req.finished():
                break  # an earlier mechanism refused it
            m.admit(scheduler, req, spec)
        if req.finished():
            self.requests.end(req.rid)

    def before_prefill(self, scheduler: SchedulerView, waiting: list[RequestView], running: bool) -> list[RequestView]:
        """Every mechanism, by order: the union of the requests they hold back."""
        return [req for m in self.mechanisms for req in m.before_prefill(scheduler, waiting, running)]

    def match_limit(self, req: RequestView) -> int | None:
        """The least of the mechanisms' limits (None: none sets one)."""
        limits = [n for m in self.mechanisms if (n := m.match_limit(req)) is not None]
        return min(limits) if limits else None

    def branch_ids(self, req: RequestView) -> tuple[Branching, BranchIds] | None:
        """The mechanism that branches the request's path and its branch-id function, or None."""
        return only_one(
            [(m.name, (m, ids)) for m in self._branching if (ids := m.branch_ids(req)) is not None],
            "branches the request's path",
        )

    def branches(self, req: RequestView) -> Branches:
        """The one mechanism's branches of the request's path, () for a plain path."""
        return only_one(((m.name, m.branches(req)) for m in self._branching), "branches the request's path") or ()

    def checkpoint(self, req: RequestView, tree: KVHost) -> RowEdit | None:
        """Every mechanism, by order (KV memory copies the prompt off before intent prunes it): the
        one row edit made, or None."""
        return only_one([(m.name, m.on_checkpoint(req, tree)) for m in self.mechanisms], "edits the request's row")

    def release(self, req: RequestView) -> None:
        """Every mechanism, by order; so `drop` and `drain`. Then the request's state ends: what
        lives as long as its row, and all of it when the request is finished (a retracted request
        is released and prefills again later)."""
        for m in self.mechanisms:
            m.on_release(req)
        self.requests.released(req.rid, finished=req.finished())

    def drop(self, req: RequestView) -> None:
        for m in self.mechanisms:
            m.on_drop(req)
        self.requests.end(req.rid)

    def drain(self) -> None:
        for m in self.mechanisms:
            m.drain()

    # --- inside the forward -------------------------------------------------------------------------

    # at most one answers for a request; only the mechanisms with the capability are asked

    def position_shift(self, rid: str) -> int:
        return (
            only_one(((m.name, m.position_shift(rid)) for m in self._shifting), "shifts the request's positions") or 0
        )

    def step_reads(self, rid: str) -> StepReads | None:
        return only_one(((m.name, m.step_reads(rid)) for m in self._reading), "chooses the request's decode reads")

    def placed_kv(self, req: RequestView) -> ReusedKV | None:
        return only_one(((m.name, m.placed_kv(req)) for m in self._placing), "places KV for the request's repair")

    @property
    def reads_steps(self) -> bool:
        return bool(self._reading)

    @property
    def shifts_positions(self) -> bool:
        return bool(self._shifting)

    # --- sessions ------------------------------------------------------------------------------------

    # each mechanism's state under its own name

    def export_session(
        self, key: SessionKey, skip: Mechanism | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Every mechanism's state of the session (but `skip`'s), its tensors named
        `<mechanism>.<name>`, and which of them hold KV (Mechanism.kv_state)."""
        out: dict[str, torch.Tensor] = {}
        kv: dict[str, str] = {}
        for m in self.mechanisms:
            if m is not skip:
                out.update({f"{m.name}.{name}": t for name, t in m.export_session(key).items()})
                kv.update({f"{m.name}.{name}": kind for name, kind in m.kv_state.items() if f"{m.name}.{name}" in out})
        return out, kv

    def import_session(self, key: SessionKey, tensors: dict[str, torch.Tensor]) -> None:
        """Hand each mechanism its part of an exported state (a disabled one's is ignored)."""
        for m in self.mechanisms:
            own = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.split(".", 1)[0] == m.name}
            if own:
                m.import_session(key, own)

    def describe_session(self, states: dict[str, Any]) -> dict[str, Any]:
        """What each mechanism says of its slot of one session (Mechanism.describe_session)."""
        row: dict[str, Any] = {}
        for m in self.mechanisms:
            if m.name in states:
                row.update(m.describe_session(states[m.name]))
        return row
