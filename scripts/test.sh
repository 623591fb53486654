#!/usr/bin/env bash
# Set up what is missing (venv, SGLang, the test and benchmark dependencies, the test and default
# models), then run the whole suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not server"` for the fast unit tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
exec .venv/bin/python -m pytest -p no:cacheprovider -q -ra --durations=30 "$@"
