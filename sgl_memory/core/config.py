"""Typed sgl-memory configuration, loaded from YAML: one section per registered mechanism.

Each mechanism declares its section (`Mechanism.settings`, a frozen dataclass in its own package)
and this module builds the config from the registry. Loading is strict: an unknown key or a value
of the wrong type or outside its allowed set stops start-up with a message naming the key path and
what is allowed. `plugins:` names modules that register more mechanisms (mechanism.discover);
`sessions:` says where a request's session id and tenant may come from (SessionSources).
`to_yaml` writes the YAML of a config from its sections' dataclasses (tests and benchmarks build
their servers' configs with it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from sgl_memory.core import mechanism

logger = logging.getLogger(__name__)

CONFIG_ENV = "SGLMEMORY_CONFIG"  # how the launcher hands the file to SGLang's child processes
PLAIN_ENV = "SGLMEMORY_PLAIN"  # and `--plain`: every mechanism off
MAX_BUDGET = (1 << 31) - 1  # beyond any context length; keeps every metric inside 64-bit JSON integers

S = TypeVar("S")


class ConfigError(ValueError):
    """A config this server refuses to start with: the message names the key path and what is allowed."""


@dataclasses.dataclass(frozen=True)
class SessionSources:
    """Where a request's session id and tenant may come from besides its `sgl_memory` field (for
    clients that cannot add body fields: agent frameworks, unmodified OpenAI SDKs)."""

    session_header: bool = True  # the x-session-id header
    # the x-tenant-id header: only behind a gateway that sets it itself, or any client could name
    # another's tenant
    tenant_header: bool = False
    # /v1/responses: a chain of responses (previous_response_id) is one session, named after its
    # first response
    response_chains: bool = True


class MemoryConfig:
    """The whole config: one section per registered mechanism (its `settings` dataclass, defaults
    for a section the file leaves out), the plugin modules that registered more mechanisms, and
    where sessions may be named (`sessions`). A section is read by its dataclass
    (`config.of(IntentConfig)`, typed), or by name (`config.section("intent")`) where the code has
    no class at hand (the engine and core, which import no mechanism)."""

    __slots__ = ("sections", "plugins", "sessions")
    sections: dict[str, Any]  # mechanism name -> its section (its `settings` dataclass)
    plugins: tuple[str, ...]
    sessions: SessionSources

    def __init__(self, plugins: tuple[str, ...] = (), sessions: SessionSources | None = None, **sections: Any) -> None:
        mechanism.discover(plugins)
        unknown = sorted(set(sections) - set(mechanism.REGISTRY))
        if unknown:
            raise TypeError(f"no mechanism registers section(s) {unknown}")
        full = {name: sections.get(name) or cls.settings() for name, cls in mechanism.REGISTRY.items()}
        object.__setattr__(self, "sections", full)
        object.__setattr__(self, "plugins", tuple(plugins))
        object.__setattr__(self, "sessions", sessions or SessionSources())

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("MemoryConfig is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemoryConfig) and (self.sections, self.plugins, self.sessions) == (
            other.sections,
            other.plugins,
            other.sessions,
        )

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.sections.items())), self.plugins, self.sessions))

    def __repr__(self) -> str:
        return (
            f"MemoryConfig(plugins={self.plugins!r}, sessions={self.sessions!r}, "
            f"{', '.join(f'{k}={v!r}' for k, v in self.sections.items())})"
        )

    def of(self, settings: type[S]) -> S:
        """The section of the registered mechanism whose `settings` is this dataclass."""
        return self.sections[section_name(settings)]

    def section(self, name: str) -> Any:
        """The section of the mechanism registered under `name`."""
        return self.sections[name]

    def as_dict(self) -> dict:
        """The config as YAML would spell it (GET /sgl_memory/info)."""
        return {
            "plugins": list(self.plugins),
            "sessions": dataclasses.asdict(self.sessions),
            **{name: dataclasses.asdict(s) for name, s in self.sections.items()},
        }


def section_name(settings: type) -> str:
    """The config section's name of the registered mechanism whose `settings` is this dataclass."""
    for name, cls in mechanism.REGISTRY.items():
        if cls.settings is settings:
            return name
    raise TypeError(f"no registered mechanism declares settings {settings.__module__}.{settings.__qualname__}")


def choices(section: type, name: str) -> tuple[str, ...]:
    """The allowed values of a named option (a Literal field): the one list the request field's
    validation reads too."""
    return typing.get_args(typing.get_type_hints(section)[name])


def require(ok: bool, key: str, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: invalid value; allowed: {allowed}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: {', '.join(map(str, choices))}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: true, false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: {value!r} is not allowed; expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: {value!r} is not allowed; expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: {value!r} is not allowed; expected a string")
        return value
    raise TypeError(f"unsupported config field type {tp} at {key}")


def _build(cls: type[S], data: Any, path: str) -> S:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]  # S: a settings dataclass
    data = _renamed(cls, data, path)
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{where}: unknown key; allowed keys: {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate:
        validate(path)
    return obj


def _renamed(cls: type, data: dict[str, Any], path: str) -> dict[str, Any]:
    """`data` with the keys a section renamed (its `RENAMED`: old key -> new) under their new names:
    a file written for an earlier release keeps working, with a warning naming the new key."""
    renamed: dict[str, str] = getattr(cls, "RENAMED", {})
    if not renamed.keys() & data.keys():
        return data
    out = dict(data)
    for old, new in renamed.items():
        if old in out:
            if new in out:
                raise ConfigError(f"{path}.{old} and {path}.{new}: the same key, renamed; give {path}.{new} only")
            logger.warning("%s.%s is renamed %s.%s; the old key is read for now", path, old, path, new)
            out[new] = out.pop(old)
    return out


TOP_LEVEL = mechanism.RESERVED_NAMES


def from_dict(data: dict[str, Any] | None) -> MemoryConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping, got {type(data).__name__}")
    plugins = data.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) and p for p in plugins):
        raise ConfigError("plugins: expected a list of module names (each registers a mechanism)")
    try:
        mechanism.discover(tuple(plugins))
    except ImportError as exc:
        raise ConfigError(f"plugins: cannot import {exc.name or exc}: {exc}") from None
    names = sorted(mechanism.REGISTRY)
    for key in data:
        if key not in TOP_LEVEL and key not in mechanism.REGISTRY:
            raise ConfigError(f"{key}: unknown key; allowed keys: {', '.join(TOP_LEVEL)}, {', '.join(names)}")
    sections: dict[str, Any] = {
        name: _build(cls.settings, data.get(name), name) for name, cls in mechanism.REGISTRY.items()
    }
    for name, cls in mechanism.REGISTRY.items():
        if cls.enabled_with in sections and "enabled" not in (data.get(name) or {}):
            sections[name] = dataclasses.replace(sections[name], enabled=sections[cls.enabled_with].enabled)
    config = MemoryConfig(tuple(plugins), _build(SessionSources, data.get("sessions"), "sessions"), **sections)
    for cls in mechanism.ordered():
        cls.check_config(config)
    return config


def plain(**sections: Any) -> MemoryConfig:
    """Every mechanism off (`--plain`): the server answers as plain SGLang does; `sections` given
    replace theirs (one mechanism on alone)."""
    mechanism.discover(())
    off = {name: dataclasses.replace(cls.settings(), enabled=False) for name, cls in mechanism.REGISTRY.items()}
    return MemoryConfig(**(off | sections))


def load(path: str | os.PathLike | None) -> MemoryConfig:
    """The config in the file at `path`; no file: every section's defaults."""
    if path is None:
        return MemoryConfig()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read memory config {p}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None


def from_env() -> MemoryConfig:
    """The config of this server, in any of its processes (the launcher exports the path), read
    once per process: a server serves the config it started with. Read again per request, a file
    edited (or rewritten by another run) while the server runs made the HTTP process refuse what
    its scheduler serves."""
    return _load_once(os.environ.get(CONFIG_ENV) or None, bool(os.environ.get(PLAIN_ENV)))


@functools.cache
def _load_once(path: str | None, plain_mode: bool) -> MemoryConfig:
    return plain() if plain_mode else load(path)


def to_yaml(
    *sections: object,
    plugins: tuple[str, ...] = (),
    sessions: SessionSources | None = None,
    raw: dict[str, Any] | None = None,
) -> str:
    """The YAML the loader reads for these sections (instances of registered mechanisms' `settings`
    dataclasses), for tests and benchmarks: a wrong field name fails where the dataclass is built,
    not when a server reads the file. Each section is named by the registry and holds `enabled`
    and every field that differs from its default, so a section it leaves out keeps the loader's
    defaults (and `Mechanism.enabled_with`). `sessions` writes its changed fields; `raw` adds
    sections as they are (a plugin's, whose class the caller does not import)."""
    mechanism.discover()  # the built-in mechanisms; a plugin's section is named once its module is imported
    data: dict[str, Any] = {"plugins": list(plugins)} if plugins else {}
    if sessions is not None:
        data["sessions"] = _changed(sessions)
    for section in sections:
        name = section_name(type(section))
        if name in data:
            raise TypeError(f"section {name!r} given twice")
        data[name] = {"enabled": getattr(section, "enabled"), **_changed(section)}
    for name, body in (raw or {}).items():
        if name in data:
            raise TypeError(f"section {name!r} given twice")
        data[name] = body
    return yaml.safe_dump(data, sort_keys=False, width=1 << 16)


def _changed(section: Any) -> dict[str, Any]:
    """A settings dataclass's fields that differ from their defaults, in declaration order."""
    return {
        f.name: getattr(section, f.name)
        for f in dataclasses.fields(section)
        if f.name != "enabled" and getattr(section, f.name) != f.default
    }
