"""The contract between the radix tree and a memory mechanism, and the registry of mechanisms.

A mechanism (intent pruning, session persistence, KV memory, and the ones to come) is one package
with one class that subclasses `Mechanism` and registers under its config section's name. The tree
(radix_cache.py) builds the enabled ones in `ORDER` and calls them at the points of a request's life
below; nothing else holds a mechanism's state, and no mechanism imports another.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

# The order of admission, which is the order in which mechanisms rewrite a request's tokens (every
# mechanism's `open` runs before the first admission, so all of them see a session loaded from disk):
# - memory first: it puts retrieved blocks before a memory-mode request's prompt, under a key of
#   their own (persistence leaves such a request alone: the assembly is rebuilt from the pool);
# - keep next: it repairs the blocks memory placed among the request's prefill tokens (reuse.py),
#   and its capture subscriber writes their KV before intent's reads the layer;
# - persist next: its text-level match may replace a full-history prompt's ids with the stored
#   session's, and it restores their KV;
# - intent last: it finds its forced spans and session in the final tokens.
# Checkpoint and release run in the same order: memory copies a turn's prompt before intent prunes
# the row (what pruning drops stays recallable), and queues the turn into the pool before
# persistence writes the session's state.
ORDER = ("memory", "keep", "persist", "intent")

REGISTRY: dict[str, type[Mechanism]] = {}


class Mechanism(ABC):
    name: ClassVar[str]
    # other mechanism -> why the two cannot run in one server (yet); checked where the tree is built
    conflicts: ClassVar[dict[str, str]] = {}
    needs_sentinel: ClassVar[bool] = False  # points positions of rows at the tree's sentinel slot (page size 1)
    # export_session names whose tensors hold KV [layers, tokens, heads, dim]: "k" keys or "v" values,
    # which the session store may quantize like the session's own KV; the rest are stored exactly
    kv_state: ClassVar[dict[str, str]] = {}

    @classmethod
    @abstractmethod
    def build(cls, config, tree, ctx) -> Mechanism:
        """The mechanism for this tree, from its config section and SGLang's TreeCacheBuildContext
        (model config, server args, TP rank; None in unit tests that build a bare tree). Raises
        ValueError for a server it cannot serve (page size, TP size, model)."""

    def open(self, scheduler, req, spec) -> None:
        """Before any mechanism admits the request (scheduler thread): bring its session into this
        server's memory. Persistence loads a session seen by an earlier server from its file and
        hands the other mechanisms their part (the tree's import_session), so that every admission,
        whatever its place in ORDER, sees the session's state."""

    def admit(self, scheduler, req, spec) -> None:
        """Before the request is queued (scheduler thread), after the mechanisms earlier in ORDER.
        May rewrite `req.origin_input_ids` and `req.extra_key`, attach its per-request state to the
        req, put KV into the tree (tree_fill.place), or abort the request with a client error."""

    def match_limit(self, req) -> int | None:
        """The most of the request's first tokens the tree may give it from the cache (None: this
        mechanism sets no limit). A mechanism that reads rows as the prefill computes them (a
        scorer's query rows, a probe's) needs them prefilled by the request itself."""
        return None

    def on_checkpoint(self, req, tree):
        """At the end of the request's prefill, before its row is inserted into the tree. Returns a
        row edit (see intent/layouts.py) or None to leave the row as it is."""
        return None

    def on_release(self, req) -> None:
        """After the tree released the request (scheduler thread): attach its metrics, copy out what
        it keeps (tree_fill.copy_path) and queue the rest of the work for its worker."""

    def on_drop(self, req) -> None:
        """The request was aborted before it held a KV row (in the waiting queue, or refused by
        SGLang after admission): the tree never releases it, so `on_release` does not run. Drop
        the per-request state `admit` kept outside the req."""

    def export_session(self, key) -> dict[str, torch.Tensor]:
        """What this mechanism holds for the session (tenant, id) that a later server needs to
        continue it, as named host tensors (session persistence stores them next to the session's
        path); {} when it holds nothing. Called off the scheduler thread."""
        return {}

    def import_session(self, key, tensors: dict[str, torch.Tensor]) -> None:
        """Take back what `export_session` gave, on a server that loads the session from its file;
        state this server already holds for the session is newer and is kept."""

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
