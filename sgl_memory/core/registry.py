"""Registries: the one way a name in a config or a request becomes a class.

Mechanisms (core/mechanism.py), intent's scorers (intent/scorers.py) and KEEP's selectors
(keep/select.py) are each chosen by name; each sort has one `Registry`, filled by a class
decorator where the class is written, so adding one edits no list elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Classes of one sort by name; `register(name)` sets the class's `name` and adds it."""

    def __init__(self, kind: str):
        self.kind = kind  # what an unknown name is said to be not ("scorer", "mechanism", ...)
        self._classes: dict[str, T] = {}

    def register(self, name: str, check: Callable[[str, T], None] | None = None) -> Callable[[T], T]:
        """Class decorator: the class is this sort's `name`. `check(name, cls)` may refuse it (raise)
        before it is added. The same name again replaces the class (a module imported twice, a test's
        stand-in)."""

        def wrap(cls: T) -> T:
            if check is not None:
                check(name, cls)
            setattr(cls, "name", name)  # the class knows the name it is chosen by
            self._classes[name] = cls
            return cls

        return wrap

    def get(self, name: str) -> T:
        """The class registered as `name`; a KeyError naming the allowed names otherwise."""
        try:
            return self._classes[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; allowed: {', '.join(sorted(self._classes))}") from None

    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def names(self) -> tuple[str, ...]:
        return tuple(self._classes)

    def items(self) -> list[tuple[str, T]]:
        return list(self._classes.items())

    def values(self) -> list[T]:
        return list(self._classes.values())

    def snapshot(self) -> dict[str, T]:
        """What is registered now, to `restore` later (tests that register a class of their own)."""
        return dict(self._classes)

    def restore(self, snapshot: dict[str, T]) -> None:
        self._classes = dict(snapshot)
