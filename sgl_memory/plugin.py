"""SGLang plugin entry point (group `sglang.srt.plugins`): runs in every SGLang process.

It registers the `sgl_memory` radix-cache backend and applies the hook manifest
(`patches/hooks.yaml`, shipped as `sgl_memory.patches`). In the server's main process it first checks
that every target of the manifest, and every other contact point with SGLang's code
(`patches/contacts.yaml`: the methods our subclasses override, the internals the engine reads,
the fields of SGLang's request and scheduler our packages touch),
exists in the installed SGLang and refuses to start otherwise: a silently missing hook or a renamed
method would serve requests without the behaviour the user asked for.
"""

from __future__ import annotations

import ast
import functools
import importlib.resources
import inspect
import multiprocessing
import pkgutil
import sys
import textwrap
from dataclasses import dataclass
from typing import Literal

import yaml

from sgl_memory import SGLANG_VERSION


@dataclass(frozen=True)
class HookSpec:
    """One hook of the manifest (patches/hooks.yaml): its SGLang target, how our hook attaches to
    it, in which processes, and why."""

    target: str
    type: Literal["before", "after", "around", "replace"]
    hook: str
    process: Literal["main", "all"]
    sglang: str
    why: str


@dataclass(frozen=True)
class Contact:
    """One contact point with SGLang's code (patches/contacts.yaml): its target, the kind of
    contact, what of ours holds it, and why."""

    target: str
    kind: Literal["override", "wrap", "use", "api", "field"]
    by: str  # the module or class of ours that holds it
    why: str


class PatchSetError(RuntimeError):
    """The installed SGLang lacks hook targets or contact points: the message names each, and the
    server does not start."""


def _read(name: str) -> list[dict]:
    return yaml.safe_load(importlib.resources.files("sgl_memory.patches").joinpath(name).read_text()) or []


def manifest() -> list[HookSpec]:
    return [HookSpec(**entry) for entry in _read("hooks.yaml")]


def contacts() -> list[Contact]:
    return [Contact(**entry) for entry in _read("contacts.yaml")]


def _installed_sglang() -> str:
    from importlib.metadata import version

    return version("sglang")


@functools.cache
def _assigned(cls: type) -> frozenset[str]:
    """The attributes the class's own code assigns on `self` (`self.x = ...`, `self.x: T = ...`,
    `(self.x, self.y) = ...`)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    )


def has_field(cls: type, name: str) -> bool:
    """Whether instances of `cls` have the attribute `name`: a class member (method, property) or
    one the code of it or of an SGLang base assigns."""
    return any(
        name in vars(base) or (base.__module__.startswith("sglang") and name in _assigned(base)) for base in cls.__mro__
    )


def missing_targets(specs: list) -> list:
    missing = []
    for spec in specs:
        try:
            if getattr(spec, "kind", None) == "field":
                owner, name = spec.target.rsplit(".", 1)
                if not has_field(pkgutil.resolve_name(owner), name):
                    missing.append(spec)
            else:
                pkgutil.resolve_name(spec.target)
        except (ImportError, AttributeError, ValueError):
            missing.append(spec)
    return missing


def check_patch_set(specs: list[HookSpec] | None = None, touched: list[Contact] | None = None) -> None:
    """Raise PatchSetError naming every hook target and contact point the installed SGLang lacks."""
    specs = manifest() if specs is None else specs
    touched = contacts() if touched is None else touched
    lines = [f"  {s.target} (a hook written for sglang {s.sglang}; {s.why})" for s in missing_targets(specs)]
    lines += [f"  {c.target} (a {c.kind} by {c.by}; {c.why})" for c in missing_targets(touched)]
    if lines:
        raise PatchSetError(
            f"sgl-memory cannot run on the installed sglang {_installed_sglang()} (pinned: {SGLANG_VERSION}); "
            "these targets no longer exist:\n" + "\n".join(lines)
        )


def _is_main_process() -> bool:
    return multiprocessing.parent_process() is None


def apply(specs: list[HookSpec]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    main = _is_main_process()
    for spec in specs:
        if spec.process == "main" and not main:
            continue
        HookRegistry.register(spec.target, pkgutil.resolve_name(spec.hook), HookType[spec.type.upper()])


def register_backends() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from sgl_memory.engine import radix_cache
    from sgl_memory.engine.attention import cpu_backend

    if get_radix_cache_factory(radix_cache.BACKEND_NAME) is None:
        register_radix_cache_backend(radix_cache.BACKEND_NAME, radix_cache.build)
    if cpu_backend.BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(cpu_backend.BACKEND_NAME)(cpu_backend.create)
    if cpu_backend.BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        # the server's argument parser validates --attention-backend against this list
        add_attention_backend_choices([cpu_backend.BACKEND_NAME])


def load() -> None:
    from sgl_memory.engine import startup

    startup.quiet_import_errors()  # before SGLang's model registry is imported in this process
    specs = manifest()
    if _is_main_process():
        try:
            check_patch_set(specs)
        except PatchSetError as exc:
            # SGLang's loader swallows Exceptions from plugins; SystemExit is how we refuse to start.
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    register_backends()
    apply(specs)
