"""The package's layer rule, read from the source's import statements: the ground floor imports
nothing above it, a mechanism package imports only the ground floor, and nothing outside a
mechanism's package imports it (the server finds mechanisms through the registry)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sgl_memory"
GROUND = {"config", "request", "metrics", "spans", "capture", "runtime", "mechanism", "sessions", "worker", "tree_fill", "rope",
          "prometheus", "kernels", "reuse", "compact", "allocator", "slots", "__init__"}  # fmt: skip
MECHANISMS = {"intent", "persist", "memart", "keep"}


def imported(path: Path) -> set[str]:
    """sgl_memory.<first part> of every module this file imports (top level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sgl_memory":
            parts = node.module.split(".")
            names.update([parts[1]] if len(parts) > 1 else [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("sgl_memory."))
    return names


def layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 else path.stem


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PACKAGE)) for p in SOURCES])
def test_layers_do_not_import_upwards(path):
    layer = layer_of(path)
    deps = imported(path) - {layer}
    if layer in GROUND:
        assert deps <= GROUND, f"{path.name} (ground floor) imports {sorted(deps - GROUND)}"
    elif layer in MECHANISMS:
        assert deps <= GROUND, f"{layer}/{path.name} imports {sorted(deps - GROUND)}: a mechanism imports only the ground floor"
    else:
        assert not deps & MECHANISMS, f"{path.name} imports {sorted(deps & MECHANISMS)}: only the registry knows the mechanisms"


def test_the_rule_is_not_vacuous():
    """The walk sees imports where they are, and every mechanism package is listed."""
    assert {"mechanism", "runtime", "tree_fill"} <= imported(PACKAGE / "radix_cache.py")
    assert {"capture", "mechanism", "metrics", "tree_fill", "memart"} <= imported(PACKAGE / "memart" / "manager.py")
    assert MECHANISMS == {p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {"attention"}
