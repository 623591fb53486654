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


RESULT = re.compile(r"bench/results/([A-Za-z0-9_.-]+)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def result_stem(name: str) -> str:
    """A results file named in prose, without its extensions (`x.{json,png}`, `x.json`, `x.rows`)."""
    name = name.rstrip(".")
    while re.search(r"\.(json|jsonl|png|md|rows)$", name):
        name = re.sub(r"\.(json|jsonl|png|md|rows)$", "", name)
    return name


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_result_plot_a_page_cites_is_shown_in_it(page):
    """A result the page names (bench/results/<name>.json, .png, .{json,png}) whose plot is committed
    is shown as an image in that page."""
    text = prose(page.read_text())
    results = ROOT / "bench" / "results"
    cited = {result_stem(n) for n in RESULT.findall(text)}
    plots = {stem for stem in cited if (results / f"{stem}.png").exists()}
    shown = {(page.parent / target).resolve() for target in IMAGE.findall(text)}
    missing = sorted(stem for stem in plots if (results / f"{stem}.png").resolve() not in shown)
    assert not missing, missing


def test_the_docs_site_builds_strict_with_a_home_page_and_every_image_and_link_inside_it(tmp_path):
    """Every page in the nav, no page outside it, no broken link or anchor (mkdocs.yml: warnings
    fail --strict); the README is the home page, with its plot; every image and every link of every
    built page leads to a file of the site (the repository files the pages link to are in it:
    scripts/docs_site.py)."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    home = (site / "index.html").read_text()
    assert "<h1" in home and "sgl-memory" in home and re.search(r"<img [^>]*src=", home)
    broken = []
    for html in site.rglob("*.html"):
        for attr, target in re.findall(r'<(?:img|a) [^>]*?(src|href)="([^"#?]*)[^"]*"', html.read_text()):
            if not target or re.match(r"^[a-z]+:", target) or target.startswith("/"):
                continue  # an anchor on the page, another site
            file = (html.parent / target).resolve()
            if not (file.is_file() or (file / "index.html").is_file()):
                broken.append(f"{html.relative_to(site)}: {attr}={target}")
    assert not broken, broken[:20]


def test_every_config_key_has_its_line_and_the_reference_matches_the_code():
    """docs/configuration-reference.md is what the settings dataclasses say now: a key without a
    line of meaning, or a default, bound or key changed in the code but not regenerated, fails."""
    from sgl_memory import config_reference

    unsaid = [
        f"{name}.{k.name}" for name, (_, keys) in config_reference.sections().items() for k in keys if not k.meaning
    ]
    assert not unsaid, f"config keys without a line of meaning (a comment beside or above the field): {unsaid}"
    committed = config_reference.OUT.read_text()
    assert committed == config_reference.render(), "run: python -m sgl_memory.config_reference"
    deployment = config_reference.DEPLOYMENT.read_text()
    assert deployment == config_reference.with_scale_table(deployment), "run: python -m sgl_memory.config_reference"
    # read back independently of the generator: each section's row of each field shows the
    # dataclass's own default
    from sgl_memory.core import mechanism

    for cls in mechanism.ordered():
        part = committed.split(f"## `{cls.name}`", 1)[1].split("\n## ", 1)[0]
        rows = {
            cells[0].strip("| `"): cells[2].strip()
            for cells in (line.split(" | ") for line in part.splitlines() if line.startswith("| `"))
        }
        for f in dataclasses.fields(cls.settings):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert rows[f.name] == (f"`{str(default).lower()}`" if isinstance(default, bool) else f"`{default!r}`"), (
                cls.name,
                f.name,
            )


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A first agent") :]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


@pytest.mark.server
def test_the_readme_first_agent_runs_as_written(all_server):
    """On the pool's server with persistence on (`all`; the default server's persistence is
    tests/test_server_e2e.py's, and on the `plain` server this chat's template prefix, cached, would
    change how the later tests' bf16 prompts are prefilled): only the address and the session id
    (one of its own) differ from the README's text."""
    code = (
        readme_example()
        .replace("http://127.0.0.1:30000/v1", all_server.url + "/v1")
        .replace('"agent-1"', '"readme-first-agent"')
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    # each turn prints its answer (sampled: it may span lines) and then its metrics
    first, second = re.findall(r"'text_match': (None|'[a-z]+')", out.getvalue())
    assert first == "None"  # a new session
    # the same session, recognised by the header alone: its stored path matched (a sampled answer
    # that re-tokenizes differently diverges from it, still the session's)
    assert second in ("'exact'", "'extend'", "'diverge'")


# --- the request reference (docs/requests.md) against the server's own parser ---------------------

REQUESTS = ROOT / "docs" / "requests.md"


def table_keys(heading: str) -> list[str]:
    """The backticked names in the first column of the table under `heading`."""
    text = REQUESTS.read_text()
    section = text[text.index(heading) :].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [name for row in rows for name in re.findall(r"`([^`]+)`", row.split(" | ")[0])]


def allowed_keys(raw: dict, where: str) -> set[str]:
    """What the parser accepts at `where`: its refusal of an unknown key lists the allowed ones."""
    from sgl_memory.core import request

    with pytest.raises(request.SpecError, match=rf"^{re.escape(where)}: unknown field\(s\)") as refused:
        request.parse(raw)
    return set(str(refused.value).split("; allowed: ")[1].split(", "))


def documented_response_keys() -> set[str]:
    text = REQUESTS.read_text()
    section = text[text.index("## The response's") :]
    return {
        name
        for row in section.splitlines()
        if row.startswith("| [")
        for name in re.findall(r"`([a-z_]+)`", row.split(" | ")[1])
    }


def test_the_request_reference_lists_every_key_the_parser_takes_and_no_other():
    from sgl_memory.core.request import FIELD

    assert set(table_keys("## The field's keys")) == allowed_keys({"not-a-key": 1}, FIELD)
    documented = table_keys("### Objects")
    for name in ("memory", "keep", "sentencekv", "agent"):
        inside = {key.split(".", 1)[1] for key in documented if key.startswith(name + ".")}
        assert inside == allowed_keys({"session_id": "s", name: {"not-a-key": 1}}, f"{FIELD}.{name}"), name


def test_the_request_reference_names_the_headers_the_server_reads():
    from sgl_memory.engine.http_api import SESSION_HEADER, TENANT_HEADER

    assert {SESSION_HEADER, TENANT_HEADER} <= {h.lower() for h in table_keys("## Headers")}
