#!/usr/bin/env bash
# bench/cold-start.sh — time from `pull` to a container's first output on a cold node,
# ferry with the configuration it ships next to containerd's ordinary pull and to the
# same command on a local disk, per registry, registry latency and workload:
#
#   (a) containerd: `ctr image pull` + `ctr run` (overlayfs): download and unpack every
#       layer, then start. The pull is made once per registry and latency (it does not
#       depend on the workload) and each workload's run follows it: (a) = pull + run.
#   (b) ferry, empty store, no trace: `ferry pull` + `ctr run --snapshotter ferry`
#   (c) ferry, empty store, with the workload's startup trace published beside the image
#       (recorded by the daemon itself at an earlier, unmeasured start of the workload)
#   (d) ferry, warm store (what (c) left once its prefetch and file cache were done),
#       fresh containerd and daemon
#   (e) the command in a chroot of the image's extracted root filesystem (with /proc and
#       /dev), cold page cache: the floor. Once per workload and round, no registry.
#   (f) ferry, empty store, a new tag: the image with its top (app) layer rebuilt, pushed
#       as v2 to a repository whose v1 has the workload's trace; v2 has none of its own,
#       so the node prefetches with v1's (found by the repository's ferry.trace tag and
#       mapped to v2's files by path). A repository of its own each run.
#
# The daemon's config names only paths: every other setting is the embedded default
# (`ferry daemon --print-config`), background fill included. Each phase gets a fresh
# containerd root and, for ferry, a fresh daemon; (a), (b), (c) and (e) start after
# `sync` and dropping the page cache, (d) after `sync`. A registry "N ms away" is
# `ferry bench proxy --delay Nms` in front of it (both containerd and ferry go through
# it); at 0 ms they talk to the registry directly.
#
# Measured per phase: seconds to first output (the workloads print one line when their
# work is done); bytes over the wire (the proxy's count of bytes sent to the node, where
# a proxy runs) and the daemon's `bytes_fetched`, both at the end of the run and at the
# moment the first line arrived; Range requests (`requests`) and reads that waited for
# the network (`read_waits`), summed over mounts; CPU seconds (utime+stime) of the daemon
# and of the registry from the start of the pull to the first line; the daemon's RSS
# after the run. Raw rows, medians (TSV, JSON), a table with the ratios issue 16 asks for
# and a chart (gnuplot) go to $OUT.
#
#   bench/cold-start.sh [RUNS]        RUNS rounds (default 1); medians are reported
#
# Env (see bench/README.md): IMG, TAG, WORKLOADS, REGISTRIES, LATENCIES, PHASES,
# START_CMD, OUT, CHART_TO, FERRY, RSS_SETTLE (seconds; logs the daemon's RSS that long
# after each run, when the start is over). Needs root, containerd, runc, docker-registry, gnuplot
# (for the chart) and the Debian packages scripts/deps.sh installs.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"
# containerd, ferry daemon and timing helpers shared by the containerd benchmarks
# shellcheck source=bench/lib-containerd.sh
source "$HERE/lib-containerd.sh"

node_fs
RUNS=${1:-1}
if [[ -n ${START_CMD:-} ]]; then
    # one custom workload (scripts/demo): short matrix unless asked for more
    WORKLOADS=custom
    REGISTRIES=${REGISTRIES:-ferry}
    LATENCIES=${LATENCIES:-0}
else
    WORKLOADS=${WORKLOADS:-numpy pandas gcc java}
    REGISTRIES=${REGISTRIES:-ferry docker}
    LATENCIES=${LATENCIES:-0 10 25}
fi
PHASES=${PHASES:-a b c d e f}
TRACE_TYPES=(--referrer-type application/vnd.ferry.index.v1 --referrer-type application/vnd.ferry.trace.v1+json)

workload_cmd() {
    case $1 in
        numpy) echo /app/start.sh ;;   # python3 -c 'import numpy'
        pandas) echo /app/pandas.sh ;; # import pandas, numpy, scipy.linalg
        gcc) echo /app/gcc.sh ;;       # compile and run a small C program
        java) echo /app/java.sh ;;     # java -version
        custom) echo "$START_CMD" ;;
        *) return 1 ;;
    esac
}
for w in $WORKLOADS; do workload_cmd "$w" >/dev/null || e2e_die "unknown workload $w (numpy pandas gcc java)"; done
for r in $REGISTRIES; do [[ $r == ferry || $r == docker ]] || e2e_die "unknown registry $r (ferry docker)"; done
for l in $LATENCIES; do [[ $l =~ ^[0-9]+$ ]] || e2e_die "latency $l is not whole milliseconds"; done
has_phase() { [[ " $PHASES " == *" $1 "* ]]; }

T_START=$(now)
bench_prepare cold-start
: >"$OUT/timeline.log"
RAW=$OUT/raw.tsv
printf 'registry\tlatency_ms\tworkload\tphase\tround\tfirst_s\tpull_s\twire\twire_first\tfetched\tfetched_first\trequests\trequests_first\tread_waits\tread_waits_first\tserved\tcpu_daemon_s\tcpu_registry_s\trss_kib\n' >"$RAW"

# ---------------------------------------------------------------- measuring helpers
CLK_TCK=$(getconf CLK_TCK)
cpu_secs() { # PID -> utime+stime in seconds (0 when there is no such process)
    [[ -n ${1:-} && -r /proc/$1/stat ]] || { echo 0; return; }
    # fields after "PID (comm) ": state=1 … utime=12 stime=13
    sed 's/^.*) //' "/proc/$1/stat" | awk -v t="$CLK_TCK" '{ printf "%.2f", ($12 + $13) / t }'
}
sub() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a - b }'; }
# proxy_down: bytes the proxy has sent towards the node so far ("" when none runs)
proxy_down() { [[ -z $PROXY_PID ]] || jq .down "$PROXY_STATS"; }
# mark WHAT: a line in $OUT/timeline.log (seconds since the bench started), to see where
# a run's wall time goes besides the timed starts
mark() { printf '%s %s %s\n' "$(since "$T_START")" "$(date -u +%T.%3N)" "$*" >>"$OUT/timeline.log"; }
sum_of() { jq "[.mounts[].stats.$2] | add // 0" "$1"; } # STATUS_FILE FIELD
# The image's bytes cold, the node's own programs resident (ferry, ctr, runc, the shim),
# as on a node that has started containers before: dropping their pages too charged a
# cold phase 0.1-0.2 s of loading binaries (ferry 140 MB, ctr 23 MB) that no running
# node pays and that (d), after a sync alone, did not pay.
cold_cache() {
    sync
    echo 3 >/proc/sys/vm/drop_caches
    local p progs=("$FERRY")
    for p in ctr runc containerd-shim-runc-v2; do
        p=$(command -v "$p") && progs+=("$p")
    done
    cat "${progs[@]}" >/dev/null
}

# ON_FIRST_LINE hook: what the node had done when the first line arrived
snapshot_first() {
    if [[ -n $DAEMON_PID ]]; then
        status_json >"$E2E_TMP/first-status.json" 2>/dev/null || echo '{"mounts":[]}' >"$E2E_TMP/first-status.json"
        cpu_secs "$DAEMON_PID" >"$E2E_TMP/first-cpu-daemon"
    fi
    cpu_secs "$PHASE_REG_PID" >"$E2E_TMP/first-cpu-registry"
    proxy_down >"$E2E_TMP/first-wire"
}
ON_FIRST_LINE=snapshot_first

# row REGISTRY LATENCY WORKLOAD PHASE FIRST PULL WIRE WIRE_FIRST FETCHED FETCHED_FIRST
#     REQUESTS REQUESTS_FIRST WAITS WAITS_FIRST SERVED CPU_D CPU_R RSS  (empty = not measured)
row() {
    local IFS=$'\t'
    printf '%s\n' "$1	$2	$3	$4	$ROUND	${*:5}" >>"$RAW"
}

# ---------------------------------------------------------------- registries and image
LAYOUT=$E2E_TMP/layout
clone_layout "$IMG" "$LAYOUT"
"$FERRY" index "oci:$LAYOUT:$TAG" >"$OUT/index.txt"
e2e_log "image $IMG:$TAG: $(tail -1 "$OUT/index.txt")"
IMAGE_BYTES=$(jq '[.layers[].size] | add' "$(manifest_of "$LAYOUT" "$TAG")")

declare -A REG_AT REG_PID_OF TRACE_BYTES TRACE_STATUS
for r in $REGISTRIES; do
    if [[ $r == ferry ]]; then
        : >"$E2E_TMP/reg-ferry.toml"
        start_ferry_registry reg-ferry "$E2E_TMP/reg-ferry.toml" >/dev/null || e2e_die "ferry registry did not start"
    else
        start_docker_registry reg-docker >/dev/null || e2e_die "docker-registry did not start"
    fi
    REG_AT[$r]=$REG_ADDR
    REG_PID_OF[$r]=$REG_PID
done
copy() { "$FERRY" copy --plain-http "$@" >>"$OUT/copy.txt" 2>&1 || { tail -5 "$OUT/copy.txt" >&2; e2e_die "ferry copy $*"; }; }
# (f)'s new version: the top layer rebuilt with /app/version.txt added (a new build of
# the application on the same base layers: a new layer digest, config and manifest)
if has_phase f; then
    python3 "$HERE/oci-layout.py" new-version --layout "$LAYOUT" --tag "$TAG" --new-tag "$TAG-v2" \
        --set app/version.txt=$'2\n'
    "$FERRY" index "oci:$LAYOUT:$TAG-v2" >"$OUT/index-v2.txt"
fi
# bench/plain (never traced: (b)) and one repository per workload (its trace: (c), (d)),
# blobs pushed once per registry and mounted into the other repositories
for r in $REGISTRIES; do
    copy "oci:$LAYOUT:$TAG" "${REG_AT[$r]}/bench/plain:v1"
    for w in $WORKLOADS; do copy "${REG_AT[$r]}/bench/plain:v1" "${REG_AT[$r]}/bench/$w:v1"; done
    if has_phase f; then copy "oci:$LAYOUT:$TAG-v2" "${REG_AT[$r]}/bench/plain:v2"; fi
done
mark "published"
e2e_log "published to $(for r in $REGISTRIES; do printf '%s ' "$r=${REG_AT[$r]}"; done)"

# check_line WORKLOAD: warn when the first line is an error rather than the workload's
# "ready" (java.sh pipes java's stderr, so a failure still prints a line)
check_line() {
    if grep -qiE 'error|cannot|not found' "$E2E_TMP/first-line" || ! grep -q '^ready' "$E2E_TMP/first-line"; then
        e2e_log "warning: $1 printed '$(cat "$E2E_TMP/first-line")', not its ready line"
    fi
}

# Traces: what the daemon records by itself at an image's first start (the shipped
# [trace] auto_record) and publishes for every other node: one unmeasured start of each
# workload's repository through containerd against the first registry ("an earlier
# start elsewhere"), then its trace (the image's referrer) copied to the other
# registries. (c) and (d) are fresh nodes that find it.
trace_manifest() { # HOST REPO -> the repository's ferry.trace manifest
    curl -fsS --noproxy '*' -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
        "http://$1/v2/$2/manifests/ferry.trace"
}
trace_bytes() { # HOST REPO -> bytes the published trace reads
    local blob
    blob=$(trace_manifest "$1" "$2" | jq -r '.layers[0].digest') || return 1
    curl -fsS --noproxy '*' "http://$1/v2/$2/blobs/$blob" | jq '[.reads[].len] | add // 0'
}
if has_phase c || has_phase d || has_phase f; then
    first_reg=${REGISTRIES%% *}
    PHASE_REG_PID=${REG_PID_OF[$first_reg]}
    for w in $WORKLOADS; do
        ref=${REG_AT[$first_reg]}/bench/$w:v1
        mark "trace $w: recording start"
        start_daemon "$E2E_TMP/store-trace"
        fresh_containerd "$E2E_TMP/ferry/run/snapshotter.sock"
        ferry_pull_ctr "$ref"
        CTR_ID=$((CTR_ID + 1))
        T0=$(now)
        first_output ctr_ run --rm --snapshotter ferry "$ref" "bench-$CTR_ID" "$(workload_cmd "$w")"
        check_line "$w"
        TRACE_STATUS[$w]=published
        if ! wait_for 90 "the trace of $w" trace_manifest "${REG_AT[$first_reg]}" "bench/$w" >/dev/null; then
            TRACE_STATUS[$w]=failed # (c) then runs without a trace; the report says so
            e2e_log "warning: no trace of $w was published after its first start"
        fi
        stop_daemon
        rm -rf "$E2E_TMP/store-trace"
        [[ ${TRACE_STATUS[$w]} == published ]] || continue
        TRACE_BYTES[$w]=$(trace_bytes "${REG_AT[$first_reg]}" "bench/$w")
        e2e_log "trace $w: recorded automatically at its first start, ${TRACE_BYTES[$w]} bytes read"
        for r in $REGISTRIES; do
            [[ $r == "$first_reg" ]] && continue
            copy "${TRACE_TYPES[@]}" "$ref" "${REG_AT[$r]}/bench/$w:v1"
            # the repository's newest trace, as the recording node left it on the first
            copy "${REG_AT[$first_reg]}/bench/$w:ferry.trace" "${REG_AT[$r]}/bench/$w:ferry.trace"
        done
    done
    mark "traces recorded"
fi
for w in $WORKLOADS; do
    printf '%s\t%s\t%s\t%s\n' "$w" "$(workload_cmd "$w")" "${TRACE_BYTES[$w]:-}" "${TRACE_STATUS[$w]:-none}"
done >"$OUT/workloads.tsv"


# ---------------------------------------------------------------- phases
# (a) for every workload: one pull, then each workload's run right after it
phase_a() { # REGISTRY LATENCY HOST
    local ref=$3/bench/plain:v1 pull_s cpu0 wire0 w run_s
    mark "$1 $2 (a): start"
    fresh_containerd
    cold_cache
    mark "$1 $2 (a): caches dropped"
    cpu0=$(cpu_secs "$PHASE_REG_PID") wire0=$(proxy_down)
    T0=$(now)
    ctr_ image pull --plain-http "$ref" >/dev/null
    pull_s=$(since "$T0")
    local cpu_r wire
    cpu_r=$(sub "$(cpu_secs "$PHASE_REG_PID")" "$cpu0")
    wire=$([[ -z $PROXY_PID ]] || sub "$(proxy_down)" "$wire0" | cut -d. -f1)
    for w in $WORKLOADS; do
        CTR_ID=$((CTR_ID + 1))
        T0=$(now)
        first_output ctr_ run --rm "$ref" "bench-$CTR_ID" "$(workload_cmd "$w")"
        run_s=$(cat "$E2E_TMP/seconds")
        check_line "$w"
        row "$1" "$2" "$w" a "$(awk -v p="$pull_s" -v r="$run_s" 'BEGIN { printf "%.3f", p + r }')" "$pull_s" \
            "$wire" "$wire" "" "" "" "" "" "" "" "" "$cpu_r" ""
        e2e_log "$1 ${2}ms $w (a): pull ${pull_s}s + run ${run_s}s ($(cat "$E2E_TMP/first-line"))"
    done
}


# (b) (c) (d): a fresh daemon on STORE, fresh containerd, ferry pull + run
phase_ferry() { # REGISTRY LATENCY WORKLOAD PHASE REF STORE
    local cpu_d0 cpu_r0 wire0 pull_s first end=$E2E_TMP/end-status.json
    mark "$1 $2 $3 ($4): start"
    stop_daemon
    mark "$1 $2 $3 ($4): previous daemon stopped"
    start_daemon "$6" "${DAEMON_EXTRA:-}"
    mark "$1 $2 $3 ($4): daemon up"
    fresh_containerd "$E2E_TMP/ferry/run/snapshotter.sock"
    mark "$1 $2 $3 ($4): containerd up"
    if [[ $4 == d ]]; then sync; else cold_cache; fi
    mark "$1 $2 $3 ($4): caches dropped"
    rm -f "$E2E_TMP"/first-*
    cpu_d0=$(cpu_secs "$DAEMON_PID") cpu_r0=$(cpu_secs "$PHASE_REG_PID") wire0=$(proxy_down)
    local perf_pids=()
    if [[ -n ${PERF:-} ]]; then # whole-machine profile and FUSE requests of the phase
        mkdir -p "$OUT/perf"
        local base=$OUT/perf/$1-$2ms-$3-$4
        if [[ $PERF != fuse ]]; then
            perf record -q -e cpu-clock -F 997 -g -a -o "$base.data" >/dev/null 2>&1 &
            perf_pids+=($!)
        fi
        perf record -q -e fuse:fuse_request_send -e fuse:fuse_request_end -c 1 -a -o "$base.fuse.data" >/dev/null 2>&1 &
        perf_pids+=($!)
        sleep 0.5
    fi
    mark "$1 $2 $3 ($4): pull"
    T0=$(now)
    ferry_pull_ctr "$5"
    pull_s=$(since "$T0")
    mark "$1 $2 $3 ($4): pulled, run"
    CTR_ID=$((CTR_ID + 1))
    first_output ctr_ run --rm --snapshotter ferry "$5" "bench-$CTR_ID" "$(workload_cmd "$3")"
    for p in "${perf_pids[@]}"; do kill -INT "$p" 2>/dev/null || true; wait "$p" || true; done
    mark "$1 $2 $3 ($4): run done"
    check_line "$3"
    # the node's own account of the phase, for where its time went
    mkdir -p "$OUT/logs"
    cp "$E2E_TMP/ferry/daemon.log" "$OUT/logs/$1-$2ms-$3-$4.daemon.log" 2>/dev/null || true
    cp "$E2E_TMP/pull.log" "$OUT/logs/$1-$2ms-$3-$4.pull.log" 2>/dev/null || true
    status_json >"$end"
    first=$E2E_TMP/first-status.json
    cp "$first" "$OUT/logs/$1-$2ms-$3-$4.status-first.json" 2>/dev/null || true
    cp "$end" "$OUT/logs/$1-$2ms-$3-$4.status-end.json" 2>/dev/null || true
    local wire="" wire_first=""
    if [[ -n $PROXY_PID ]]; then
        wire=$(sub "$(proxy_down)" "$wire0" | cut -d. -f1)
        wire_first=$(sub "$(cat "$E2E_TMP/first-wire")" "$wire0" | cut -d. -f1)
    fi
    row "$1" "$2" "$3" "$4" "$(cat "$E2E_TMP/seconds")" "$pull_s" "$wire" "$wire_first" \
        "$(sum_of "$end" bytes_fetched)" "$(sum_of "$first" bytes_fetched)" \
        "$(sum_of "$end" requests)" "$(sum_of "$first" requests)" \
        "$(sum_of "$end" read_waits)" "$(sum_of "$first" read_waits)" "$(sum_of "$end" bytes_served)" \
        "$(sub "$(cat "$E2E_TMP/first-cpu-daemon")" "$cpu_d0")" \
        "$(sub "$(cat "$E2E_TMP/first-cpu-registry")" "$cpu_r0")" \
        "$(mem_of "$DAEMON_PID" | cut -d' ' -f1)"
    e2e_log "$1 ${2}ms $3 ($4): first output after $(cat "$E2E_TMP/seconds") s, $(sum_of "$first" bytes_fetched) B fetched by then ($(cat "$E2E_TMP/first-line"))"
    if [[ ${RSS_SETTLE:-0} != 0 ]]; then # the daemon's resident size once the start is over
        sleep "$RSS_SETTLE"
        e2e_log "$1 ${2}ms $3 ($4): daemon RSS ${RSS_SETTLE} s after the run: $(($(mem_of "$DAEMON_PID" | cut -d' ' -f1) / 1024)) MB ($(awk '/^(Anonymous|Rss):/ {printf "%s %d MB ", $1, $2/1024}' "/proc/$DAEMON_PID/smaps_rollup"))"
    fi
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

# (e) the floor: the image extracted once (whiteouts applied) and kept for later runs in
# $ROOTFS_CACHE/<manifest digest>, with /proc and a /dev of its own mounted inside for
# the run (a tmpfs with the usual nodes, not a bind of the host's /dev)
ROOTFS=${ROOTFS_CACHE:-$BENCH_ROOT/bench/out/rootfs}/$(basename "$(manifest_of "$IMG" "$TAG")")
if has_phase e; then
    if [[ ! -f $ROOTFS.done ]]; then
        e2e_log "extracting $IMG:$TAG to $ROOTFS for the chroot phase"
        rm -rf "$ROOTFS"
        oci_extract "$IMG" "$TAG" "$ROOTFS" --xattrs
        touch "$ROOTFS.done"
        mark "extracted"
    fi
    mkdir -p "$ROOTFS/proc" "$ROOTFS/dev" "$ROOTFS/tmp"
    mount -t proc proc "$ROOTFS/proc"
    e2e_defer "umount $ROOTFS/proc"
    mount -t tmpfs -o mode=755,size=1m devfs "$ROOTFS/dev"
    e2e_defer "umount $ROOTFS/dev"
    for node in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
        IFS=: read -r name major minor <<<"$node"
        mknod -m 666 "$ROOTFS/dev/$name" c "$major" "$minor"
    done
    ln -s /proc/self/fd "$ROOTFS/dev/fd"
fi
phase_e() { # WORKLOAD
    cold_cache
    T0=$(now)
    first_output chroot "$ROOTFS" /usr/bin/env -i HOME=/root \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$(workload_cmd "$1")"
    check_line "$1"
    row - - "$1" e "$(cat "$E2E_TMP/seconds")" "" "" "" "" "" "" "" "" "" "" "" "" ""
    e2e_log "$1 (e) chroot: first output after $(cat "$E2E_TMP/seconds") s ($(cat "$E2E_TMP/first-line"))"
}

# new_tag_repo REGISTRY WORKLOAD -> a repository no start has used, holding v1 with its
# trace, the ferry.trace tag that points at it, and v2 (the new version, no trace)
new_tag_repo() {
    local at=${REG_AT[$1]} repo
    NEW_N=$((${NEW_N:-0} + 1))
    repo=bench/$2-new-$NEW_N
    copy "${TRACE_TYPES[@]}" "$at/bench/$2:v1" "$at/$repo:v1"
    copy "$at/bench/$2:ferry.trace" "$at/$repo:ferry.trace"
    copy "$at/bench/plain:v2" "$at/$repo:v2"
    echo "$repo"
}

T_BENCH=$SECONDS
for ROUND in $(seq "$RUNS"); do
    e2e_log "round $ROUND/$RUNS"
    PHASE_REG_PID=
    if has_phase e; then for w in $WORKLOADS; do phase_e "$w"; done; fi
    for r in $REGISTRIES; do
        PHASE_REG_PID=${REG_PID_OF[$r]}
        for l in $LATENCIES; do
            host=${REG_AT[$r]}
            if ((l > 0)); then
                start_proxy "$host" "$l"
                host=$PROXY_ADDR
            fi
            if has_phase a; then phase_a "$r" "$l" "$host"; fi
            for w in $WORKLOADS; do
                rm -rf "$E2E_TMP/store-b" "$E2E_TMP/store-c"
                if has_phase b; then
                    # A repository of its own, never started before: the daemon records a
                    # trace at every first start and shares it (as the image's referrer
                    # and by the repository's ferry.trace tag), so a repository (b) used
                    # once has a trace for every later start.
                    PLAIN_N=$((${PLAIN_N:-0} + 1))
                    copy "${REG_AT[$r]}/bench/plain:v1" "${REG_AT[$r]}/bench/plain-$PLAIN_N:v1"
                    phase_ferry "$r" "$l" "$w" b "$host/bench/plain-$PLAIN_N:v1" "$E2E_TMP/store-b"
                fi
                if has_phase c || has_phase d; then
                    phase_ferry "$r" "$l" "$w" c "$host/bench/$w:v1" "$E2E_TMP/store-c"
                    if has_phase d; then
                        mark "$r $l $w: waiting for prefetch"
                        wait_prefetch # the warm store holds what the trace names and what (c) read
                        phase_ferry "$r" "$l" "$w" d "$host/bench/$w:v1" "$E2E_TMP/store-c"
                    fi
                fi
                if has_phase f && [[ ${TRACE_STATUS[$w]:-} == published ]]; then
                    rm -rf "$E2E_TMP/store-f"
                    repo=$(new_tag_repo "$r" "$w")
                    phase_ferry "$r" "$l" "$w" f "$host/$repo:v2" "$E2E_TMP/store-f"
                    rm -rf "$E2E_TMP/store-f"
                fi
                stop_daemon
            done
            stop_proxy
        done
    done
done
stop_containerd >/dev/null 2>&1 || true
e2e_log "measured in $((SECONDS - T_BENCH)) s"

# ---------------------------------------------------------------- report
python3 "$HERE/cold-start-report.py" --raw "$RAW" --workloads "$OUT/workloads.tsv" --out "$OUT" \
    --image "$IMG:$TAG" --image-bytes "$IMAGE_BYTES" --runs "$RUNS"
cat "$OUT/result.txt"
if command -v gnuplot >/dev/null; then
    gnuplot "$OUT/chart.gp" && e2e_log "chart: $OUT/cold-start.png"
    if [[ -n ${CHART_TO:-} ]]; then
        mkdir -p "$(dirname "$CHART_TO")"
        cp "$OUT/cold-start.png" "$CHART_TO" && e2e_log "chart copied to $CHART_TO"
    fi
else
    e2e_log "gnuplot not installed (scripts/deps.sh): no chart"
fi
