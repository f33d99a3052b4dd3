#!/usr/bin/env bash
# Makes the `debian:bookworm-slim` base image that deploy/Dockerfile starts from, without a registry:
# a debootstrap minbase root from this machine's own Debian mirror, imported into podman.
#
#   tests/tools/container-base.sh            # the image exists afterwards (a no-op when it already does)
#
# The root is cached as a tarball under ${DILOCOD_CACHE:-$XDG_CACHE_HOME/dilocod} (default
# ~/.cache/dilocod), named after the suite and a hash of the mirror, so later runs only import it
# (seconds) instead of running debootstrap again (about a minute). A different mirror makes a new
# base; delete the directory to force a fresh one. A debian:bookworm-slim image this script did not
# make (one pulled from a registry) is used as it is and never replaced.
#
# Needs debootstrap (run as root, or through sudo), podman, tar and flock. CONTAINERS_CONF, if set, is passed on to
# podman like any other variable.
set -euo pipefail

SUITE=bookworm
IMAGE="debian:${SUITE}-slim"
LABEL=org.dilocod.base

die() { echo "container-base: $*" >&2; exit 1; }

# The mirror apt uses here for $SUITE, from one-line .list files or deb822 .sources files; it is the
# only Debian archive this machine may reach.
mirror_for() {
    local suite=$1 f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] || continue
        # deb [options] URI suite components...
        awk -v s="$suite" '$1 == "deb" { sub(/^deb[ \t]+(\[[^]]*\][ \t]+)?/, "")
                                         if ($2 == s) { print $1; exit } }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] || continue
        # one stanza per paragraph; Enabled: no stanzas are skipped
        awk -v s="$suite" 'BEGIN { RS = ""; FS = "\n" }
            { uri = ""; ok = 0; deb = 0; on = 1
              for (i = 1; i <= NF; i++) {
                  if ($i ~ /^#/) continue
                  split($i, kv, /:[ \t]*/); k = tolower(kv[1]); v = substr($i, length(kv[1]) + 2)
                  gsub(/^[ \t]+|[ \t]+$/, "", v)
                  if (k == "types" && v ~ /(^| )deb( |$)/) deb = 1
                  if (k == "uris") { split(v, u, /[ \t]+/); uri = u[1] }
                  if (k == "suites" && (" " v " ") ~ (" " s " ")) ok = 1
                  if (k == "enabled" && v == "no") on = 0
              }
              if (deb && ok && on && uri != "") { print uri; exit } }' "$f"
    done
}

MIRROR=$(mirror_for "$SUITE" | head -n1)
[ -n "$MIRROR" ] || die "no apt source for '$SUITE' in /etc/apt/sources.list*: cannot make the base image"
UPDATES=$(mirror_for "$SUITE-updates" | head -n1)
SECURITY=$(mirror_for "$SUITE-security" | head -n1)

KEY="$SUITE-minbase-$(printf '%s\n%s\n%s\n' "$MIRROR" "$UPDATES" "$SECURITY" | sha256sum | cut -c1-12)"
CACHE="${DILOCOD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dilocod}"
TARBALL="$CACHE/$KEY.tar"

mkdir -p "$CACHE"
# One maker at a time (make check and its sanitizer run may both get here): the others wait, then
# find the image or the tarball made.
exec 9> "$CACHE/.container-base.lock"
flock 9 || die "cannot lock $CACHE/.container-base.lock"

# Already there? Ours with the same key, or someone else's: either way nothing to do.
if podman image exists "$IMAGE"; then
    have=$(podman image inspect --format "{{ index .Labels \"$LABEL\" }}" "$IMAGE")
    if [ "$have" = "$KEY" ]; then echo "container-base: $IMAGE present ($KEY)"; exit 0; fi
    if [ -z "$have" ] || [ "$have" = "<no value>" ]; then
        echo "container-base: $IMAGE present (not made here), used as it is"; exit 0
    fi
    echo "container-base: $IMAGE is an older base ($have), replacing it with $KEY"
fi

if [ ! -s "$TARBALL" ]; then
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    # debootstrap makes device nodes and root-owned files: root, or sudo as `make deps` uses it
    SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
    root=$(mktemp -d "$CACHE/root.XXXXXX")
    # shellcheck disable=SC2064  # expand $root now: it is the directory to remove
    trap "$SUDO rm -rf '$root' '$root.tar' '$root.log'" EXIT
    echo "container-base: debootstrap --variant=minbase $SUITE from $MIRROR (once; cached as $TARBALL)"
    start=$SECONDS
    $SUDO debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" > "$root.log" 2>&1 \
        || { tail -n 20 "$root.log" >&2; die "debootstrap failed (log above)"; }

    # apt inside the image must reach the same mirror the same way apt does here: the same sources
    # (with the updates and security suites when this machine has them) and the Acquire options the
    # mirror needs (a snapshot mirror's Release files are past Valid-Until; a proxy).
    {
        echo "deb $MIRROR $SUITE main"
        [ -z "$UPDATES" ] || echo "deb $UPDATES $SUITE-updates main"
        [ -z "$SECURITY" ] || echo "deb $SECURITY $SUITE-security main"
    } | $SUDO tee "$root/etc/apt/sources.list" > /dev/null
    apt-config dump | { grep -E '^Acquire::(Check-Valid-Until|Check-Date|https?::Proxy) ' || true; } \
        | $SUDO tee "$root/etc/apt/apt.conf.d/99mirror" > /dev/null
    # what the official slim images drop as well: the package cache and the lists
    $SUDO sh -c "rm -rf '$root'/var/cache/apt/archives/*.deb '$root'/var/lib/apt/lists/*"

    # written beside the final name and renamed: a tarball in the cache is always complete
    $SUDO tar --numeric-owner --xattrs -C "$root" -cf "$root.tar" . || die "tar of the base root failed"
    $SUDO chown "$(id -u):$(id -g)" "$root.tar"
    mv "$root.tar" "$TARBALL"
    echo "container-base: debootstrap and tarball took $((SECONDS - start)) s"
fi

podman import --quiet --change "LABEL $LABEL=$KEY" --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $SUITE $MIRROR" "$TARBALL" "$IMAGE" > /dev/null \
    || die "podman import of $TARBALL failed"
echo "container-base: imported $IMAGE ($KEY)"
