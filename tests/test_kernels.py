"""Triton kernels under TRITON_INTERPRET=1 against their torch references.

The interpreter must be switched on before Triton is imported, and the rest of the suite imports
it without; so the kernel checks (tests/interpreted/) run in a child pytest with the flag set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_match_references_under_the_triton_interpreter():
    here = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "interpreted")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=here.parent,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout
