#!/usr/bin/env bash
# bench/many-containers.sh — N containers of one image started at once on one node
# (default 50): total wall time and p50/p99 seconds to each container's first output,
# ferry's lazy snapshotter next to containerd's overlayfs, in one run.
#
# The image is pulled first on each side (`ctr image pull` / `ferry pull`, timed apart),
# so this measures starting containers, not downloading: with ferry the first readers
# fetch from the registry and the rest share those fetches and the chunk store.
#
#   bench/many-containers.sh [N]
#
# Env: IMG, TAG, START_CMD, OUT as for bench/cold-start.sh. Needs root.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"
# shellcheck source=bench/lib-containerd.sh
source "$HERE/lib-containerd.sh"

N=${1:-50}
bench_setup many-containers

# start_all SIDE SNAPSHOTTER_ARGS...: N `ctr run --rm` at once; per-container seconds to
# first output in $E2E_TMP/SIDE.times, wall time to the last exit in $E2E_TMP/SIDE.wall
start_all() {
    local side=$1 i pids=()
    shift
    : >"$E2E_TMP/$side.times"
    T0=$(now)
    for i in $(seq "$N"); do
        (
            ctr_ run --rm "$@" "$REF" "$side-$i" "$START_CMD" 2>"$E2E_TMP/$side-$i.err" | {
                if IFS= read -r _; then echo "$(since "$T0")" >>"$E2E_TMP/$side.times"; cat >/dev/null; fi
            }
        ) &
        pids+=($!)
    done
    # only these: a bare `wait` would also wait for containerd and the registry
    wait "${pids[@]}" || true
    since "$T0" >"$E2E_TMP/$side.wall"
    local got
    got=$(wc -l <"$E2E_TMP/$side.times")
    [[ $got == "$N" ]] || e2e_log "$side: only $got of $N containers printed (see $E2E_TMP/$side-*.err)"
}

fresh_containerd
T0=$(now)
ctr_ image pull --plain-http "$REF" >/dev/null
pull_overlay=$(since "$T0")
start_all overlay

start_daemon "$E2E_TMP/store" "$(printf '[warm]\nprefetch = true\nbackground_fill = false')"
fresh_containerd "$E2E_TMP/ferry/run/snapshotter.sock"
T0=$(now)
ferry_pull_ctr "$REF"
pull_ferry=$(since "$T0")
start_all ferry --snapshotter ferry
rss=$(mem_of "$DAEMON_PID" | cut -d' ' -f2)
stop_daemon
stop_containerd >/dev/null 2>&1 || true

{
    echo "$N containers of $REF at once, command $START_CMD"
    printf '%-28s %8s %10s %8s %8s %8s\n' side pull "wall(all)" p50 p99 started
    for side in overlay ferry; do
        pull=$pull_overlay
        [[ $side == ferry ]] && pull=$pull_ferry
        printf '%-28s %8s %10s %8s %8s %8s\n' "$side" "$pull" "$(cat "$E2E_TMP/$side.wall")" \
            "$(pct 50 <"$E2E_TMP/$side.times")" "$(pct 99 <"$E2E_TMP/$side.times")" "$(wc -l <"$E2E_TMP/$side.times")/$N"
    done
    echo "wall overlay/ferry = $(ratio "$(cat "$E2E_TMP/overlay.wall")" "$(cat "$E2E_TMP/ferry.wall")")x; ferry daemon peak RSS ${rss} KiB"
} | tee "$OUT/result.txt"
