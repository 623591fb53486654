"""SGLang plugin entry point (group `sglang.srt.plugins`): runs in every SGLang process.

It registers the `sgl_memory` radix-cache backend and applies the hook manifest
(`patches/hooks.yaml`, shipped as `sgl_memory.patches`). In the server's main process it first checks
that every target of the manifest exists in the installed SGLang and refuses to start otherwise: a
silently missing hook would serve requests without the behaviour the user asked for.
"""

from __future__ import annotations

import importlib.resources
import multiprocessing
import pkgutil
import sys
from dataclasses import dataclass
from typing import Literal

import yaml

from sgl_memory import SGLANG_VERSION


@dataclass(frozen=True)
class HookSpec:
    target: str
    type: Literal["before", "after", "around", "replace"]
    hook: str
    process: Literal["main", "all"]
    sglang: str
    why: str


class PatchSetError(RuntimeError):
    pass


def manifest() -> list[HookSpec]:
    text = importlib.resources.files("sgl_memory.patches").joinpath("hooks.yaml").read_text()
    return [HookSpec(**entry) for entry in yaml.safe_load(text) or []]


def _installed_sglang() -> str:
    from importlib.metadata import version

    return version("sglang")


def missing_targets(specs: list[HookSpec]) -> list[HookSpec]:
    missing = []
    for spec in specs:
        try:
            pkgutil.resolve_name(spec.target)
        except (ImportError, AttributeError, ValueError):
            missing.append(spec)
    return missing


def check_patch_set(specs: list[HookSpec] | None = None) -> None:
    """Raise PatchSetError naming every hook target the installed SGLang lacks."""
    specs = manifest() if specs is None else specs
    missing = missing_targets(specs)
    if missing:
        installed = _installed_sglang()
        lines = [f"  {s.target} (written for sglang {s.sglang}; {s.why})" for s in missing]
        raise PatchSetError(
            f"sgl-memory cannot run on the installed sglang {installed} (pinned: {SGLANG_VERSION}); "
            "these hook targets no longer exist:\n" + "\n".join(lines)
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

    from sgl_memory import radix_cache
    from sgl_memory.attention import cpu_backend

    if get_radix_cache_factory(radix_cache.BACKEND_NAME) is None:
        register_radix_cache_backend(radix_cache.BACKEND_NAME, radix_cache.build)
    if cpu_backend.BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(cpu_backend.BACKEND_NAME)(cpu_backend.create)
    if cpu_backend.BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        # the server's argument parser validates --attention-backend against this list
        add_attention_backend_choices([cpu_backend.BACKEND_NAME])


def load() -> None:
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
