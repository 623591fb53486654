#!/usr/bin/env bash
# Set up what is missing, then serve the embedded default model on 127.0.0.1:30000.
# Extra arguments go to `python -m sgl_memory.launch_server` (any sglang.launch_server flag too).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh qwen2.5-coder-0.5b-instruct
exec .venv/bin/python -m sgl_memory.launch_server --host 127.0.0.1 --port 30000 "$@"
