#!/usr/bin/env bash
# Set up what is missing (venv, SGLang, the test and benchmark dependencies, the test and default
# models), then run the whole suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not server"` for the unit tests only
# (they start no server). The run ends with where its time went: the server starts and each
# module's wall time (tests/conftest.py), beside pytest's 30 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
# What this machine is, so that a slow run can be read: the CPU, and the dtype the servers compute in.
echo "[test] $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores"
.venv/bin/python -c "from sgl_memory import cpu_dtype; print('[test]', cpu_dtype.choose().log_line())"
# Lint, format and types first (about a minute): pyproject.toml's [tool.ruff] and [tool.mypy] hold the tree at zero.
.venv/bin/python -m ruff check --no-cache .
.venv/bin/python -m ruff format --check --no-cache .
# The type check of the core and the engine (pyproject.toml [tool.mypy]): the mechanism contract, typed.
.venv/bin/python -m mypy --cache-dir=/dev/null
exec .venv/bin/python -m pytest -p no:cacheprovider -q -ra --durations=30 "$@"
