"""The contract between the radix tree and a memory mechanism, and the registry of mechanisms.

A mechanism (intent pruning, session persistence, KV memory, and the ones to come) is one package
with one class that subclasses `Mechanism` and registers under its config section's name. The tree
(radix_cache.py) builds the enabled ones in `ORDER` and calls them at the points of a request's life
below; nothing else holds a mechanism's state, and no mechanism imports another.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

# The order of admission, which is the order in which mechanisms rewrite a request's tokens:
# - persist first: its text-level match may replace the prompt's ids with the stored session's;
# - memory next: it puts retrieved blocks before the (possibly rewritten) prompt;
# - intent last: it finds its forced spans and session in the final tokens.
ORDER = ("persist", "memory", "intent")

REGISTRY: dict[str, type[Mechanism]] = {}


class Mechanism(ABC):
    name: ClassVar[str]
    # other mechanism -> why the two cannot run in one server (yet); checked where the tree is built
    conflicts: ClassVar[dict[str, str]] = {}
    needs_sentinel: ClassVar[bool] = False  # points positions of rows at the tree's sentinel slot (page size 1)

    @classmethod
    @abstractmethod
    def build(cls, config, tree, ctx) -> Mechanism:
        """The mechanism for this tree, from its config section and SGLang's TreeCacheBuildContext
        (model config, server args, TP rank; None in unit tests that build a bare tree). Raises
        ValueError for a server it cannot serve (page size, TP size, model)."""

    def admit(self, scheduler, req, spec) -> None:
        """Before the request is queued (scheduler thread), after the mechanisms earlier in ORDER.
        May rewrite `req.origin_input_ids` and `req.extra_key`, attach its per-request state to the
        req, put KV into the tree (tree_fill.place), or abort the request with a client error."""

    def on_checkpoint(self, req, tree):
        """At the end of the request's prefill, before its row is inserted into the tree. Returns a
        row edit (see intent/layouts.py) or None to leave the row as it is."""
        return None

    def on_release(self, req) -> None:
        """After the tree released the request (scheduler thread): attach its metrics, copy out what
        it keeps (tree_fill.copy_path) and queue the rest of the work for its worker."""

    def drain(self, timeout: float | None = None) -> bool:
        """Return when the work queued so far is done (flush_cache, a clean shutdown, tests); False
        if `timeout` seconds passed first."""
        return True


def register(name: str):
    """Class decorator: the mechanism configured by section `name` of MemoryConfig."""
    if name not in ORDER:
        raise ValueError(f"mechanism {name!r} has no place in mechanism.ORDER {ORDER}")

    def wrap(cls: type[Mechanism]) -> type[Mechanism]:
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return wrap


def enabled(config) -> list[str]:
    """The mechanisms a MemoryConfig switches on, in ORDER."""
    return [name for name in ORDER if getattr(config, name).enabled]


def conflicts(config) -> list[str]:
    """Why the enabled mechanisms cannot run together, one line per pair (empty: they can)."""
    names = enabled(config)
    found = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            why = REGISTRY[a].conflicts.get(b) or REGISTRY[b].conflicts.get(a)
            if why:
                found.append(f"{a}.enabled and {b}.enabled together are not supported yet: {why}")
    return found
