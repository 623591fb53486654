#!/usr/bin/env bash
# Idempotent set-up: .venv with the pinned SGLang (CPU install path), sgl-memory, and the CPU
# work-arounds. A second run checks a stamp and returns in seconds.
#   scripts/setup.sh [--dev] [MODEL ...]
#     --dev   also what the tests and benchmarks need (scripts/requirements-dev.txt, BFCL's harness
#             modules); serving needs none of it (scripts/serve.sh leaves it out)
#     MODEL   also fetch these models (see `python -m sgl_memory.models list`)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
SGLANG_VERSION=0.5.23
DEV=0
if [ "${1:-}" = "--dev" ]; then
  DEV=1
  shift
fi

# each phase's seconds, printed as it ends (where a first run's minutes go)
phase_start=$SECONDS
phase_done() {
  echo "[setup] $1: $((SECONDS - phase_start)) s"
  phase_start=$SECONDS
}

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY=$VENV/bin/python
UV_VERSION=0.13.8
# uv installs the packages: it unpacks wheels on every core and links them from its cache (a second
# set-up, or another clone, reuses it), where pip unpacks one file at a time (2-3 minutes of pip
# here on a fresh machine). It reads none of pip's configuration, so pip's sources (index, mirror,
# wheel folder, constraints, CA bundle) are passed to it (scripts/uv_sources.py). It writes no
# bytecode: compileall does that below on every core, beside the model's conversion.
INSTALL=()
installer() {
  [ ${#INSTALL[@]} -gt 0 ] && return
  if [ "$("$VENV/bin/uv" --version 2>/dev/null)" != "uv $UV_VERSION" ]; then
    "$PY" -m pip --disable-pip-version-check install -q "uv==$UV_VERSION"
  fi
  local pip_config variable
  pip_config=$("$PY" -m pip config list 2>/dev/null || true)
  mapfile -t uv_sources < <("$PY" scripts/uv_sources.py <<<"$pip_config")
  while IFS= read -r variable; do
    [ -n "$variable" ] && export "${variable?}"
  done < <("$PY" scripts/uv_sources.py --env <<<"$pip_config")
  INSTALL=("$VENV/bin/uv" pip install --python "$PY" "${uv_sources[@]}")
}
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
installed=0

# The models download while the packages install: the download needs only the standard library
# (sgl_memory.models imports nothing else), the conversion after it needs torch and transformers.
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
downloads=()
logs=$(mktemp -d)
for model in "$@"; do
  PYTHONPATH=$ROOT "$PY" -m sgl_memory.models download "$model" >"$logs/$model.log" 2>&1 &
  downloads+=("$!")
done

stamp_inputs() {
  cat scripts/setup.sh scripts/uv_sources.py scripts/requirements-cpu.txt scripts/constraints-cpu.txt pyproject.toml
}
STAMP=$VENV/.sgl-memory-setup
want=$(stamp_inputs | sha256sum | cut -d' ' -f1)

if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing into $VENV (a few minutes on a fresh machine)"
  installer
  if command -v nvidia-smi >/dev/null 2>&1; then
    # A GPU machine takes SGLang with its CUDA dependencies as published.
    "${INSTALL[@]}" "sglang==$SGLANG_VERSION" -e ".[gpu]"
  else
    # CPU torch first: an unconstrained torch requirement would pull a multi-GB CUDA build.
    "${INSTALL[@]}" "torch==2.13.0"
    "${INSTALL[@]}" --no-deps "sglang==$SGLANG_VERSION"
    "${INSTALL[@]}" -r scripts/requirements-cpu.txt -c scripts/constraints-cpu.txt
    # PyPI's torchvision is a CUDA build; sgl_memory.cpu_compat makes it import beside CPU torch.
    "${INSTALL[@]}" --no-deps "torchvision==0.28.0"
    "${INSTALL[@]}" --no-deps -e .
  fi
  "$PY" -m sgl_memory.cpu_compat >/dev/null
  "$PY" -c "import sglang, sgl_memory.plugin; assert sglang.__version__ == '$SGLANG_VERSION', sglang.__version__"
  echo "$want" > "$STAMP"
  installed=1
  phase_done "packages"
else
  echo "[setup] $VENV is up to date"
fi

DEV_STAMP=$VENV/.sgl-memory-setup-dev
dev_want=$( (echo "$want"; cat scripts/requirements-dev.txt) | sha256sum | cut -d' ' -f1)
if [ "$DEV" = 1 ] && [ "$(cat "$DEV_STAMP" 2>/dev/null)" != "$dev_want" ]; then
  echo "[setup] installing the test and benchmark dependencies"
  installer
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${INSTALL[@]}" -e ".[test,bench]"
  else
    "${INSTALL[@]}" -r scripts/requirements-dev.txt -c scripts/constraints-cpu.txt
  fi
  # The agent harness (bench/agent) imports BFCL's tasks, back-ends and checker. bfcl-eval's own
  # requirements pin numpy 1.x and a dozen API clients it does not need here, so it goes in without
  # them, with the few packages the modules we import use.
  "${INSTALL[@]}" --no-deps "bfcl-eval==2026.3.23" "tenacity==9.2.1" "tree-sitter==0.21.3" \
    "tree-sitter-java==0.21.0" "tree-sitter-javascript==0.21.4"
  echo "$dev_want" > "$DEV_STAMP"
  installed=1
  phase_done "test and benchmark packages"
fi

compiling=""
if [ "$installed" = 1 ]; then
  # a file that does not compile (a vendored test for another Python) is skipped, as pip skips it
  "$PY" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 &
  compiling=$!
fi
i=0
for model in "$@"; do
  if ! wait "${downloads[$i]}"; then
    cat "$logs/$model.log" >&2
    exit 1
  fi
  i=$((i + 1))
  "$PY" -m sgl_memory.models fetch "$model"
  phase_done "model $model (its download ran beside the packages)"
done
if [ -n "$compiling" ]; then
  wait "$compiling" || true
  phase_done "bytecode"
fi
rm -rf "$logs"
