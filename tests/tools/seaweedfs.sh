#!/bin/bash
# SeaweedFS, the real S3 server the s3:// tests run against: built once from the Go module proxy and
# cached outside the repository, keyed by version.  A no-op when the binary is cached.
#   tests/tools/seaweedfs.sh          builds if needed, prints the binary's path
# SeaweedFS has replace directives in its go.mod, so `go install module@version` refuses it: the module
# is downloaded into the module cache and `go build ./weed` runs inside that copy.  A fresh machine
# spends about 7 minutes and 2 GB of modules on it.
set -euo pipefail

SEAWEEDFS_MODULE=github.com/seaweedfs/seaweedfs
SEAWEEDFS_VERSION=${SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}
CACHE_ROOT=${DILOCOD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dilocod}
DEST_DIR=$CACHE_ROOT/seaweedfs-$SEAWEEDFS_VERSION
WEED=$DEST_DIR/weed

if [ -x "$WEED" ]; then
    echo "$WEED"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    for g in /usr/local/go/bin/go /usr/lib/go/bin/go; do
        if [ -x "$g" ]; then PATH=$(dirname "$g"):$PATH; break; fi
    done
fi
command -v go >/dev/null 2>&1 || { echo "seaweedfs.sh: no Go toolchain (go) found" >&2; exit 1; }

echo "seaweedfs.sh: building SeaweedFS $SEAWEEDFS_VERSION (once; cached in $DEST_DIR)" >&2
# Outside any module, so `go mod download` fetches exactly this version and prints where it put it.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
json=$(GOFLAGS=-mod=mod go mod download -json "$SEAWEEDFS_MODULE@$SEAWEEDFS_VERSION")
src=$(printf '%s\n' "$json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p' | head -n 1)
if [ -z "$src" ] || [ ! -d "$src/weed" ]; then
    echo "seaweedfs.sh: module download gave no source directory:" >&2
    printf '%s\n' "$json" >&2
    exit 1
fi

mkdir -p "$DEST_DIR"
# Built to a temporary name and renamed: an interrupted build never leaves a binary that looks cached.
(cd "$src" && GOFLAGS=-buildvcs=false go build -o "$DEST_DIR/weed.tmp.$$" ./weed)
"$DEST_DIR/weed.tmp.$$" version >/dev/null
mv -f "$DEST_DIR/weed.tmp.$$" "$WEED"
echo "$WEED"
