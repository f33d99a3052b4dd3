#!/bin/bash
# make lint-layers: server/'s include rules (server/README.md, "Layers").
#   core  the round, intake, store, seen, history, stats: knows only common/ and core/
#   net   the HTTP engine and libcurl on libuv: knows common/, core/ and net/
#   hub   the transports: knows common/, core/, net/ and hub/
#   api   the HTTP routes, and server/ itself (daemon, config, main): may know everything
# A lower layer that includes a higher one fails the build with the file, line and header.
# The layers point one way: the daemon (server/daemon*.c, daemon*.h) includes nothing of api/ either:
# main wires api/ to it through daemon.h's daemon_front, an interface the daemon owns.  No exception
# (DAEMON_API_EXCEPTIONS stays empty: a file listed there may include api/).
# Headers private to the files that own the state they declare:
#   daemon_internal.h  the daemon's state (struct dilocod): the daemon's files only (api/ sees it
#                      through daemon.h's accessors and status providers)
#   daemon_parts.h     the calls between the daemon's files: those files only
#   config_internal.h  the options' table types and the calls between config.c, config_check.c and
#                      config_print.c: those files only
# and three of the layers' private to the files of one component:
#   http_internal.h    net/: the server and connection structs, the calls between http.c, http_out.c, http_parse.c
#   intake_internal.h  core/: the calls between intake.c, intake_set.c, intake_cache.c
#   upload_internal.h  api/: the upload object, a staged set, the calls between upload.c and upload_set.c
set -u
cd "$(dirname "$0")/../.."

allowed() {     # layer of the includer -> layers it may include
    case "$1" in
    core) echo "common core" ;;
    net)  echo "common core net" ;;
    hub)  echo "common core net hub" ;;
    *)    echo "common core net hub api top" ;;
    esac
}

layer_of_header() {     # a quoted include's name -> the layer its file lives in ("" if not ours)
    local h=$1
    if [ -e "common/$h" ]; then echo common; return; fi
    for l in core net hub api; do
        if [ -e "server/$l/$h" ]; then echo "$l"; return; fi
    done
    if [ -e "server/$h" ]; then echo top; return; fi
    echo ""
}

private_to() {  # a header private to some files of server/ -> the patterns of the files that may include it
    case "$1" in
    daemon_internal.h) echo "server/daemon*" ;;
    daemon_parts.h)    echo "server/daemon*" ;;
    config_internal.h) echo "server/config*.c" ;;
    http_internal.h)   echo "server/net/http*.c" ;;
    intake_internal.h) echo "server/core/intake*.c" ;;
    upload_internal.h) echo "server/api/upload*.c" ;;
    hub_hf_internal.h) echo "server/hub/hub_hf.c server/hub/hub_hf_publish.c" ;;
    hub_file_internal.h) echo "server/hub/hub_file.c server/hub/hub_file_global.c server/hub/hub_file_publish.c server/hub/hub_file_downlink.c" ;;
    hub_s3_internal.h) echo "server/hub/hub_s3.c server/hub/hub_s3_list.c server/hub/hub_s3_publish.c" ;;
    s3_cluster_internal.h) echo "server/hub/s3_cluster.c server/hub/s3_cluster_bucket.c server/hub/s3_cluster_shard.c server/hub/s3_cluster_refusal.c server/hub/s3_cluster_history.c server/hub/s3_cluster_bootstrap.c" ;;
    *)                 echo "" ;;
    esac
}

may_include_private() {     # file, header: 0 when the header is not private or the file is one of its owners
    local pats pat
    pats=$(private_to "$2")
    [ -z "$pats" ] && return 0
    for pat in $pats; do
        # shellcheck disable=SC2053  # pat is a glob on purpose
        [[ "$1" == $pat ]] && return 0
    done
    return 1
}

DAEMON_API_EXCEPTIONS=""

daemon_may_include() {    # file, layer of the header: 1 when a daemon file includes api/
    case "$1" in
    server/daemon*) ;;
    *) return 0 ;;
    esac
    [ "$2" != api ] && return 0
    [[ " $DAEMON_API_EXCEPTIONS " == *" $1 "* ]] && return 0
    return 1
}

bad=0
checked=0
for f in server/*.[ch] server/*/*.[ch]; do
    dir=${f#server/}
    case "$dir" in */*) layer=${dir%%/*} ;; *) layer=top ;; esac
    ok=" $(allowed "$layer") "
    while IFS=: read -r line inc; do
        name=$(sed -E 's/.*#[[:space:]]*include[[:space:]]*"([^"]+)".*/\1/' <<<"$inc")
        hl=$(layer_of_header "$name")
        checked=$((checked + 1))
        if [ -z "$hl" ]; then
            echo "$f:$line: includes \"$name\", which is not a header of common/ or server/" >&2
            bad=1
        elif [[ "$ok" != *" $hl "* ]]; then
            echo "$f:$line: the $layer layer includes \"$name\" of the $hl layer (allowed: $(allowed "$layer"))" >&2
            bad=1
        elif ! daemon_may_include "$f" "$hl"; then
            echo "$f:$line: the daemon includes \"$name\" of api/: it asks through daemon.h's daemon_front, which main wires" >&2
            bad=1
        elif ! may_include_private "$f" "$name"; then
            echo "$f:$line: includes \"$name\", which only $(private_to "$name") may include" >&2
            bad=1
        fi
    done < <(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f")
done
# One mode flag: the daemon's files ask daemon__async(d) (daemon_internal.h), never the copies the modules
# it configures keep (round's, the pass's Delayed Nesterov parameters) nor the config field by hand.
while IFS= read -r hit; do
    echo "$hit: reads the async mode by hand: ask daemon__async(d) (daemon_internal.h)" >&2
    bad=1
done < <(grep -nE '(cfg->async|rnd\.async|agg\.dn\.on)\b' server/daemon*.c)
if [ "$bad" != 0 ]; then
    echo "lint-layers: FAILED (see server/README.md, Layers)" >&2
    exit 1
fi
echo "lint-layers: $checked includes checked, every layer includes only what it may, the private headers only their own files, the async mode asked one way"
