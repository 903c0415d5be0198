#!/usr/bin/env bash
# tests/e2e/daemon.sh — the node daemon: one process owns the chunk store and every
# lazy mount; `ferry mount` / `ferry umount` / `ferry status` talk to it over its
# control socket.
#
#   bash tests/e2e/daemon.sh
#
# Setup: a copy of the small image (bench/make-image.sh --small), indexed with
# `ferry index --min-layer-size 0 --span 65536`, pushed with `ferry copy` to a
# `ferry registry serve` on loopback; the reference tree is oci_extract of the original.
# The daemon runs with a temp store, control socket, metrics port and the snapshotter
# on a temp socket/root; prefetch and background fill are off so the counters show
# exactly what reads fetched.
#
# 1. `ferry daemon --print-config` shows the effective config; the daemon starts and
#    answers `ferry status`; a second daemon on the same socket is refused.
# 2. Two mounts through the daemon: the merged image, and the lower layer alone. Files
#    read from both equal the extracted reference; a second mount at a busy mount point
#    is refused.
# 3. `ferry status --json` lists both, each having read (fetched, or found in the shared
#    store) and fetched less than its total; the table and /metrics show them too.
# 4. `ferry umount` through the daemon leaves no mount; status lists one; a mount
#    unmounted with umount(8) disappears from status too.
# 5. `ferry mount` with no daemon on the socket starts one (detached) and mounts.
# 6. SIGTERM: the daemons exit 0, unmount every control-API mount, remove their sockets.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry),
#      OUT (default tests/e2e/out; the small image is $OUT/small:small),
#      FERRY_TIMEOUT (seconds per ferry call, 120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "FUSE mounts"
need_cmd jq curl tar gzip timeout mountpoint cmp
[[ -e /dev/fuse ]] || skip "no /dev/fuse"

FT=${FERRY_TIMEOUT:-120}
find_ferry
e2e_init

small_image
require_ferry daemon

# ---------------------------------------------------------------- helpers
is_mounted() { grep -q " $1 " /proc/self/mountinfo; }
# same NAME GOT WANT: files are identical
same() {
    if cmp -s "$2" "$3"; then pass "$1"; else
        fail "$1: $(cmp "$2" "$3" 2>&1 | head -1)"
    fi
}
# wait_gone PID SECONDS: wait for a process to exit
wait_gone() {
    local i
    for i in $(seq $(($2 * 10))); do
        kill -0 "$1" 2>/dev/null || return 0
        sleep 0.1
    done
    return 1
}

# ---------------------------------------------------------------- setup
echo "# setup: indexed small image in a ferry registry, reference tree"
publish_indexed_small e2e/small:v1 # IMG, REG_ADDR, IMAGE
REF=$E2E_TMP/ref
oci_extract "$SMALL" small "$REF"
LOWER=$(oci_manifest "$IMG" small | jq -r '.layers[0].digest')
LOWER_DIR=$E2E_TMP/lower
mkdir -p "$LOWER_DIR"
tar -xzf "$IMG/blobs/sha256/${LOWER#sha256:}" -C "$LOWER_DIR"

SOCK=$E2E_TMP/run/daemon.sock
METRICS_PORT=$(free_port)
CFG=$E2E_TMP/daemon.toml
cat >"$CFG" <<TOML
[store]
path = "$E2E_TMP/store"
[control]
socket = "$SOCK"
[metrics]
addr = "127.0.0.1:$METRICS_PORT"
[snapshotter]
enabled = true
socket = "$E2E_TMP/run/snapshotter.sock"
root = "$E2E_TMP/snapshotter"
[warm]
prefetch = false
background_fill = false
TOML

# ---------------------------------------------------------------- 1. start
echo "# 1. start the daemon"
fy "$E2E_TMP/pc.out" "$E2E_TMP/pc.err" daemon --config "$CFG" --print-config
if [[ $RC == 0 ]] && grep -q "socket = \"$SOCK\"" "$E2E_TMP/pc.out" &&
    grep -q "path = \"$E2E_TMP/store\"" "$E2E_TMP/pc.out" && grep -q 'request_size = "8M"' "$E2E_TMP/pc.out"; then
    pass "ferry daemon --print-config shows the effective config"
else
    fail "ferry daemon --print-config: exit $RC"
    show "$E2E_TMP/pc.out" 40
    show "$E2E_TMP/pc.err"
fi
"$FERRY" --log info daemon --config "$CFG" >"$E2E_TMP/daemon.log" 2>&1 &
DAEMON=$!
E2E_PIDS+=("$DAEMON")
if wait_for 30 "daemon status" "$FERRY" status --socket "$SOCK"; then
    pass "the daemon answers ferry status on its socket ($(grep -c . "$E2E_TMP/daemon.log") log lines)"
else
    fail "the daemon did not answer on $SOCK"
    show "$E2E_TMP/daemon.log" 30
    e2e_summary || exit 1
fi
if [[ -S $E2E_TMP/run/snapshotter.sock ]]; then
    pass "the snapshotter serves on its socket"
else
    fail "no snapshotter socket at $E2E_TMP/run/snapshotter.sock"
fi
fy "$E2E_TMP/d2.out" "$E2E_TMP/d2.err" daemon --config "$CFG" --store "$E2E_TMP/store-other"
if [[ $RC != 0 ]] && grep -q "already serving" "$E2E_TMP/d2.err"; then
    pass "a second daemon on the same socket is refused ($(tail -1 "$E2E_TMP/d2.err"))"
else
    fail "second daemon: exit $RC"
    show "$E2E_TMP/d2.err"
fi

# ---------------------------------------------------------------- 2. two mounts
echo "# 2. two mounts through the daemon"
M1=$E2E_TMP/mnt-merged
M2=$E2E_TMP/mnt-lower
mkdir -p "$M1" "$M2"
fy "$E2E_TMP/m1.out" "$E2E_TMP/m1.err" mount --socket "$SOCK" "$IMAGE" "$M1"
if [[ $RC == 0 ]] && is_mounted "$M1" && [[ $(cat "$E2E_TMP/m1.out") == "$M1" ]]; then
    pass "ferry mount $IMAGE through the daemon prints $M1"
else
    fail "ferry mount (merged): exit $RC, mounted: $(is_mounted "$M1" && echo yes || echo no)"
    show "$E2E_TMP/m1.err"
fi
fy "$E2E_TMP/m2.out" "$E2E_TMP/m2.err" mount --socket "$SOCK" "$IMAGE" "$M2" --layer "$LOWER"
if [[ $RC == 0 ]] && is_mounted "$M2"; then
    pass "ferry mount --layer (lower layer) through the daemon"
else
    fail "ferry mount --layer: exit $RC"
    show "$E2E_TMP/m2.err"
fi
for f in etc/motd app/hello.txt data/overwritten.txt app/start.sh; do
    same "merged: /$f equals the extracted image" "$M1/$f" "$REF/$f"
done
for f in etc/motd data/overwritten.txt etc/passwd; do
    same "lower layer: /$f equals the layer's tar" "$M2/$f" "$LOWER_DIR/$f"
done
if [[ ! -e $M2/app/hello.txt ]]; then pass "lower layer: the upper layer's files are absent"; else
    fail "lower layer shows /app/hello.txt"; fi
fy "$E2E_TMP/m3.out" "$E2E_TMP/m3.err" mount --socket "$SOCK" "$IMAGE" "$M1"
if [[ $RC != 0 ]] && grep -q "already" "$E2E_TMP/m3.err"; then
    pass "mounting over a live mount is refused ($(tail -1 "$E2E_TMP/m3.err"))"
else
    fail "second mount at $M1: exit $RC"
    show "$E2E_TMP/m3.err"
fi

# ---------------------------------------------------------------- 3. status
echo "# 3. status and metrics"
fy "$E2E_TMP/st.json" "$E2E_TMP/st.err" status --socket "$SOCK" --json
if [[ $RC == 0 ]]; then
    n=$(jq '.mounts | length' "$E2E_TMP/st.json")
    for mp in "$M1" "$M2"; do
        # The mounts share the store: what one fetched (its reads, readahead and the
        # nearby files of its misses) the other finds there (cache hits, nothing fetched).
        read -r fetched hits total < <(jq -r --arg m "$mp" '.mounts[] | select(.mountpoint == $m) | "\(.stats.bytes_fetched) \(.stats.cache_hits) \(.stats.bytes_total)"' "$E2E_TMP/st.json")
        if [[ $n == 2 && -n ${fetched:-} ]] && ((fetched + hits > 0 && fetched < total)); then
            pass "status --json: $mp fetched $fetched of $total bytes, $hits reads from the store"
        else
            fail "status --json: $n mounts, $mp fetched ${fetched:-?} of ${total:-?}, ${hits:-?} store hits"
            show "$E2E_TMP/st.json" 40
        fi
    done
    store_path=$(jq -r '.store.path' "$E2E_TMP/st.json")
    if [[ $store_path == "$E2E_TMP/store" ]]; then pass "status names the daemon's store"; else
        fail "status store path: $store_path"; fi
else
    fail "ferry status --json: exit $RC"
    show "$E2E_TMP/st.err"
fi
fy "$E2E_TMP/st.txt" "$E2E_TMP/st.err" status --socket "$SOCK"
if [[ $RC == 0 ]] && grep -q "^$M1 " "$E2E_TMP/st.txt" && grep -q "^$M2 " "$E2E_TMP/st.txt" &&
    grep -q "${LOWER:7:12}" "$E2E_TMP/st.txt"; then
    pass "ferry status table lists both mounts"
else
    fail "ferry status table: exit $RC"
    show "$E2E_TMP/st.txt"
fi
curl -s --max-time 5 "http://127.0.0.1:$METRICS_PORT/metrics" >"$E2E_TMP/metrics.txt" || true
if grep -q "^ferry_mount_fetched_bytes_total{mountpoint=\"$M1\"" "$E2E_TMP/metrics.txt" &&
    grep -q '^ferry_store_max_bytes ' "$E2E_TMP/metrics.txt"; then
    pass "/metrics has per-mount and store series"
else
    fail "/metrics lacks the mounts' series"
    show "$E2E_TMP/metrics.txt" 20
fi

# ---------------------------------------------------------------- 4. umount
echo "# 4. ferry umount through the daemon"
fy "$E2E_TMP/um.out" "$E2E_TMP/um.err" umount --socket "$SOCK" "$M1"
fy "$E2E_TMP/st2.json" "$E2E_TMP/st2.err" status --socket "$SOCK" --json
if ! is_mounted "$M1" && [[ $(jq '.mounts | length' "$E2E_TMP/st2.json" 2>/dev/null) == 1 ]]; then
    pass "ferry umount $M1: gone from the kernel and from status"
else
    fail "ferry umount: still mounted: $(is_mounted "$M1" && echo yes || echo no)"
    show "$E2E_TMP/um.err"
fi

# Unmounted from outside: the daemon notices and forgets the mount.
fy "$E2E_TMP/m5.out" "$E2E_TMP/m5.err" mount --socket "$SOCK" "$IMAGE" "$M1"
if [[ $RC == 0 ]] && umount "$M1"; then
    n=""
    for _ in $(seq 50); do
        n=$(timeout 30 "$FERRY" status --socket "$SOCK" --json | jq '.mounts | length')
        [[ $n == 1 ]] && break
        sleep 0.1
    done
    if [[ $n == 1 ]]; then pass "a mount unmounted with umount(8) disappears from status"; else
        fail "after umount(8), status lists $n mounts"; fi
else
    fail "remount for the umount(8) check: exit $RC"
    show "$E2E_TMP/m5.err"
fi

# ---------------------------------------------------------------- 5. auto-start
echo "# 5. ferry mount starts a daemon when none answers"
SOCK2=$E2E_TMP/run2/daemon.sock
M3=$E2E_TMP/mnt-auto
mkdir -p "$M3"
fy "$E2E_TMP/m4.out" "$E2E_TMP/m4.err" mount --socket "$SOCK2" --store "$E2E_TMP/store2" "$IMAGE" "$M3"
DAEMON2=""
if [[ $RC == 0 ]] && is_mounted "$M3"; then
    DAEMON2=$(timeout 30 "$FERRY" status --socket "$SOCK2" --json | jq -r '.daemon.pid')
    E2E_PIDS+=("$DAEMON2")
    same "auto-started daemon serves /etc/motd" "$M3/etc/motd" "$REF/etc/motd"
    if grep -q "started the node daemon" "$E2E_TMP/m4.err" && [[ -s $E2E_TMP/run2/daemon.log ]]; then
        pass "ferry mount started a detached daemon (pid $DAEMON2) logging to run2/daemon.log"
    else
        fail "no daemon start reported"
        show "$E2E_TMP/m4.err"
    fi
else
    fail "ferry mount with no daemon: exit $RC"
    show "$E2E_TMP/m4.err"
    show "$E2E_TMP/run2/daemon.log"
fi

# ---------------------------------------------------------------- 6. SIGTERM
echo "# 6. SIGTERM"
kill -TERM "$DAEMON"
set +e
wait_gone "$DAEMON" 30
wait "$DAEMON"
rc=$?
set -e
if [[ $rc == 0 ]] && ! is_mounted "$M2" && [[ ! -e $SOCK && ! -e $E2E_TMP/run/snapshotter.sock ]]; then
    pass "SIGTERM: the daemon exits 0, unmounts $M2, removes its sockets"
else
    fail "SIGTERM: exit $rc, $M2 mounted: $(is_mounted "$M2" && echo yes || echo no), sockets left: $(ls "$E2E_TMP/run" 2>/dev/null | tr '\n' ' ')"
    show "$E2E_TMP/daemon.log" 20
fi
if [[ -n $DAEMON2 ]]; then
    kill -TERM "$DAEMON2"
    if wait_gone "$DAEMON2" 30 && ! is_mounted "$M3" && [[ ! -e $SOCK2 ]]; then
        pass "SIGTERM: the auto-started daemon exits and leaves no mount"
    else
        fail "auto-started daemon after SIGTERM: running: $(kill -0 "$DAEMON2" 2>/dev/null && echo yes || echo no), mounted: $(is_mounted "$M3" && echo yes || echo no)"
        show "$E2E_TMP/run2/daemon.log" 20
    fi
fi
left=$(awk -v d="$E2E_TMP" 'index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo | wc -l)
if [[ $left == 0 ]]; then pass "no mounts left under the test directory"; else
    fail "$left mounts left under $E2E_TMP"; fi

e2e_summary
