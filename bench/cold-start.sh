#!/usr/bin/env bash
# bench/cold-start.sh — time from `pull` to a container's first output, cold node, in one
# run, ferry next to containerd's ordinary pull:
#
#   (a) containerd: `ctr image pull` + `ctr run` (overlayfs): download and unpack every
#       layer, then start — the traditional path and the peer
#   (b) ferry, empty chunk store, no trace:  `ferry pull` + `ctr run --snapshotter ferry`
#   (c) ferry, empty chunk store, with the startup trace published next to the image
#   (d) ferry, warm chunk store (what (c) left), fresh containerd and daemon
#
# Each phase gets a fresh containerd root (no content, no snapshots) and, for ferry, a
# fresh daemon; (b) and (c) also an empty store. Background fill is off in (b)/(c) so the
# bytes fetched are what the start needed. Printed per phase: seconds to first output,
# compressed bytes fetched, uncompressed bytes the container read through FUSE (files the
# file cache holds whole are read by the kernel by passthrough and not seen), and the
# daemon's RSS; then the ratios the issues ask for (fetched/read against what the command
# reads: all of it crosses FUSE in (b), where nothing is cached).
#
#   bench/cold-start.sh [RUNS]        RUNS rounds (default 1); medians are reported
#
# Env: IMG (OCI layout, default bench/out/image from bench/make-image.sh), TAG,
# START_CMD (default /app/start.sh), OUT (results dir, default bench/out/cold-start).
# Needs root, containerd, runc, and the Debian packages scripts/deps.sh installs.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"
# containerd, ferry daemon and timing helpers shared by the containerd benchmarks
# shellcheck source=bench/lib-containerd.sh
source "$HERE/lib-containerd.sh"

RUNS=${1:-1}
bench_setup cold-start # publishes REF (gets a trace: phases c, d) and REF_PLAIN (never traced: b)

# Before each timed phase: write back what earlier phases left dirty ((a) unpacks 1.2 GB,
# and removing a containerd root is not free either), so no phase pays for another's I/O.
quiesce() { sync; }

run_containerd() {
    fresh_containerd
    quiesce
    T0=$(now)
    ctr_ image pull --plain-http "$REF" >/dev/null
    since "$T0" >"$E2E_TMP/pull-seconds"
    CTR_ID=$((CTR_ID + 1))
    first_output ctr_ run --rm "$REF" "bench-$CTR_ID" "$START_CMD"
}
run_ferry() { # REF STORE PREFETCH
    local ref=$1
    shift
    start_daemon "$1" "$2"
    fresh_containerd "$E2E_TMP/ferry/run/snapshotter.sock"
    quiesce
    T0=$(now)
    ferry_pull_ctr "$ref"
    since "$T0" >"$E2E_TMP/pull-seconds"
    CTR_ID=$((CTR_ID + 1))
    first_output ctr_ run --rm --snapshotter ferry "$ref" "bench-$CTR_ID" "$START_CMD"
}

# ---------------------------------------------------------------- phases
declare -A T P FETCHED SERVED RSS
record() { # PHASE (after a run: reads $E2E_TMP/seconds)
    local secs
    secs=$(cat "$E2E_TMP/seconds")
    T[$1]+="$secs "
    P[$1]+="$(cat "$E2E_TMP/pull-seconds") "
    if [[ $1 != a ]]; then
        FETCHED[$1]=$(status_sum bytes_fetched)
        SERVED[$1]=$(status_sum bytes_served)
        RSS[$1]=$(mem_of "$DAEMON_PID" | cut -d' ' -f1)
        # where the RSS sits (anon vs file, threads), for tuning
        cat "/proc/$DAEMON_PID/status" "/proc/$DAEMON_PID/smaps_rollup" >"$OUT/daemon-mem-$1.txt" 2>/dev/null || true
    fi
    e2e_log "phase $1: first output after $secs s ($(cat "$E2E_TMP/first-line"))"
}

# (c) leaves a warm node: prefetch done and the file cache's deferred materializations
# (it waits for the start's reads to pause) written
wait_prefetch() { # at most 120 s
    local i
    for i in $(seq 600); do
        [[ $(status_json | jq '([.mounts[].stats.prefetch_done] | all) and ((.file_cache.pending // 0) == 0)') == true ]] && return 0
        sleep 0.2
    done
    e2e_log "prefetch or file cache not done after 120 s"
}

# Record the startup trace once (its own store and mount) and publish it next to REF.
"$FERRY" trace record --store "$E2E_TMP/store-trace" --publish --plain-http "$REF" -- "$START_CMD" \
    >"$OUT/trace.txt" 2>&1 || { cat "$OUT/trace.txt" >&2; e2e_die "ferry trace record failed"; }
rm -rf "$E2E_TMP/store-trace"
e2e_log "trace: $(tail -1 "$OUT/trace.txt")"

for round in $(seq "$RUNS"); do
    e2e_log "round $round/$RUNS"
    run_containerd && record a
    rm -rf "$E2E_TMP/store-b" "$E2E_TMP/store-c"
    run_ferry "$REF_PLAIN" "$E2E_TMP/store-b" false && record b
    run_ferry "$REF" "$E2E_TMP/store-c" true && record c
    wait_prefetch # the warm store holds what the trace names and what (c) read
    run_ferry "$REF" "$E2E_TMP/store-c" true && record d
done
# The daemon's memory once the start is over: the inflated-span cache ([fuse]
# inflated_cache) gives its memory back within two 5 s ticks of the last read.
sleep 11
RSS_IDLE=$(mem_of "$DAEMON_PID" | cut -d' ' -f1)
stop_daemon
stop_containerd >/dev/null 2>&1 || true

# ---------------------------------------------------------------- report
med() { tr ' ' '\n' <<<"$1" | grep . | median; }
ta=$(med "${T[a]}"); tb=$(med "${T[b]}"); tc=$(med "${T[c]}"); td=$(med "${T[d]}")
row() { printf '%-44s %8s %8s %12s %12s %9s\n' "$@"; }
{
    echo "cold start, $REF ($(du -sh --apparent-size "$IMG/blobs" | cut -f1) layout), command $START_CMD, $RUNS round(s), medians"
    row phase "first" "pull" "fetched" "read(FUSE)" "RSS"
    row "(a) ctr image pull + ctr run (overlayfs)" "$ta" "$(med "${P[a]}")" - - -
    row "(b) ferry, empty store, no trace" "$tb" "$(med "${P[b]}")" "${FETCHED[b]}" "${SERVED[b]}" "${RSS[b]}K"
    row "(c) ferry, empty store, trace" "$tc" "$(med "${P[c]}")" "${FETCHED[c]}" "${SERVED[c]}" "${RSS[c]}K"
    row "(d) ferry, warm store" "$td" "$(med "${P[d]}")" "${FETCHED[d]}" "${SERVED[d]}" "${RSS[d]}K"
    echo "first = seconds from the start of the pull to the container's first output line; pull = the pull alone"
    echo "a/b = $(ratio "$ta" "$tb")x (goal >= 10)   c/d = $(ratio "$tc" "$td") (goal <= 1.5)"
    # What the command reads: in (b) nothing is cached, so every read crosses FUSE; in (c)
    # and (d) files cached whole are read by the kernel (passthrough), unseen by FUSE.
    echo "fetched/read: b $(ratio "${FETCHED[b]}" "${SERVED[b]}") (goal <= 2)   c $(ratio "${FETCHED[c]}" "${SERVED[b]}") (goal <= 1.3)   (read = ${SERVED[b]} bytes the command reads, all through FUSE in (b))"
    echo "daemon RSS 11 s after the last start (d), five layers still mounted: ${RSS_IDLE}K"
} | tee "$OUT/result.txt"
