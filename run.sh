#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv on first use (CPU torch first, then the project with
# what every preset, `oakemu tune` and `oakemu export` need: the `presets`, `tune` and `export` extras), then
# runs `oakemu ARGS...`; `./run.sh test` adds the test tools (the `dev` extra) on its first use and runs the
# test suite. An install runs again after pyproject.toml or this file changes. OAKEMU_INSTALL_DRY_RUN=1 prints
# the install commands due instead, and exits.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${OAKEMU_VENV:-.venv}"
TORCH_REQUIREMENT="${OAKEMU_TORCH:-torch==2.13.0}"   # any torch>=2.2 works
# On PyPI, Linux torch wheels are CUDA builds (GBs). For the CPU build from PyTorch's own index, set
# OAKEMU_TORCH_INDEX=https://download.pytorch.org/whl/cpu (machines with a local CPU wheel need nothing).
TORCH_INDEX_ARGS=()
if [ -n "${OAKEMU_TORCH_INDEX:-}" ]; then TORCH_INDEX_ARGS=(--index-url "$OAKEMU_TORCH_INDEX"); fi
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)

install() {  # run an install step, or only print it (OAKEMU_INSTALL_DRY_RUN=1)
  if [ -n "${OAKEMU_INSTALL_DRY_RUN:-}" ]; then echo "$*"; else "$@"; fi
}
due() {  # true when the install that wrote marker $1 has to run (never ran, or pyproject.toml or run.sh is newer)
  [ ! -e "$VENV/$1" ] || [ pyproject.toml -nt "$VENV/$1" ] || [ run.sh -nt "$VENV/$1" ]
}

if [ ! -x "$VENV/bin/oakemu" ] || due .oakemu-installed; then
  echo "run.sh: installing OakEmu-RL and what its presets, studies and exports need into $VENV ..." >&2
  python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "OakEmu-RL needs Python 3.11 or newer")'
  if [ ! -x "$VENV/bin/python" ]; then install python3 -m venv "$VENV"; fi
  install "${PIP[@]}" "${TORCH_INDEX_ARGS[@]}" "$TORCH_REQUIREMENT"
  install "${PIP[@]}" -e ".[presets,tune,export]"
  install touch "$VENV/.oakemu-installed"
fi
if [ "${1:-}" = "test" ] && due .oakemu-test-installed; then
  echo "run.sh: installing the test tools into $VENV (first test run) ..." >&2
  install "${PIP[@]}" -e ".[dev]"
  install touch "$VENV/.oakemu-test-installed"
fi
if [ -n "${OAKEMU_INSTALL_DRY_RUN:-}" ]; then exit 0; fi

# shellcheck disable=SC1091
. "$VENV/bin/activate"
if [ "${1:-}" = "test" ]; then
  shift
  # One worker per CPU, each test file on one worker (module fixtures such as the Docker image are built once).
  exec python -m pytest -n auto --dist loadfile "$@"
fi
exec oakemu "$@"
