#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv on first use (CPU torch first, then the
# project with its test extras), then runs `oakemu ARGS...` or, for `./run.sh test`, the test suite.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${OAKEMU_VENV:-.venv}"
TORCH_REQUIREMENT="${OAKEMU_TORCH:-torch==2.13.0}"   # CPU wheel; any torch>=2.2 works

if [ ! -x "$VENV/bin/oakemu" ] || [ pyproject.toml -nt "$VENV/.oakemu-installed" ]; then
  echo "run.sh: installing into $VENV (first use) ..." >&2
  python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "OakEmu-RL needs Python 3.11 or newer")'
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "$TORCH_REQUIREMENT"
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
