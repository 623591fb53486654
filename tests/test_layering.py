"""The package's layer rule, read from the source's import statements (see the layer table in docs/architecture.md):

- core/ (the floor) imports nothing of sgl-memory but itself, and no SGLang;
- a mechanism package imports only core/ (and itself), and no SGLang;
- the engine imports core/ and itself, never a mechanism: it finds them through the registry;
- nothing else imports a mechanism either.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sgl_memory.core import mechanism

PACKAGE = Path(__file__).resolve().parents[1] / "sgl_memory"
# the mechanism packages, as discovery finds them (a package's `__init__` names its mechanism's module)
MECHANISMS = {module.split(".")[1] for module in mechanism.builtin()}
KERNELS = {"kernels"}  # compute kernels (Triton, kernels/ in the repository): no SGLang, usable from any floor
ROOT = {"SGLANG_VERSION", "__version__"}  # the package's own __init__
PLATFORM = {"cpu_compat", "cpu_dtype"}  # the CPU platform layer, imported at interpreter start (a .pth)
# the launcher's choices the server reports (/sgl_memory/info): import only the core floor
LAUNCH = {"kv_pool"}


def imports(path: Path) -> tuple[set[str], set[str]]:
    """The sgl_memory units (`core`, `engine`, a mechanism, or a top-level module) and the top-level
    foreign packages this file imports, at top level or inside functions."""
    ours, foreign = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] == "sgl_memory":
                ours.update([parts[1]] if len(parts) > 1 else [alias.name for alias in node.names])
            else:
                foreign.add(parts[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "sgl_memory" and len(parts) > 1:
                    ours.add(parts[1])
                foreign.add(parts[0])
    return ours, foreign


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 else path.stem


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PACKAGE)) for p in SOURCES])
def test_layers_do_not_import_upwards(path):
    unit, rel = unit_of(path), str(path.relative_to(PACKAGE))
    ours, foreign = imports(path)
    ours -= {unit}
    if unit == "core":
        assert ours <= KERNELS, f"{rel} (core) imports {sorted(ours - KERNELS)}"
    elif unit in MECHANISMS:
        allowed = {"core"} | KERNELS
        assert ours <= allowed, f"{rel} imports {sorted(ours - allowed)}: a mechanism imports only the core floor"
    elif unit == "engine":
        allowed = {"core"} | KERNELS | ROOT | PLATFORM | LAUNCH
        assert ours <= allowed, f"{rel} (engine) imports {sorted(ours - allowed)}"
    else:
        assert not ours & MECHANISMS, (
            f"{rel} imports {sorted(ours & MECHANISMS)}: only the registry knows the mechanisms"
        )
    if unit == "core" or unit in MECHANISMS:
        assert "sglang" not in foreign, f"{rel} imports SGLang: only the engine (and the server layer) may"


def test_the_rule_is_not_vacuous():
    """The walk sees imports where they are, and every mechanism package is listed."""
    assert {"core", "engine"} == imports(PACKAGE / "engine" / "radix_cache.py")[0]
    assert "sglang" in imports(PACKAGE / "engine" / "radix_cache.py")[1]
    assert {"core", "memart"} <= imports(PACKAGE / "memart" / "manager.py")[0]
    assert MECHANISMS == {p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {
        "core",
        "engine",
        "patches",
        "kernels",
    }
    # and each registers one mechanism, from its own package
    mechanism.discover()
    registered = {
        cls.__module__.split(".")[1] for cls in mechanism.REGISTRY.values() if cls.__module__.startswith("sgl_memory.")
    }
    assert registered == MECHANISMS


def test_every_package_ships():
    """pyproject lists the packages a (non-editable) install ships: a package left out of the list
    installs without it, and the server then fails at start-up."""
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    listed = set(config["packages"]) - set(config["package-dir"])  # patches/, kernels/ live outside sgl_memory/
    assert on_disk == listed
