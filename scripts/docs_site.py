"""MkDocs hook (mkdocs.yml `hooks:`): the docs site holds every file its pages link to.

The pages live in docs/ and link to files elsewhere in the repository: the README (the site's home
page), package READMEs, the changelog, benchmark scripts and examples, result plots. Each becomes a
file of the site at build time, from the file itself (nothing copied by hand):

| repository file                | in the site                                     |
|--------------------------------|-------------------------------------------------|
| `README.md`                    | `index.md`, the home page                       |
| `docs/<page>`                  | `<page>`                                        |
| `sgl_memory/<package>/README.md` | `packages/<package>.md`                       |
| `CHANGELOG.md`                 | `changelog.md`                                  |
| `bench/results/<plot>`         | `results/<plot>`                                |
| any other file                 | `source/<path>.md`: a page showing its text     |

Links in every page are rewritten to the site's paths, so MkDocs' link validation (at warning level:
`--strict` fails on a broken one) checks them all.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

# an inline link or image target: [text](target) / ![alt](target), up to a space or the paren
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
LANGUAGES = {".py": "python", ".yaml": "yaml", ".yml": "yaml", ".sh": "bash", ".json": "json", ".toml": "toml"}


def site_uri(repo_path: str) -> str:
    """Where a repository file (posix, relative to the root) is in the site."""
    parts = repo_path.split("/")
    if repo_path == "README.md":
        return "index.md"
    if parts[0] == "docs":
        return "/".join(parts[1:])
    if len(parts) == 3 and parts[0] == "sgl_memory" and parts[2] == "README.md":
        return f"packages/{parts[1]}.md"
    if repo_path == "CHANGELOG.md":
        return "changelog.md"
    if parts[:2] == ["bench", "results"]:
        return "results/" + "/".join(parts[2:])
    return f"source/{repo_path}.md"


def linked(text: str, repo_path: str, root: Path) -> list[str]:
    """The repository files (posix, relative to the root) a page's prose links to."""
    out = []
    for _, target, _ in LINK.findall(FENCE.sub("", text)):
        path = target.partition("#")[0]
        if not path or re.match(r"^[a-z]+:", path):
            continue  # the page itself, or another site
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), path))
        if not resolved.startswith("..") and (root / resolved).is_file():
            out.append(resolved)
    return out


def source_page(repo_path: str, root: Path) -> str:
    """A page showing a repository file's text."""
    text = (root / repo_path).read_text()
    return f"# `{repo_path}`\n\n```{LANGUAGES.get(Path(repo_path).suffix, 'text')}\n{text}\n```\n"


def on_files(files: Files, config) -> Files:
    root = Path(config.config_file_path).parent
    pages = ["README.md", *(f"docs/{f.src_uri}" for f in files.documentation_pages())]
    seen: set[str] = set()
    while pages:  # the pages' links, and the links of the files they bring in
        page = pages.pop()
        for repo_path in linked((root / page).read_text(), page, root):
            if repo_path.startswith("docs/") or repo_path in seen:
                continue
            seen.add(repo_path)
            if repo_path.endswith(".md"):
                pages.append(repo_path)
    for repo_path in sorted(seen | {"README.md"}):
        uri = site_uri(repo_path)
        if uri.startswith("source/"):
            files.append(File.generated(config, uri, content=source_page(repo_path, root)))
        else:
            files.append(File.generated(config, uri, abs_src_path=str(root / repo_path)))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Each link to a repository file, as the site's path of that file relative to this page."""
    root = Path(config.config_file_path).parent
    abs_src = page.file.abs_src_path
    if abs_src is None:
        return markdown  # a page of a file's text: it links nowhere
    repo_path = Path(abs_src).resolve().relative_to(root.resolve()).as_posix()
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        path, hash_, anchor = target.partition("#")
        if not path or re.match(r"^[a-z]+:", path):
            return match.group(0)
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), path))
        if resolved.startswith("..") or not (root / resolved).exists():
            return match.group(0)  # left to the link validation to report
        uri = posixpath.relpath(site_uri(resolved), here or ".")
        return f"{match.group(1)}{uri}{hash_}{anchor}{match.group(3)}"

    # code blocks are shown as written
    pieces, at = [], 0
    for fence in FENCE.finditer(markdown):
        pieces += [LINK.sub(rewrite, markdown[at : fence.start()]), fence.group(0)]
        at = fence.end()
    return "".join([*pieces, LINK.sub(rewrite, markdown[at:])])
