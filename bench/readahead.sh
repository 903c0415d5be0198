#!/usr/bin/env bash
# bench/readahead.sh — what readahead along a layer's stream and nearby-file fetches at a
# miss do to a cold start with no trace: the same command through a daemon's lazy mount
# of the bench image, one run per readahead setting, nearby setting and registry
# latency, fresh daemon and store and cold page cache each. Prints seconds to first output, bytes fetched, bytes the command read (through
# FUSE), Range requests and reads that waited for the registry (the critical path).
#
#   bench/readahead.sh                       READAHEADS="0 1M 2M 4M" LATENCIES="0 10"
#   READAHEADS=2M NEARBY="off on" bench/readahead.sh
#
# Env: IMG, TAG (the bench image), CMD (default: the pandas + numpy + scipy import),
# READAHEADS ([fetch] readahead values), NEARBY (on: the shipped [fetch] whole_file and
# nearby; off: both 0; default on), LATENCIES (one-way ms, `ferry bench proxy`).
# Debian's docker-registry serves the image (with its ferry index) on loopback.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"
# shellcheck source=tests/e2e/lib.sh
source "$BENCH_ROOT/tests/e2e/lib.sh"
READAHEADS=${READAHEADS:-0 1M 2M 4M}
NEARBY=${NEARBY:-on}
LATENCIES=${LATENCIES:-0 10}
DEFAULT_CMD="python3 -c 'import pandas, numpy, scipy.linalg; print(\"ready\")'"
CMD=${CMD:-$DEFAULT_CMD}
loopback_only
node_fs
need_root "FUSE mounts, chroot"
[[ -x ${FERRY:-} ]] || ensure_ferry
ensure_image
e2e_init
layout=$E2E_TMP/layout
clone_layout "$IMG" "$layout"
"$FERRY" index "oci:$layout:$TAG" >/dev/null
start_docker_registry reg >/dev/null
"$FERRY" copy --plain-http "oci:$layout:$TAG" "$REG_ADDR/bench/app:v1" >/dev/null
W=$E2E_TMP/ra
printf '%-8s %-6s %-7s %8s %12s %12s %9s %7s %12s\n' readahead nearby latency first fetched read requests waits nearby_bytes
for l in $LATENCIES; do
    host=$REG_ADDR proxy=
    if ((l > 0)); then
        port=$(free_port)
        "$FERRY" bench proxy --listen "127.0.0.1:$port" --upstream "$REG_ADDR" --delay "${l}ms" >/dev/null 2>&1 &
        proxy=$!
        E2E_PIDS+=("$proxy")
        host=127.0.0.1:$port
        wait_for 10 proxy curl -fsS --noproxy '*' "http://$host/v2/" >/dev/null
    fi
    for ra in $READAHEADS; do for nb in $NEARBY; do
        rm -rf "$W"
        mkdir -p "$W/mnt" "$W/store" "$W/run"
        off=
        [[ $nb == on ]] || off=$'whole_file = "0"\nnearby = "0"\n'
        printf '[store]\npath = "%s"\n[control]\nsocket = "%s"\n[fetch]\nreadahead = "%s"\n%s[snapshotter]\nenabled = false\n' \
            "$W/store" "$W/run/daemon.sock" "$ra" "$off" >"$W/daemon.toml"
        "$FERRY" daemon --config "$W/daemon.toml" >"$W/daemon.log" 2>&1 &
        daemon=$!
        E2E_PIDS+=("$daemon")
        wait_for 30 daemon test -S "$W/run/daemon.sock"
        sync
        echo 3 >/proc/sys/vm/drop_caches
        t0=$(now)
        "$FERRY" mount --socket "$W/run/daemon.sock" "$host/bench/app:v1" "$W/mnt"
        # the command prints its one line when done: its end is the first output
        chroot "$W/mnt" sh -c "$CMD" >"$W/cmd.out" 2>&1 || { cat "$W/cmd.out" >&2; e2e_die "the command failed"; }
        secs=$(since "$t0")
        "$FERRY" status --json --socket "$W/run/daemon.sock" | jq -r --arg ra "$ra" --arg nb "$nb" --arg l "${l}ms" --arg s "$secs" \
            '[$ra, $nb, $l, $s] + ([.mounts[].stats] | [(map(.bytes_fetched) | add), (map(.bytes_served) | add), (map(.requests) | add), (map(.read_waits) | add), (map(.bytes_nearby // 0) | add)] | map(tostring)) | @tsv' |
            awk -F'\t' '{ printf "%-8s %-6s %-7s %8s %12s %12s %9s %7s %12s\n", $1, $2, $3, $4, $5, $6, $7, $8, $9 }'
        umount -l "$W/mnt" || true
        kill "$daemon"
        wait "$daemon" 2>/dev/null || true
        e2e_umount_under "$W" >/dev/null 2>&1 || true
    done; done
    [[ -z $proxy ]] || { kill "$proxy"; wait "$proxy" 2>/dev/null || true; }
done
