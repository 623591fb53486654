"""sgl-memory's state of one of SGLang's objects (a tree node, a forward batch, a request the
engine's admission saw), held beside the object, never on it.

A `SideTable` maps an object to one value for as long as the object lives: SGLang's classes carry no
attribute of ours, each value has a declared type and an owner (the module that declares the table),
and it goes when SGLang drops the object, so a request aborted anywhere leaves nothing behind. The
map is keyed by identity (a ForwardBatch, a dataclass, is not hashable) and each entry removes itself
when its object is collected, before the object's id can be reused.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class SideTable(Generic[T]):
    """One value per live object, beside it (the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self._values: dict[int, tuple[weakref.ref, T]] = {}

    @overload
    def get(self, obj: object) -> T | None: ...

    @overload
    def get(self, obj: object, default: T) -> T: ...

    def get(self, obj: object, default: T | None = None) -> T | None:
        entry = self._values.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else default

    def set(self, obj: object, value: T) -> T:
        key, values = id(obj), self._values

        def gone(_: Any) -> None:  # before the object's id can be reused
            values.pop(key, None)

        self._values[key] = (weakref.ref(obj, gone), value)
        return value

    def pop(self, obj: object) -> T | None:
        entry = self._values.pop(id(obj), None)
        return entry[1] if entry is not None else None

    def __contains__(self, obj: object) -> bool:
        return self.get(obj) is not None

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"SideTable({self.name!r}, {len(self._values)} held)"
