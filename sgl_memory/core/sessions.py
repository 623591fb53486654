"""Sessions: every mechanism's per-session state in one registry.

A session is (tenant, session id): the tenant namespaces everything, so two tenants never share a
session. Each session holds one state per mechanism (intent's QueryMemory, persistence's stored
path, KV memory's block pool). Sessions are kept least recently used first; each mechanism bounds
the number of its own states and says which of them must not be dropped yet (a turn not yet
written, a pool a worker is filling): when it is over its bound, its states of the least recently
used sessions go first. A session without states is forgotten.

The scheduler thread and the mechanisms' workers both use it, so every operation takes its lock;
what a state holds is the mechanism's to guard.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

SessionKey = tuple[str, str]  # (tenant or "", session id)

# The header SGLang's router (smg) hashes under `--policy consistent_hashing`: a request that carries
# its session's routing key reaches the replica that holds the session's tree path and state.
ROUTING_HEADER = "X-SMG-Routing-Key"


def session_key(tenant: str | None, session_id: str) -> SessionKey:
    return (tenant or "", session_id)


def digest63(*parts: bytes) -> int:
    """A 63-bit digest of byte strings (a session's token ids, its stored history): non-negative in
    an int64, so tensor-parallel ranks can compare it by all-reduce."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return int.from_bytes(h.digest(), "little") >> 1


def routing_key(tenant: str | None, session_id: str) -> str:
    """The session's routing key for a router in front of replicas: one per session, tenant included
    (a header value must be printable ASCII, hence the quoting)."""
    return f"{quote(tenant or '', safe='')}/{quote(session_id, safe='')}"


class SessionRegistry:
    """Every session's per-mechanism states, least recently used first, each mechanism's within the
    bound it sets (`limit`). Every operation takes the registry's lock; what a state holds is its
    mechanism's to guard."""

    def __init__(self) -> None:
        self._sessions: OrderedDict[SessionKey, dict[str, object]] = OrderedDict()
        self._limits: dict[str, tuple[int, Callable[[object], bool]]] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._used: dict[SessionKey, float] = {}  # wall-clock time of each session's last use
        self.dropped: dict[str, int] = {}  # states dropped for their bound, per mechanism

    def limit(self, name: str, capacity: int, keep: Callable[[object], bool] = lambda value: False) -> None:
        """At most `capacity` states named `name`; `keep(value)` true: not to be dropped now."""
        with self._lock:
            self._limits[name] = (capacity, keep)

    def get(self, key: SessionKey, name: str, create: Callable[[], Any] | None = None) -> Any:
        """The session's state (the session becomes the most recently used); made by `create` when
        missing and `create` is given, None otherwise."""
        with self._lock:
            states = self._sessions.get(key)
            if states is not None:
                self._sessions.move_to_end(key)
                self._used[key] = time.time()
            value = states.get(name) if states is not None else None
            if value is None and create is not None:
                value = create()
                self._sessions.setdefault(key, {})[name] = value
                self._used[key] = time.time()
                self._counts[name] = self._counts.get(name, 0) + 1
                self._bound(name, spare=key)
            return value

    def pop(self, key: SessionKey, name: str) -> Any:
        with self._lock:
            return self._pop(key, name)

    def drop(self, key: SessionKey) -> None:
        """Forget the session: every mechanism's state of it."""
        with self._lock:
            for name in list(self._sessions.get(key, ())):
                self._pop(key, name)

    def states(self, name: str) -> list[tuple[SessionKey, Any]]:
        """Every session's state of this name, least recently used first (a snapshot)."""
        with self._lock:
            return [(key, states[name]) for key, states in self._sessions.items() if name in states]

    def snapshot(self) -> list[tuple[SessionKey, float, dict[str, object]]]:
        """Every session: its key, its last use (wall-clock seconds) and its states by mechanism,
        least recently used first. Reading it does not count as a use."""
        with self._lock:
            return [(key, self._used.get(key, 0.0), dict(states)) for key, states in self._sessions.items()]

    def count(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def _pop(self, key: SessionKey, name: str) -> Any:
        states = self._sessions.get(key)
        if states is None or name not in states:
            return None
        value = states.pop(name)
        self._counts[name] -= 1
        if not states:
            del self._sessions[key]
            self._used.pop(key, None)
        return value

    def _bound(self, name: str, spare: SessionKey) -> None:
        if name not in self._limits or self._counts[name] <= self._limits[name][0]:
            return
        capacity, keep = self._limits[name]
        for key in list(self._sessions):
            if self._counts[name] <= capacity:
                break
            value = self._sessions[key].get(name)
            if key != spare and value is not None and not keep(value):
                self._pop(key, name)
                self.dropped[name] = self.dropped.get(name, 0) + 1
