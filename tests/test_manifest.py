"""The manifest of contact points with SGLang (patches/hooks.yaml, patches/contacts.yaml) is the
code's: every method our subclasses override, every allocator method the tree's view stands in
for, every private SGLang name the package uses, and every field of SGLang's request and scheduler
the core floor and the mechanisms touch is listed, each listed one exists in the installed SGLang
(the start-up check), and nothing is listed that the code does not do."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

from test_layering import MECHANISMS

from sgl_memory import plugin

PACKAGE = Path(__file__).resolve().parents[1] / "sgl_memory"
OURS = (
    "sgl_memory.engine.radix_cache.SglMemoryRadixCache",
    "sgl_memory.engine.attention.cpu_backend.SglMemoryCpuAttnBackend",
    "sgl_memory.engine.int8_pool.Int8KVPool",
    "sgl_memory.frontend.MemoryEndpoint",
)
# private names the package reads that are not SGLang's: namedtuple's copy, a torch op
NOT_SGLANG = {"_replace", "_scaled_dot_product_flash_attention_for_cpu"}


def listed(kind: str) -> set[tuple[str, str]]:
    return {(c.by, c.target) for c in plugin.contacts() if c.kind == kind}


def test_every_hook_and_contact_exists_in_the_installed_sglang():
    plugin.check_patch_set()
    for c in plugin.contacts():
        assert pkgutil.resolve_name(c.by), c.by
        assert c.kind in ("override", "wrap", "use", "api", "field") and c.why


def test_a_contact_that_is_gone_is_refused_at_start_up():
    gone = plugin.Contact("sglang.srt.mem_cache.radix_cache.RadixCache._no_such_method", "override", "x", "test")
    with pytest.raises(plugin.PatchSetError, match=r"RadixCache\._no_such_method \(a override by x; test\)"):
        plugin.check_patch_set(touched=plugin.contacts() + [gone])


def test_a_field_that_is_gone_is_refused_at_start_up():
    from sglang.srt.managers.schedule_batch import Req

    gone = plugin.Contact("sglang.srt.managers.schedule_batch.Req.no_such_field", "field", "sgl_memory.persist", "test")
    with pytest.raises(plugin.PatchSetError, match=r"Req\.no_such_field \(a field by sgl_memory\.persist; test\)"):
        plugin.check_patch_set(touched=plugin.contacts() + [gone])
    # found where SGLang assigns it, as a method, or not at all
    assert plugin.has_field(Req, "origin_input_ids") and plugin.has_field(Req, "finished")
    assert not plugin.has_field(Req, "origin_input") and not plugin.has_field(Req, "no_such_field")


# The packages whose code sees SGLang's request and scheduler through the names a hook gives them
# (`req`, `scheduler`): the core floor and each mechanism (engine/ is SGLang's side and lists its
# contacts by kind above)
FLOOR_AND_MECHANISMS = ("core", *sorted(MECHANISMS))
SGLANG_OBJECTS = {
    "req": "sglang.srt.managers.schedule_batch.Req",
    "scheduler": "sglang.srt.managers.scheduler.Scheduler",
}


def test_the_request_and_scheduler_views_are_the_listed_fields():
    """core/views.py's protocols name exactly the fields listed (kind `field`), per SGLang class:
    what a mechanism sees of SGLang's request and scheduler is written down once, typed, and
    checked at start-up."""
    from sgl_memory.core import views

    def members(cls) -> set[str]:
        methods = {n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("_")}
        return set(cls.__annotations__) | methods

    fields = {target for _, target in listed("field")}
    for view, sglang in (
        (views.RequestView, SGLANG_OBJECTS["req"]),
        (views.SchedulerView, SGLANG_OBJECTS["scheduler"]),
    ):
        assert members(view) == {t.rsplit(".", 1)[1] for t in fields if t.rsplit(".", 1)[0] == sglang}, view.__name__


def test_every_field_of_sglangs_request_and_scheduler_a_mechanism_touches_is_listed():
    """`req.<name>`, `scheduler.<name>` and `getattr(req, "<name>")` in the core floor and the
    mechanisms, per package, are exactly the listed fields: an SGLang upgrade that renames one
    stops start-up instead of serving a request without what the mechanism read."""
    found = set()
    for package in FLOOR_AND_MECHANISMS:
        for path in (PACKAGE / package).glob("*.py"):
            for n in ast.walk(ast.parse(path.read_text())):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in SGLANG_OBJECTS:
                    found.add((f"sgl_memory.{package}", f"{SGLANG_OBJECTS[n.value.id]}.{n.attr}"))
                elif (
                    isinstance(n, ast.Call)
                    and getattr(n.func, "id", None) == "getattr"
                    and len(n.args) >= 2
                    and isinstance(n.args[0], ast.Name)
                    and n.args[0].id in SGLANG_OBJECTS
                    and isinstance(n.args[1], ast.Constant)
                ):
                    found.add((f"sgl_memory.{package}", f"{SGLANG_OBJECTS[n.args[0].id]}.{n.args[1].value}"))
    assert found == listed("field")


def sglang_member(cls: type, name: str) -> str | None:
    """`module.Class.name` of the SGLang class in `cls`'s bases that defines `name`, if any."""
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("sglang") and name in vars(base):
            return f"{base.__module__}.{base.__qualname__}.{name}"
    return None


def test_the_overrides_listed_are_exactly_the_overrides():
    found = set()
    for path in OURS:
        cls = pkgutil.resolve_name(path)
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and not name.startswith("__") and (target := sglang_member(cls, name)):
                found.add((path, target))
    assert found == listed("override")


def test_the_allocator_view_wraps_what_is_listed():
    from sgl_memory.engine.dead_slots import SentinelSafeAllocator
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

    base = f"{BaseTokenToKVPoolAllocator.__module__}.{BaseTokenToKVPoolAllocator.__qualname__}"
    found = {
        ("sgl_memory.engine.dead_slots.SentinelSafeAllocator", f"{base}.{name}")
        for name in vars(SentinelSafeAllocator)
        if not name.startswith("_") and hasattr(BaseTokenToKVPoolAllocator, name)
    }
    assert found == listed("wrap") and found


def our_names() -> set[str]:
    """Every name the package defines (functions, classes, attributes it assigns, arguments)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
    return names


def test_every_private_sglang_name_the_package_uses_is_listed():
    """A private name (one underscore) the package reads, calls or imports and does not define
    itself is SGLang's (or in NOT_SGLANG): it must be a listed contact. An override of a private
    method is listed as an override (above)."""
    ours, used = our_names(), {}
    for path in PACKAGE.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                names = [n.attr]
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang"):
                names = [a.name for a in n.names]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    used.setdefault(name, set()).add(str(path.relative_to(PACKAGE)))
    foreign = {name: where for name, where in used.items() if name not in ours and name not in NOT_SGLANG}
    targets = {c.target.rsplit(".", 1)[-1] for c in plugin.contacts()} | {
        s.target.rsplit(".", 1)[-1] for s in plugin.manifest()
    }
    assert not {name: where for name, where in foreign.items() if name not in targets}
    # the overrides call the methods they replace through super(): those are listed overrides
    for path in OURS:
        cls = pkgutil.resolve_name(path)
        for name, value in vars(cls).items():
            if (
                inspect.isfunction(value)
                and name.startswith("_")
                and not name.startswith("__")
                and sglang_member(cls, name)
            ):
                assert (path, sglang_member(cls, name)) in listed("override")


def test_hooks_live_in_the_engine():
    """Every hook function of hooks.yaml is the engine's: no mechanism hooks SGLang itself."""
    for spec in plugin.manifest():
        module = spec.hook.rsplit(".", 1)[0]
        assert module.startswith("sgl_memory.engine."), spec.hook
        importlib.import_module(module)


def test_the_uses_listed_are_in_the_code():
    """A listed use names code that is there: its module (`by`) mentions the member it uses."""
    for by, target in listed("use") | listed("api"):
        assert target.rsplit(".", 1)[-1] in inspect.getsource(importlib.import_module(by)), (by, target)
