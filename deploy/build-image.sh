#!/usr/bin/env bash
# Build the OakEmu-RL image on a machine with no container registry (air-gapped clusters, CI).
#
#   deploy/build-image.sh                          # oakemu-rl:latest on a debootstrap'd Debian base
#   deploy/build-image.sh --tag oakemu-rl:v1 --torch-wheel /path/torch-2.13.0+cpu-cp311-*.whl
#   deploy/build-image.sh --base python:3.11-slim  # where a registry exists (same as `docker compose build`)
#
# Steps:
#   1. base image: --base IMAGE if given; else `oakemu-base:bookworm`, made once with `debootstrap`
#      (Debian bookworm, python3 + venv) and `docker import`; the root file system is cached as a tarball
#      in $OAKEMU_IMAGE_CACHE (default ~/.cache/oakemu-rl) so later builds, and a restarted engine,
#      skip debootstrap.
#   2. a temporary build context: the project's sources, deploy/Dockerfile, and a wheelhouse with the
#      local CPU torch wheel (--torch-wheel, else found in pip's find-links folders when one is there)
#      and the machine's CA bundle (--ca-bundle, else the one `pip config` names, else $PIP_CERT,
#      $REQUESTS_CA_BUNDLE, $SSL_CERT_FILE), used by pip in the build stage only.
#   3. `docker build` (classic builder or BuildKit, whichever the engine offers); the final stage copies
#      only the virtual environment, so the CA bundle and the wheels never reach the image.
#
# Environment: OAKEMU_IMAGE_CACHE, DEBIAN_MIRROR (default http://deb.debian.org/debian), DEBIAN_SUITE
# (default bookworm), TORCH_VERSION (default 2.13.0), TORCH_INDEX_URL (used when no torch wheel is given).
set -euo pipefail

usage() {
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
  echo "options: --tag TAG  --base IMAGE  --torch-wheel FILE  --ca-bundle FILE  --no-ca-bundle  --rebuild-base  --quiet"
}

die() { echo "build-image.sh: error: $*" >&2; exit 1; }
say() { echo "build-image.sh: $*" >&2; }

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TAG="oakemu-rl:latest"
BASE=""
TORCH_WHEEL=""
CA_BUNDLE=""
USE_CA=1
REBUILD_BASE=0
QUIET=()
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE_DIR="${OAKEMU_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/oakemu-rl}"
DEFAULT_BASE="oakemu-base:$SUITE"

while [ $# -gt 0 ]; do
  case "$1" in
    --tag) TAG="${2:?--tag needs a value}"; shift 2 ;;
    --base) BASE="${2:?--base needs a value}"; shift 2 ;;
    --torch-wheel) TORCH_WHEEL="${2:?--torch-wheel needs a file}"; shift 2 ;;
    --ca-bundle) CA_BUNDLE="${2:?--ca-bundle needs a file}"; shift 2 ;;
    --no-ca-bundle) USE_CA=0; shift ;;
    --rebuild-base) REBUILD_BASE=1; shift ;;
    --quiet) QUIET=(--quiet); shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown option $1" ;;
  esac
done

command -v docker >/dev/null || die "the docker client is not installed"
docker info >/dev/null 2>&1 || die "no Docker engine answers (is dockerd running, and may this user use it?)"

# --- 1. base image ----------------------------------------------------------------------------------
make_debian_base() {
  local tarball="$CACHE_DIR/$SUITE-python3-rootfs.tar"
  if [ "$REBUILD_BASE" = 1 ]; then rm -f "$tarball"; fi
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap), or pass --base IMAGE"
    [ "$(id -u)" = 0 ] || die "debootstrap needs root to make the base image (or pass --base IMAGE)"
    mkdir -p "$CACHE_DIR"
    local rootfs
    rootfs="$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$rootfs'" RETURN
    say "debootstrap $SUITE (python3, venv) from $MIRROR: about 2 minutes, once"
    debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 \
      || { tail -20 "$rootfs.log" >&2; die "debootstrap failed (log above)"; }
    rm -f "$rootfs.log"
    # Smaller: no package caches, lists, documentation or locales in the base.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
      "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
    tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
  fi
  say "docker import $tarball as $DEFAULT_BASE"
  docker import --change 'CMD ["/bin/bash"]' "$tarball" "$DEFAULT_BASE" >/dev/null
}

if [ -z "$BASE" ]; then
  BASE="$DEFAULT_BASE"
  if [ "$REBUILD_BASE" = 1 ] || ! docker image inspect "$BASE" >/dev/null 2>&1; then
    make_debian_base
  fi
fi

# --- 2. build context ---------------------------------------------------------------------------------
find_torch_wheel() {
  # pip's find-links folders (pip config and $PIP_FIND_LINKS), then none: pip reads the index instead.
  local links dir
  links="$( (python3 -m pip config list 2>/dev/null || true) | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p")"
  for dir in ${PIP_FIND_LINKS:-} $links; do
    dir="${dir#file://}"
    [ -d "$dir" ] || continue
    ls "$dir"/torch-"$TORCH_VERSION"[+-]*cp311*manylinux*x86_64.whl 2>/dev/null | head -1
  done | head -1
}

find_ca_bundle() {
  local cert
  cert="$( (python3 -m pip config list 2>/dev/null || true) | sed -n "s/^global\.cert='\(.*\)'$/\1/p" | head -1)"
  for candidate in "$cert" "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}"; do
    if [ -n "$candidate" ] && [ -f "$candidate" ]; then echo "$candidate"; return; fi
  done
}

if [ -z "$TORCH_WHEEL" ]; then TORCH_WHEEL="$(find_torch_wheel || true)"; fi
if [ -n "$TORCH_WHEEL" ] && [ ! -f "$TORCH_WHEEL" ]; then die "--torch-wheel $TORCH_WHEEL: no such file"; fi
if [ "$USE_CA" = 1 ] && [ -z "$CA_BUNDLE" ]; then CA_BUNDLE="$(find_ca_bundle || true)"; fi
if [ -n "$CA_BUNDLE" ] && [ ! -f "$CA_BUNDLE" ]; then die "--ca-bundle $CA_BUNDLE: no such file"; fi

CONTEXT="$(mktemp -d "${TMPDIR:-/tmp}/oakemu-build.XXXXXX")"
trap 'rm -rf "$CONTEXT"' EXIT   # the context holds the CA bundle copy: never leave it behind
mkdir -p "$CONTEXT/deploy/wheelhouse"
cp "$REPO_ROOT/pyproject.toml" "$REPO_ROOT/README.md" "$CONTEXT/"
cp "$REPO_ROOT/deploy/Dockerfile" "$CONTEXT/deploy/"
# Only the packages (no caches): the same allow-list as .dockerignore.
tar -C "$REPO_ROOT" --exclude='__pycache__' --exclude='*.py[cod]' -cf - oakemu_core services | tar -C "$CONTEXT" -xf -
if [ -n "$TORCH_WHEEL" ]; then
  # A hard link when on the same file system (no copy of ~200 MB), else a copy.
  ln "$TORCH_WHEEL" "$CONTEXT/deploy/wheelhouse/" 2>/dev/null || cp "$TORCH_WHEEL" "$CONTEXT/deploy/wheelhouse/"
  say "torch from $TORCH_WHEEL"
else
  say "torch $TORCH_VERSION from $TORCH_INDEX_URL (no local wheel; --torch-wheel FILE gives one)"
fi
if [ -n "$CA_BUNDLE" ]; then
  cp "$CA_BUNDLE" "$CONTEXT/deploy/wheelhouse/ca-bundle.crt"
  say "CA bundle $CA_BUNDLE for pip in the build stage (not copied into the image)"
fi

# --- 3. build -----------------------------------------------------------------------------------------
say "docker build $TAG FROM $BASE"
docker build "${QUIET[@]}" --force-rm -t "$TAG" -f "$CONTEXT/deploy/Dockerfile" \
  --build-arg BASE_IMAGE="$BASE" \
  --build-arg TORCH_VERSION="$TORCH_VERSION" \
  --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" \
  "$CONTEXT" >&2
say "built $TAG ($(docker image inspect --format '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
