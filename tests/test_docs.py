"""The user docs: a README of one screen or two, links that lead somewhere, and the README's first
agent run as it is written.

References: the files in the checkout and the headings they hold (a link's target must exist; an
anchor must be one of the target page's headings, slugged as GitHub and MkDocs slug them), and the
real server's answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text outside code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    heads = re.findall(r"^#{1,6} (.*)$", prose(path.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_the_readme_fits_a_screen_or_two():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_LINES


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # another site
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_the_docs_site_builds_strict(tmp_path):
    """Every page in the nav, no page outside it, no broken link between pages (mkdocs.yml)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]


def test_every_config_key_has_its_line_and_the_reference_matches_the_code():
    """docs/configuration-reference.md is what the settings dataclasses say now: a key without a
    line of meaning, or a default, bound or key changed in the code but not regenerated, fails."""
    from sgl_memory import config_reference

    unsaid = [f"{name}.{k.name}" for name, (_, keys) in config_reference.sections().items() for k in keys if not k.meaning]
    assert not unsaid, f"config keys without a line of meaning (a comment beside or above the field): {unsaid}"
    committed = config_reference.OUT.read_text()
    assert committed == config_reference.render(), "run: python -m sgl_memory.config_reference"
    # read back independently of the generator: each section's row of each field shows the
    # dataclass's own default
    from sgl_memory.core import mechanism

    for cls in mechanism.ordered():
        part = committed.split(f"## `{cls.name}`", 1)[1].split("\n## ", 1)[0]
        rows = {cells[0].strip("| `"): cells[2].strip() for cells in (line.split(" | ") for line in part.splitlines() if line.startswith("| `"))}
        for f in dataclasses.fields(cls.settings):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert rows[f.name] == (f"`{str(default).lower()}`" if isinstance(default, bool) else f"`{default!r}`"), (cls.name, f.name)


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A first agent") :]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


@pytest.mark.server
def test_the_readme_first_agent_runs_as_written(plain_server):
    """On the pool's server with no memory config (`plain`, the README's `scripts/serve.sh`): only
    the address and the session id (one of its own) differ from the README's text."""
    code = readme_example().replace("http://127.0.0.1:30000/v1", plain_server.url + "/v1").replace('"agent-1"', '"readme-first-agent"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    first, second = out.getvalue().strip().splitlines()
    assert "'text_match': None" in first  # a new session
    # the same session, recognised by the header alone: its stored path matched (a sampled answer
    # that re-tokenizes differently diverges from it, still the session's)
    assert any(f"'text_match': '{outcome}'" in second for outcome in ("exact", "extend", "diverge"))
