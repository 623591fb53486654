"""The per-request `sgl_memory` field: parsing and validation shared by the HTTP layer and the scheduler.

Clients send it as a top-level object on the native `/generate` body and on the OpenAI bodies;
the HTTP layer moves it into SGLang's `custom_params`, which is how it reaches the scheduler. The
keys `session_id`, `tenant` and `readonly` are common; every other key belongs to one registered
mechanism, which parses its part (Mechanism.parse_request) with the checks below. Every mechanism
reads the one parsed `MemorySpec`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from sgl_memory.core import mechanism

if TYPE_CHECKING:
    from sgl_memory.core.config import MemoryConfig
    from sgl_memory.core.mechanism import Mechanism
    from sgl_memory.core.views import RequestView

S = TypeVar("S")  # a mechanism's config section

logger = logging.getLogger(__name__)

FIELD = "sgl_memory"
# the field's key the HTTP layer fills with the actions of SGLang's `kv_hints` envelope (never a client's)
KV_HINTS = "kv_hints"
MAX_ID_LEN = 256
# ids name sessions in the radix tree, in QueryMemory and in the session store: printable, no path syntax
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]*")


class SpecError(ValueError):
    """A bad `sgl_memory` field; the message is what the client sees with the 400."""


class RequestPart:
    """A mechanism's part of a parsed `sgl_memory` field (Mechanism.parse_request). The properties
    say what kind of pass the request is, so that the other mechanisms can act on it without
    knowing the one that set them."""

    @property
    def internal(self) -> bool:
        """A pass the server's HTTP side sends for this mechanism (KV memory's probe, an entry
        write): no other mechanism admits it, but those that follow internal passes."""
        return False

    @property
    def transient(self) -> bool:
        """An internal pass that leaves nothing behind (a probe): no other mechanism admits it."""
        return False

    @property
    def reads_only(self) -> bool:
        """A pass that changes no session state (persistence loads the session for it, writes nothing)."""
        return False

    @property
    def assembles(self) -> bool:
        """The prompt is assembled by this mechanism (recalled blocks before a new turn), not the
        session's history: a text-level match against the session's stored path does not apply."""
        return False

    def over(self, base: S) -> S:
        """`base` (the mechanism's config section, a dataclass) with this part's fields of the same
        names that are set (not None): a request's overrides of the server's settings. A part that
        overrides settings is a dataclass."""
        return dataclasses.replace(
            base,  # type: ignore[type-var]  # S: a settings dataclass
            **{
                f.name: v
                for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if (v := getattr(self, f.name)) is not None and hasattr(base, f.name)
            },
        )


COMMON = ("session_id", "tenant", "readonly")  # the keys no mechanism owns


@dataclass(frozen=True)
class MemorySpec:
    """One request's parsed `sgl_memory` field: the session it names, whether it only reads, and
    each mechanism's part."""

    session_id: str | None = None
    tenant: str | None = None
    # reads the session as its next turn would and changes nothing: no pruning event, nothing
    # recorded, captured or inserted into the tree (scoring a continuation under the session's state)
    readonly: bool = False
    parts: Mapping[str, RequestPart] = field(default_factory=dict)  # mechanism name -> its part
    asked: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # mechanism name -> the keys its part came from

    def part(self, name: str) -> RequestPart | None:
        return self.parts.get(name)

    @property
    def owner(self) -> str | None:
        """The mechanism whose internal pass this is (None: a client's request)."""
        return next((name for name, p in self.parts.items() if p.internal), None)

    @property
    def transient(self) -> bool:
        return any(p.transient for p in self.parts.values())

    @property
    def reads_only(self) -> bool:
        return self.readonly or any(p.reads_only for p in self.parts.values())

    @property
    def assembled(self) -> bool:
        return any(p.assembles for p in self.parts.values())

    def admits(self, mechanism: type[Mechanism] | Mechanism) -> bool:
        """Whether `mechanism` (a Mechanism class or instance) acts on this request: every one on a
        client's request; on an internal pass its owner, and the mechanisms that follow internal
        passes unless the pass is transient."""
        owner = self.owner
        return owner is None or mechanism.name == owner or (mechanism.follows_internal and not self.transient)


def check_id(value: Any, name: str, where: str | None = None) -> str | None:
    """A session id or tenant (`name`), from the field's key of that name unless `where` names
    another source (a header) for the message."""
    where = where or f"{FIELD}.{name}"
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise SpecError(f"{where} must be a non-empty string of at most {MAX_ID_LEN} characters")
    if not ID_PATTERN.fullmatch(value) or ".." in value:
        raise SpecError(
            f"{where} {value!r} is refused: use letters, digits and . _ : @ + = - "
            "(starting with a letter or digit, no '..')"
        )
    return value


# Value checks shared by the mechanisms' parsers: each names the key in the client's message.


def choice(value: Any, choices: Sequence[Any], where: str) -> Any:
    """A named option: checked as a string first, so an object or a list is a 400, not a TypeError."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in choices:
        raise SpecError(f"{where} {value!r} is unknown; allowed: {', '.join(choices)}")
    return value


def integer(value: Any, lo: int, hi: int, where: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi):
        raise SpecError(f"{where} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def number(value: Any, lo: float, hi: float, where: str) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi):
        raise SpecError(f"{where} must be a number in [{lo}, {hi}], got {value!r}")
    return None if value is None else float(value)


def flag(value: Any, where: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise SpecError(f"{where} must be true or false, got {value!r}")
    return value


def renamed_key(body: dict, old: str, new: str, where: str) -> str:
    """Which key of a request object holds a renamed field: `new`, or `old` from a client written for
    an earlier release (a warning naming the new key, once per process); both at once: a SpecError."""
    if old not in body:
        return new
    if new in body:
        raise SpecError(f"{where}.{old} and {where}.{new}: the same key, renamed; give {where}.{new} only")
    _warn_renamed(f"{where}.{old}", f"{where}.{new}")
    return old


@functools.cache
def _warn_renamed(old: str, new: str) -> None:
    logger.warning("%s is renamed %s; the old key is read for now", old, new)


def only(raw: dict, allowed: tuple[str, ...], where: str) -> None:
    """Refuse keys of an object that are not in `allowed`."""
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")


def object_at(raw: dict, key: str, allowed: tuple[str, ...]) -> tuple[dict | None, str]:
    """A key of the field whose value is an object (a mechanism's own settings): the object (None
    when the key is absent), its keys checked against `allowed`, and its path for messages."""
    where = f"{FIELD}.{key}"
    body = raw.get(key)
    if body is not None:
        if not isinstance(body, dict):
            raise SpecError(f"{where} must be an object")
        only(body, allowed, where)
    return body, where


def keys() -> tuple[str, ...]:
    """Every key a client may set in the field: the common ones and the registered mechanisms'."""
    mechanism.discover()  # a client process (frontend.MemoryEndpoint) may not have imported them yet
    return COMMON + tuple(f for cls in mechanism.ordered() for f in cls.fields)


def parse(raw: Any, internal: bool = False) -> MemorySpec:
    """`internal`: the field as the scheduler receives it, which may carry the server's own keys
    (the HTTP hook's probe id)."""
    if raw is None:
        return MemorySpec()
    if not isinstance(raw, dict):
        raise SpecError(f"{FIELD} must be an object, got {type(raw).__name__}")
    mechanism.discover()
    only(raw, keys(), FIELD)
    readonly = bool(flag(raw.get("readonly", False), f"{FIELD}.readonly"))
    session_id = check_id(raw.get("session_id"), "session_id")
    if readonly and session_id is None:
        raise SpecError(f"{FIELD}.readonly needs {FIELD}.session_id: it reads a session")
    parts, asked = {}, {}
    for cls in mechanism.ordered():
        part = cls.parse_request(raw, internal)
        if part is not None:
            parts[cls.name] = part
            asked[cls.name] = tuple(f for f in cls.fields if f in raw)
    return MemorySpec(session_id, check_id(raw.get("tenant"), "tenant"), readonly, parts, asked)


def check_served(spec: MemorySpec, config: MemoryConfig) -> None:
    """A request that asks for a mechanism this server runs without is refused, naming the config
    key: serving it without the behaviour asked for would drop the request's intent silently."""
    for name, part in spec.parts.items():
        cls = mechanism.REGISTRY[name]
        if not config.section(name).enabled:
            asked = ", ".join(f"{FIELD}.{f}" for f in spec.asked.get(name, cls.fields))
            raise SpecError(f"{asked}: {name} is off on this server ({name}.enabled: false)")
        cls.check_request(part, config)


# The wire format: the raw field travels in SGLang's `custom_params` as a JSON string under FIELD
# (SGLang passes custom_params through to the scheduler's sampling params untouched).


def encode(custom_params: dict | None, raw: Any) -> dict:
    """custom_params with the raw field put in (a new dict; the caller's is not changed)."""
    return {**(custom_params or {}), FIELD: json.dumps(raw)}


def decode(custom_params: dict | None) -> Any:
    """The raw field out of custom_params (None when absent); a SpecError when it is not JSON."""
    raw = (custom_params or {}).get(FIELD)
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{FIELD} is not valid JSON: {exc}") from None
    return raw


def of_request(req: RequestView) -> MemorySpec:
    """The spec a scheduler request carries in its custom_params (the HTTP layer put it there)."""
    return parse(decode(getattr(req.sampling_params, "custom_params", None)), internal=True)
