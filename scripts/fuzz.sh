#!/usr/bin/env bash
# A longer fuzzing run of the real server's request surface than the suite's (tests/test_fuzz_server.py).
#   scripts/fuzz.sh [EXAMPLES]   examples per endpoint (default 2000); the seed is fixed
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh smollm2-135m-instruct
SGLMEMORY_FUZZ_EXAMPLES="${1:-2000}" exec .venv/bin/python -m pytest -p no:cacheprovider -q tests/test_fuzz_server.py
