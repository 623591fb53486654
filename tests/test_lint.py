"""The lint pyproject.toml configures (`[tool.ruff]`: pyflakes and syntax errors) finds nothing in
the repository: an unused import, an undefined name or a shadowed definition fails the suite."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
