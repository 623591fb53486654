"""Per-request state of the mechanisms, in one store with declared lifetimes.

A mechanism keeps what it knows about a request in flight (its plan, the capture of its prefill,
the KV it placed) in tables of the tree's `RequestStore`, keyed by the request's id, never in a
dict of its own: the composition ends every table's entry of a request when the request ends, so
no mechanism clears its state by hand and none can forget to. Each table declares how long an
entry lives:

- `ROW`: as long as the request's KV row: until the tree releases the row (a finished request, an
  aborted one, or a decode request SGLang retracts to free memory, which prefills again later as a
  plain request) or the request is dropped before it held one. For what the forward of one prefill
  reads: a capture, a position shift, a repair's plan.
- `REQUEST`: as long as the request: until a release of the finished request, or a drop. For what
  a release reports or writes after a retraction too: a turn's record, its metrics.

A request that a mechanism refuses at admission never runs: the composition ends its state there.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum
from typing import Generic, TypeVar

T = TypeVar("T")


class Lifetime(Enum):
    """How long a table's entry of a request lives: `ROW`, as long as the request's KV row;
    `REQUEST`, as long as the request."""

    ROW = "row"
    REQUEST = "request"


class RequestTable(Generic[T]):
    """One mechanism's state of each request in flight, by request id (`RequestStore.table`)."""

    def __init__(self, name: str, lifetime: Lifetime):
        self.name, self.lifetime = name, lifetime
        self._values: dict[str, T] = {}

    def get(self, rid: str) -> T | None:
        return self._values.get(rid)

    def set(self, rid: str, value: T) -> T:
        self._values[rid] = value
        return value

    def pop(self, rid: str) -> T | None:
        """Take the entry out before the request ends (its use is over); the store ends the rest."""
        return self._values.pop(rid, None)

    def __contains__(self, rid: object) -> bool:
        return rid in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._values))

    def __repr__(self) -> str:
        return f"RequestTable({self.name!r}, {self.lifetime.value}, {len(self._values)} held)"


class RequestStore:
    """Every per-request table of one tree; `end` is the one place a request's entries go."""

    def __init__(self) -> None:
        self._tables: dict[str, RequestTable] = {}

    def table(self, name: str, lifetime: Lifetime) -> RequestTable:
        """A new table, named `<mechanism> <what>` (the inspector and the leak check name it)."""
        if name in self._tables:
            raise ValueError(f"request table {name!r} exists already")
        table: RequestTable = RequestTable(name, lifetime)
        self._tables[name] = table
        return table

    def released(self, rid: str, finished: bool) -> None:
        """The tree released the request's KV row: ROW entries end, and REQUEST entries too when
        the request is finished (not retracted)."""
        for table in self._tables.values():
            if finished or table.lifetime is Lifetime.ROW:
                table.pop(rid)

    def end(self, rid: str) -> None:
        """The request ended without a release (dropped, or refused at admission): every entry."""
        for table in self._tables.values():
            table.pop(rid)

    def held(self) -> dict[str, list[str]]:
        """The request ids each table holds now, for the tables that hold any (the leak check)."""
        return {name: list(t) for name, t in self._tables.items() if len(t)}
