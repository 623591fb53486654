"""The configuration reference (docs/configuration-reference.md), generated from the code it
describes: each registered mechanism's settings dataclass gives the keys, their types and defaults
and, from the comment beside or above each field, its meaning; `validate()` gives the bounds it
enforces; the mechanism's request part gives the keys a request may override. Also the deployment
page's table of the TP and page sizes each mechanism serves, from what each declares
(`tp_refusal`, `page_refusal`), between its SCALE_BEGIN and SCALE_END markers.

    python -m sgl_memory.config_reference            # rewrite both
    python -m sgl_memory.config_reference --check    # exit 1 if either differs from the code

tests/test_docs.py fails when a key has no line of meaning or a generated text is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

from sgl_memory.core import composition, mechanism
from sgl_memory.core.config import SessionSources
from sgl_memory.core.request import FIELD, RequestPart

DOCS = Path(__file__).resolve().parents[1] / "docs"
OUT = DOCS / "configuration-reference.md"
DEPLOYMENT = DOCS / "deployment.md"
SCALE_BEGIN = "<!-- generated: python -m sgl_memory.config_reference -->"
SCALE_END = "<!-- end of generated -->"


@dataclasses.dataclass(frozen=True)
class Key:
    """One key of the configuration reference: its name, type, default, allowed values, where a
    request overrides it, and its meaning."""

    name: str
    type: str
    default: str
    allowed: str  # choices or bounds; "" when any value of the type is accepted
    request: str  # where a request overrides it ("" when it cannot)
    meaning: str


def meanings(cls: type) -> dict[str, str]:
    """Each field's comment: the one on its line, else the comment lines right above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and "fmt:" not in tok.string:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        text = comments.get(node.lineno) if not lines[node.lineno - 1].lstrip().startswith("#") else None
        if text is None:
            above, row = [], node.lineno - 1
            while row in comments and lines[row - 1].lstrip().startswith("#"):
                above.insert(0, comments[row])
                row -= 1
            text = " ".join(above)
        out[node.target.id] = text
    return out


def _literal_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # an f-string: its text with each {expression} shown by its source
        return "".join(
            v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}" for v in node.values
        )
    return None


def bounds(cls: type) -> dict[str, str]:
    """What `validate()` requires of each key: the `allowed` text of its `require` calls (a loop
    over names gives each of them the same text)."""
    if "validate" not in vars(cls):
        return {}
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.validate)))
    module_globals = vars(sys.modules[cls.__module__])
    out: dict[str, str] = {}

    def visit(node, loop_names=()):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
            names = tuple(e.value for e in node.iter.elts if isinstance(e, ast.Constant))
            for child in node.body:
                visit(child, names)
            return
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require" and len(node.args) == 3:
            key, allowed = _literal_text(node.args[1]), _literal_text(node.args[2])
            if key is not None and allowed is not None:
                for name, value in module_globals.items():  # module constants named in the text
                    if isinstance(value, (int, float)) and "{" + name + "}" in allowed:
                        allowed = allowed.replace("{" + name + "}", str(value))
                for part in key.split(".", 1)[1].split(" / ") if "." in key else ():
                    for name in loop_names if part == "{name}" else (part,):
                        out[name] = allowed
        for child in ast.iter_child_nodes(node):
            visit(child, loop_names)

    visit(tree)
    return out


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "string"
    if tp is bool:
        return "bool"
    if tp in (int, float, str):
        return {int: "integer", float: "number", str: "string"}[tp]
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _allowed(tp, bound: str) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(tp))
    return bound


def request_paths(cls: type[mechanism.Mechanism]) -> dict[str, str]:
    """Config keys a request may override, and where in the `sgl_memory` field: the request part's
    fields that are also the section's, at the top level of the field when the mechanism reads them
    there, else in the mechanism's own object."""
    module = sys.modules[cls.settings.__module__]
    parts = [
        c for c in vars(module).values() if isinstance(c, type) and issubclass(c, RequestPart) and c is not RequestPart
    ]
    keys = {f.name for f in dataclasses.fields(cls.settings)}
    out = {}
    for part in parts:
        for f in dataclasses.fields(part):
            if f.name in keys:
                at = f.name if f.name in cls.fields else f"{cls.fields[0]}.{f.name}" if len(cls.fields) == 1 else None
                if at is not None:
                    out[f.name] = f"`{FIELD}.{at}`"
    return out


def section(settings: type, requests: dict[str, str]) -> list[Key]:
    hints = typing.get_type_hints(settings)
    said, bound = meanings(settings), bounds(settings)
    keys = []
    for f in dataclasses.fields(settings):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        keys.append(
            Key(
                f.name,
                _type_name(hints[f.name]),
                f"`{default!r}`" if not isinstance(default, bool) else f"`{str(default).lower()}`",
                _allowed(hints[f.name], bound.get(f.name, "")),
                requests.get(f.name, ""),
                said.get(f.name, ""),
            )
        )
    return keys


def sections() -> dict[str, tuple[str, list[Key]]]:
    """Section name -> (what it configures, its keys), in the mechanisms' order, then `sessions`."""
    mechanism.discover()
    out = {}
    for cls in mechanism.ordered():
        doc = (cls.settings.__doc__ or "").strip().splitlines()[0]
        out[cls.name] = (doc, section(cls.settings, request_paths(cls)))
    out["sessions"] = ((SessionSources.__doc__ or "").strip().replace("\n    ", " "), section(SessionSources, {}))
    return out


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the code by `python -m sgl_memory.config_reference` (do not edit by hand;",
        "`tests/test_docs.py` fails when this page and the code differ). How the file is loaded and",
        "checked: [configuration](configuration.md). Every key is optional; a section left out takes",
        "these defaults.",
        "",
    ]
    for name, (doc, keys) in sections().items():
        lines += [
            f"## `{name}`",
            "",
            doc,
            "",
            "| key | type | default | allowed | per request | meaning |",
            "|---|---|---|---|---|---|",
        ]
        for k in keys:
            cells = [f"`{k.name}`", k.type, k.default, k.allowed, k.request, k.meaning]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def scale_table() -> str:
    """What each mechanism refuses, as the deployment page shows it."""
    mechanism.discover()
    rows = ["| mechanism | page size > 1 | TP > 1 |", "|---|---|---|"]
    for cls in mechanism.ordered():
        cells = ["runs" if why is None else f"refused: {why}" for why in composition.scale_refusals(cls)]
        rows.append(f"| `{cls.name}` | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)


def with_scale_table(page: str) -> str:
    """The deployment page with its generated table replaced by the current one."""
    head, rest = page.split(SCALE_BEGIN, 1)
    return f"{head}{SCALE_BEGIN}\n{scale_table()}\n{SCALE_END}{rest.split(SCALE_END, 1)[1]}"


def main(argv: list[str]) -> int:
    outputs = {OUT: render(), DEPLOYMENT: with_scale_table(DEPLOYMENT.read_text())}
    if "--check" in argv:
        stale = [str(path) for path, text in outputs.items() if not path.exists() or path.read_text() != text]
        if stale:
            print(
                f"{', '.join(stale)} differ from the code: run python -m sgl_memory.config_reference", file=sys.stderr
            )
            return 1
        return 0
    for path, text in outputs.items():
        path.write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
