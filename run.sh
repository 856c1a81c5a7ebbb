#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv on first use (CPU torch first, then the
# project with its test extras), then runs `oakemu ARGS...` or, for `./run.sh test`, the test suite.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${OAKEMU_VENV:-.venv}"
TORCH_REQUIREMENT="${OAKEMU_TORCH:-torch==2.13.0}"   # any torch>=2.2 works
# On PyPI, Linux torch wheels are CUDA builds (GBs). For the CPU build from PyTorch's own index, set
# OAKEMU_TORCH_INDEX=https://download.pytorch.org/whl/cpu (machines with a local CPU wheel need nothing).
TORCH_INDEX_ARGS=()
if [ -n "${OAKEMU_TORCH_INDEX:-}" ]; then TORCH_INDEX_ARGS=(--index-url "$OAKEMU_TORCH_INDEX"); fi

if [ ! -x "$VENV/bin/oakemu" ] || [ pyproject.toml -nt "$VENV/.oakemu-installed" ]; then
  echo "run.sh: installing into $VENV (first use) ..." >&2
  python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "OakEmu-RL needs Python 3.11 or newer")'
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "${TORCH_INDEX_ARGS[@]}" "$TORCH_REQUIREMENT"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[dev]"
  touch "$VENV/.oakemu-installed"
fi

# shellcheck disable=SC1091
. "$VENV/bin/activate"
if [ "${1:-}" = "test" ]; then
  shift
  exec python -m pytest "$@"
fi
exec oakemu "$@"
