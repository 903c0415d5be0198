# bench/lib-containerd.sh — helpers for benchmarks that start containers through
# containerd: fresh containerd roots, a ferry daemon serving the snapshotter, timing to
# first output. Source after bench/lib.sh.
# shellcheck shell=bash
# containerd helpers (start_containerd_with_snapshotter, ctr_, stop_containerd…)
# shellcheck source=tests/e2e/lib.sh
source "$BENCH_ROOT/tests/e2e/lib.sh"

# first_output CMD...: runs CMD; writes the seconds from T0 to its first output line to
# $E2E_TMP/seconds (and the line to $E2E_TMP/first-line). When ON_FIRST_LINE names a
# function, it runs the moment the line arrives (after the time is taken), in a subshell:
# it must leave what it measures in files.
first_output() {
    local line
    rm -f "$E2E_TMP/seconds" "$E2E_TMP/first-line"
    "$@" 2>"$E2E_TMP/run.err" | {
        if IFS= read -r line; then
            since "$T0" >"$E2E_TMP/seconds"
            [[ -z ${ON_FIRST_LINE:-} ]] || "$ON_FIRST_LINE"
            echo "$line" >"$E2E_TMP/first-line"
            cat >/dev/null
        fi
    }
    [[ -s $E2E_TMP/seconds ]] || { cat "$E2E_TMP/run.err" >&2; e2e_die "the container printed nothing"; }
}

CTR_ID=0
fresh_containerd() { # [SNAPSHOTTER_SOCKET]
    stop_containerd >/dev/null 2>&1 || true
    rm -rf "$E2E_TMP/containerd"
    if [[ -n ${1:-} ]]; then
        start_containerd_with_snapshotter ferry "$1" >/dev/null 2>&1
    else
        start_containerd >/dev/null 2>&1
    fi
}

DAEMON_PID=
stop_daemon() {
    [[ -n $DAEMON_PID ]] || return 0
    local killer holder
    kill "$DAEMON_PID" 2>/dev/null || true
    # bounded: SIGKILL after 30 s
    { sleep 30; kill -9 "$DAEMON_PID" 2>/dev/null; } &
    killer=$!
    wait "$DAEMON_PID" 2>/dev/null || true
    kill "$killer" 2>/dev/null || true
    DAEMON_PID=
    # The daemon leaves its snapshotter mounts to its fd holder (`ferry daemon
    # --fd-holder SOCK`, its own session) for a restarted daemon; unmounting them while
    # it keeps their connections alive blocks for umount's timeout per layer. Ending
    # this daemon's holder (found by its socket under our temp dir) aborts them at once.
    for holder in $(pgrep -f -- "--fd-holder $E2E_TMP/ferry/run/fdstore.sock" || true); do
        kill "$holder" 2>/dev/null || true
    done
    e2e_umount_under "$E2E_TMP/ferry" 2>/dev/null || true
}
# start_daemon STORE_DIR [EXTRA_TOML]: a fresh `ferry daemon` whose config names only
# paths (store, control socket, snapshotter socket and root; the fd holder's socket
# defaults to beside the control socket): every other setting is the embedded default,
# as a node gets it (`ferry daemon --print-config`). EXTRA_TOML (whole sections) is for
# benchmarks that measure something other than the shipped configuration.
start_daemon() {
    stop_daemon
    rm -rf "$E2E_TMP/ferry/snapshotter" "$E2E_TMP/ferry/run"
    mkdir -p "$E2E_TMP/ferry/run" "$1"
    cat >"$E2E_TMP/ferry/daemon.toml" <<EOF
[store]
path = "$1"

[control]
socket = "$E2E_TMP/ferry/run/daemon.sock"

[snapshotter]
enabled = true
socket = "$E2E_TMP/ferry/run/snapshotter.sock"
root = "$E2E_TMP/ferry/snapshotter"
${2:-}
EOF
    "$FERRY" daemon --config "$E2E_TMP/ferry/daemon.toml" >"$E2E_TMP/ferry/daemon.log" 2>&1 &
    DAEMON_PID=$!
    E2E_PIDS+=("$DAEMON_PID") # stopped by the exit trap too, should the run die
    wait_for 30 "ferry daemon" test -S "$E2E_TMP/ferry/run/snapshotter.sock" ||
        { tail -20 "$E2E_TMP/ferry/daemon.log" >&2; e2e_die "ferry daemon did not start"; }
}
status_json() { "$FERRY" status --json --socket "$E2E_TMP/ferry/run/daemon.sock"; }
# sum of a StatsSnapshot field over every mount the daemon serves
status_sum() { status_json | jq "[.mounts[].stats.$1] | add // 0"; }

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# pNN PERCENT: the PERCENT-th percentile of the numbers on stdin (nearest rank)
pct() { sort -g | awk -v p="$1" '{ v[NR] = $1 } END { i = int((p / 100) * NR + 0.999); if (i < 1) i = 1; if (i > NR) i = NR; print v[i] }'; }

# publish_bench_image: $IMG:$TAG, indexed by ferry, into a fresh ferry registry twice:
# REF (for runs that get a startup trace) and REF_PLAIN (never traced). Sets REG too.
publish_bench_image() {
    : >"$E2E_TMP/reg.toml"
    start_ferry_registry reg "$E2E_TMP/reg.toml" >/dev/null || e2e_die "ferry registry did not start"
    REG=$REG_ADDR
    REF=$REG/bench/app:v1
    REF_PLAIN=$REG/bench/plain:v1
    local layout=$E2E_TMP/layout
    clone_layout "$IMG" "$layout"
    "$FERRY" index "oci:$layout:$TAG" >"$OUT/index.txt"
    "$FERRY" copy --plain-http "oci:$layout:$TAG" "$REF" >"$OUT/copy.txt" 2>&1
    "$FERRY" copy --plain-http "oci:$layout:$TAG" "$REF_PLAIN" >>"$OUT/copy.txt" 2>&1
    e2e_log "image $REF: $(tail -1 "$OUT/index.txt")"
}

# bench_prepare NAME: what every containerd benchmark does first: OUT (default
# bench/out/NAME, created); loopback only, root, the ferry binary and the bench image
# ($IMG) checked or built, and the temp dir
bench_prepare() {
    OUT=${OUT:-$BENCH_ROOT/bench/out/$1}
    mkdir -p "$OUT"
    loopback_only
    need_root "containerd, FUSE"
    ensure_ferry
    ensure_image
    e2e_init
}
# bench_setup NAME: bench_prepare, START_CMD (default /app/start.sh), and the image
# published to a fresh ferry registry (publish_bench_image: REG, REF, REF_PLAIN)
bench_setup() {
    START_CMD=${START_CMD:-/app/start.sh}
    bench_prepare "$1"
    publish_bench_image
}

# ferry_pull_ctr REF: `ferry pull` REF into the running containerd through the daemon's
# snapshotter (start_daemon, fresh_containerd SOCKET first); dies on failure
ferry_pull_ctr() {
    "$FERRY" pull --plain-http --address "$CONTAINERD_SOCK" --namespace "$CTR_NAMESPACE" \
        --snapshotter-root "$E2E_TMP/ferry/snapshotter" "$1" >"$E2E_TMP/pull.log" 2>&1 ||
        { cat "$E2E_TMP/pull.log" >&2; e2e_die "ferry pull failed"; }
}

# ---- the latency proxy (`ferry bench proxy`), one at a time
PROXY_PID='' PROXY_STATS=''
start_proxy() { # UPSTREAM DELAY_MS: sets PROXY_ADDR, PROXY_PID, PROXY_STATS (its counters)
    PROXY_ADDR=127.0.0.1:$(free_port)
    PROXY_STATS=$E2E_TMP/proxy-stats.json
    rm -f "$PROXY_STATS"
    "$FERRY" bench proxy --listen "$PROXY_ADDR" --upstream "$1" --delay "${2}ms" \
        --stats "$PROXY_STATS" >>"$OUT/proxy.log" 2>&1 &
    PROXY_PID=$!
    E2E_PIDS+=("$PROXY_PID")
    wait_for 10 "proxy stats" test -s "$PROXY_STATS" || e2e_die "ferry bench proxy did not start (log $OUT/proxy.log)"
}
stop_proxy() {
    [[ -n $PROXY_PID ]] || return 0
    kill "$PROXY_PID" 2>/dev/null || true
    wait "$PROXY_PID" 2>/dev/null || true
    PROXY_PID=
}
