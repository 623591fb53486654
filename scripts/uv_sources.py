"""Where pip installs from, as uv's flags: scripts/setup.sh installs with uv, which reads no pip
configuration, so that a machine whose pip points at a mirror, a wheel folder or a constraints
file (a company's index, this workplace's local wheels) installs from the same places with uv.

    python -m pip config list | python scripts/uv_sources.py         (uv pip install's flags)
    python -m pip config list | python scripts/uv_sources.py --env   (uv's variables, KEY=VALUE)

prints one item per line. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import ast
import sys

# the sections of pip's configuration an install reads, weakest first: pip's [install] section
# overrides [global], and its PIP_* variables (listed as ":env:") override both
SECTIONS = {"global": 0, "install": 1, ":env:": 2}
# pip's key -> uv's flag; each takes a space-separated list in pip's configuration
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
# pip's key -> uv's variable: the CA bundle pip verifies with, its network timeout in seconds
VARIABLES = {"cert": "SSL_CERT_FILE", "default-timeout": "UV_HTTP_TIMEOUT", "timeout": "UV_HTTP_TIMEOUT"}


def settings(listing: str) -> dict[str, str]:
    """pip's value per key for an install, from `pip config list` lines (`section.key='value'`)."""
    found: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not sep or not dot or section not in SECTIONS:
            continue  # another command's section ([download], [wheel]): not an install's
        if key not in found or SECTIONS[section] >= found[key][0]:
            found[key] = (SECTIONS[section], ast.literal_eval(value))
    return {key: value for key, (_, value) in found.items()}


def uv_args(listing: str) -> list[str]:
    """uv pip install's flags for the sources pip would use. The index strategy is pip's: the best
    version over every index, not the first index that has the package at all."""
    args = ["--index-strategy", "unsafe-best-match"]
    for key, value in settings(listing).items():
        if key in FLAGS:
            args += [arg for item in value.split() for arg in (FLAGS[key], item)]
    return args


def uv_env(listing: str) -> dict[str, str]:
    """uv's variables for pip's certificate bundle and timeout."""
    return {VARIABLES[key]: value for key, value in settings(listing).items() if key in VARIABLES}


if __name__ == "__main__":
    listing = sys.stdin.read()
    if sys.argv[1:] == ["--env"]:
        print("\n".join(f"{k}={v}" for k, v in uv_env(listing).items()))
    else:
        print("\n".join(uv_args(listing)))
