#!/usr/bin/env bash
# tests/e2e/docker_registry_ranges.sh — a lazy read asks Debian's docker-registry
# (distribution 2.8, what most users run) for several ranges of a layer in ONE request,
# and gets them right.
#
#   bash tests/e2e/docker_registry_ranges.sh
#
# Why: distribution spends about as much CPU on a request as on megabytes of transfer
# (docs/benchmarks.md), so the device batches the runs of spans a read needs that lie
# apart (local spans between them) into one `Range: bytes=a-b,c-d` request, parsed from a
# multipart/byteranges answer. The benches measured it against docker-registry; this
# checks it in CI against the real thing.
#
# Setup: the small image indexed with 64 KiB spans, copied to a docker-registry; two node
# daemons in turn on one store, each `ferry mount`ing the image through its control
# socket (prefetch and background fill off, so every request comes from a read).
# 1. Daemon 1 with readahead, whole-file and nearby guesses off reads 4 KiB in the middle
#    of /bin/busybox (1.9 MB): only the spans of that read become local.
# 2. Daemon 2 (the shipped guesses) reads the whole file: its first read takes the file
#    whole, the spans on both sides of the local ones, in one request with several ranges
#    (its debug line "backend request … ranges=N", N >= 2); the client never fell back to
#    one range per request; the file's bytes equal the image's; docker-registry logged no
#    error serving a blob.
# 3. Daemon 3 (a store of its own, no guesses, one request in flight per image, so that
#    every read is a fetch of its own spans) reaches docker-registry through `ferry bench
#    proxy --delay 50ms`; 12 processes read 12 different places of the image at once.
#    While the first request is out, the other reads queue, and the next request to
#    their layer takes them along: the mount's `requests_joined` counts them, the lead's
#    debug line says `riders=N`, fewer requests went out than reads waited, and every
#    process got the image's bytes.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), OUT,
#      FERRY_TIMEOUT (seconds per ferry call, 120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

mount_prologue docker-registry dd

IMG=$E2E_TMP/img
indexed_small "$IMG"
reference_tree "$IMG"
start_docker_registry dreg
DREG_LOG=$REG_LOG
IMAGE=$REG_ADDR/e2e/small:v1
fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy "oci:$IMG:small" "$IMAGE"
[[ $RC == 0 ]] || { show "$E2E_TMP/cp.err"; e2e_die "ferry copy to $IMAGE failed"; }

SOCK=$E2E_TMP/run/daemon.sock
# node_daemon N FETCH_TOML: daemon N on the shared store (or $STORE_DIR), logging ferry_fs at debug to
# $E2E_TMP/daemon-N.log; sets DAEMON_PID
node_daemon() {
    local n=$1 fetch=$2 cfg=$E2E_TMP/daemon-$1.toml
    cat >"$cfg" <<EOF
[store]
path = "${STORE_DIR:-$E2E_TMP/store}"
$fetch
[warm]
prefetch = false
background_fill = false

[control]
socket = "$SOCK"

[snapshotter]
enabled = false

[registry]
config_path = ""
EOF
    "$FERRY" --log "info,ferry_fs=debug,ferry_registry_client=info" daemon --config "$cfg" \
        >"$E2E_TMP/daemon-$n.log" 2>&1 &
    DAEMON_PID=$!
    E2E_PIDS+=("$DAEMON_PID")
    wait_for 30 "daemon $n" test -S "$SOCK" || {
        show "$E2E_TMP/daemon-$n.log"
        e2e_die "daemon $n did not start"
    }
}
stop_daemon() {
    timeout 60 "$FERRY" umount --socket "$SOCK" "$1" >/dev/null 2>&1 || umount -l "$1" 2>/dev/null || true
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    wait_for 30 "daemon stopped" bash -c "! kill -0 $DAEMON_PID" || kill -KILL "$DAEMON_PID" 2>/dev/null || true
    rm -f "$SOCK"
}
# backend_requests LOG: the daemon's "backend request" lines, one "ranges windows" pair each
backend_requests() {
    sed 's/\x1b\[[0-9;]*m//g' "$1" | grep 'backend request' |
        sed -E 's/.* ranges=([0-9]+) windows=([a-z]+).*/\1 \2/' || true
}

# ---------------------------------------------------------------- 1. a read in the middle
echo "# 1. daemon 1, no guesses: 4 KiB in the middle of /bin/busybox"
node_daemon 1 $'[fetch]\nreadahead = "0"\nwhole_file = "0"\nnearby = "0"'
M1=$E2E_TMP/m1
mkdir -p "$M1"
fy "$E2E_TMP/m1.out" "$E2E_TMP/m1.err" mount --socket "$SOCK" "$IMAGE" "$M1"
[[ $RC == 0 ]] || { show "$E2E_TMP/m1.err"; e2e_die "mount through daemon 1 failed"; }
if timeout 60 dd if="$M1/bin/busybox" of="$E2E_TMP/middle" bs=4096 skip=240 count=1 2>/dev/null &&
    cmp -s "$E2E_TMP/middle" <(dd if="$REF/bin/busybox" bs=4096 skip=240 count=1 2>/dev/null); then
    pass "daemon 1 read 4 KiB at 960 KiB of busybox, the image's bytes"
else
    fail "daemon 1: the read in the middle of busybox failed or differs"
fi
stop_daemon "$M1"
read1=$(backend_requests "$E2E_TMP/daemon-1.log" | grep -c ' false$' || true)
if ((read1 >= 1)); then
    pass "daemon 1 fetched that read's spans ($read1 span request(s))"
else
    fail "daemon 1 made no span request (log $E2E_TMP/daemon-1.log)"
fi

# ---------------------------------------------------------------- 2. the whole file
echo "# 2. daemon 2, shipped guesses: the whole file, the local spans in the middle"
node_daemon 2 ""
M2=$E2E_TMP/m2
mkdir -p "$M2"
fy "$E2E_TMP/m2.out" "$E2E_TMP/m2.err" mount --socket "$SOCK" "$IMAGE" "$M2"
[[ $RC == 0 ]] || { show "$E2E_TMP/m2.err"; e2e_die "mount through daemon 2 failed"; }
if timeout 60 cmp -s "$M2/bin/busybox" "$REF/bin/busybox"; then
    pass "daemon 2 read busybox whole: the image's bytes"
else
    fail "daemon 2: busybox differs from the image's"
fi
stop_daemon "$M2"
backend_requests "$E2E_TMP/daemon-2.log" >"$E2E_TMP/requests-2"
batched=$(awk '$2 == "false" && $1 >= 2' "$E2E_TMP/requests-2" | wc -l)
if ((batched >= 1)); then
    pass "daemon 2 asked docker-registry for several ranges in one request ($batched such request(s); ranges per span request: $(awk '$2 == "false" {print $1}' "$E2E_TMP/requests-2" | paste -sd' '))"
else
    fail "daemon 2 made no request with several ranges ($(wc -l <"$E2E_TMP/requests-2") requests)"
    show "$E2E_TMP/daemon-2.log" 20
fi
if grep -q "does not answer several ranges" "$E2E_TMP/daemon-2.log"; then
    fail "the client fell back to one range per request: docker-registry's answer was not multipart"
else
    pass "docker-registry answered the ranges as multipart/byteranges (no fallback to one range per request)"
fi
# (its 404s for blobs and referrer tags not pushed yet are logged at level=error too)
if grep -E 'level=(error|panic)' "$DREG_LOG" | grep 'method=GET' | grep -q '/blobs/'; then
    fail "docker-registry logged an error serving a blob"
    grep -E 'level=(error|panic)' "$DREG_LOG" | grep '/blobs/' | show /dev/stdin
elif grep -q 'panic' "$DREG_LOG"; then
    fail "docker-registry panicked"
else
    pass "docker-registry served every blob request without an error"
fi

# ---------------------------------------------------------------- 3. joined requests
echo "# 3. daemon 3, own store, no guesses, one request at a time, docker-registry 50 ms away: 12 reads at once"
PROXY_PORT=$(free_port)
"$FERRY" bench proxy --listen "127.0.0.1:$PROXY_PORT" --upstream "$REG_ADDR" --delay 50ms \
    >"$E2E_TMP/proxy.log" 2>&1 &
E2E_PIDS+=("$!")
wait_for 10 "latency proxy" bash -c "exec 3<>/dev/tcp/127.0.0.1/$PROXY_PORT" ||
    e2e_die "ferry bench proxy did not listen on 127.0.0.1:$PROXY_PORT"
STORE_DIR=$E2E_TMP/store-3 node_daemon 3 $'[fetch]\nconcurrency = 1\nreadahead = "0"\nwhole_file = "0"\nnearby = "0"'
M3=$E2E_TMP/m3
mkdir -p "$M3"
fy "$E2E_TMP/m3.out" "$E2E_TMP/m3.err" mount --socket "$SOCK" "127.0.0.1:$PROXY_PORT/e2e/small:v1" "$M3"
[[ $RC == 0 ]] || { show "$E2E_TMP/m3.err"; e2e_die "mount through daemon 3 (via the proxy) failed"; }
# 12 reads of 4 KiB, each somewhere else: numbers.txt and busybox at spread offsets
# (64 KiB spans: each its own span) and the small files of both layers
reads=()
for k in 0 3 6 9 12 15; do reads+=("data/sub/dir/numbers.txt $((k * 16))"); done
for k in 20 120 220 320; do reads+=("bin/busybox $k"); done
reads+=("etc/motd 0" "app/hello.txt 0")
pids=()
for i in "${!reads[@]}"; do
    read -r f blk <<<"${reads[$i]}"
    timeout 60 dd if="$M3/$f" of="$E2E_TMP/part-$i" bs=4096 skip="$blk" count=1 2>/dev/null &
    pids+=("$!")
done
bad=0
for i in "${!reads[@]}"; do
    read -r f blk <<<"${reads[$i]}"
    wait "${pids[$i]}" || bad=$((bad + 1))
    cmp -s "$E2E_TMP/part-$i" <(dd if="$REF/$f" bs=4096 skip="$blk" count=1 2>/dev/null) || bad=$((bad + 1))
done
if ((bad == 0)); then
    pass "daemon 3: 12 reads at once through the proxy, each the image's bytes"
else
    fail "daemon 3: $bad of the 12 concurrent reads failed or differ"
fi
fy "$E2E_TMP/status-3.json" "$E2E_TMP/status-3.err" status --json --socket "$SOCK"
joined=$(jq '[.mounts[].stats.requests_joined] | add // 0' "$E2E_TMP/status-3.json" 2>/dev/null || echo 0)
requests=$(jq '[.mounts[].stats.requests] | add // 0' "$E2E_TMP/status-3.json" 2>/dev/null || echo 0)
waits=$(jq '[.mounts[].stats.read_waits] | add // 0' "$E2E_TMP/status-3.json" 2>/dev/null || echo 0)
stop_daemon "$M3"
riders=$(sed 's/\x1b\[[0-9;]*m//g' "$E2E_TMP/daemon-3.log" | grep 'backend request' |
    grep -E 'joined=false riders=[1-9]' | sed -E 's/.* riders=([0-9]+).*/\1/' | paste -sd' ' || true)
if ((joined >= 1)) && [[ -n $riders ]]; then
    pass "daemon 3: $joined fetches rode along in another's request (riders per joined request: $riders; $requests requests for $waits reads that waited)"
else
    fail "daemon 3: no fetch was joined (requests_joined=$joined, requests=$requests, read_waits=$waits, joined lines: '${riders}')"
    show "$E2E_TMP/daemon-3.log" 20
fi
if ((requests >= 1 && requests < waits)); then
    pass "daemon 3: fewer requests ($requests) than reads that waited for one ($waits)"
else
    fail "daemon 3: $requests requests for $waits reads that waited"
fi

e2e_summary
