#!/usr/bin/env bash
# tests/e2e/daemon_restart_live.sh — a running process keeps its lazy mount across a
# daemon crash (kill -9) and restart: the daemon's fd holder keeps the mount's
# /dev/fuse connection alive and the restarted daemon resumes serving it.
#
#   bash tests/e2e/daemon_restart_live.sh
#
# Setup (as tests/e2e/daemon.sh): the small image, indexed with `--span 65536`, pushed
# to a `ferry registry serve` on loopback; reference tree from oci_extract. The daemon
# runs with a temp store and sockets, no snapshotter, prefetch and background fill off
# (so only what the process reads is fetched).
#
# 1. The daemon starts its fd holder (`ferry daemon --fd-holder`, own session);
#    `ferry mount` of the merged image; a "container" — a busybox shell chrooted into
#    the mount, fed commands through a FIFO — opens /data/sub/dir/numbers.txt (kept
#    open on fd 3, nothing read from it) and reads /etc/motd.
# 2. kill -9 the daemon. The mount stays; the holder stays. The process then asks for
#    an uncached file (/app/hello.txt, in the layer nothing was read from): the read
#    waits for a server.
# 3. Restart the daemon: it logs the resumed connection; the waiting read completes
#    with the right bytes; through the fd opened before the crash the first 64 KiB of
#    numbers.txt read correctly; a fresh open reads the file's uncached tail correctly;
#    readdir works; status lists the mount once, with bytes fetched by the new daemon;
#    mountinfo shows exactly one mount there.
# 4. A read the daemon has taken but not answered when it dies (the registry is
#    stopped with SIGSTOP, so the fetch hangs): kill -9, SIGCONT, restart; the kernel
#    resends the request (FUSE_NOTIFY_RESEND) and the read completes correctly. The
#    connection's second resume; the fd opened before the first crash still reads.
# 5. The process exits; `ferry umount` unmounts; SIGTERM stops the daemon; the holder,
#    holding nothing, exits and removes its socket.
# 6. (when containerd, ctr and runc are installed) The snapshotter path: a second
#    daemon with the snapshotter and a fresh store, a private containerd, `ferry pull`
#    (every layer lazy), a detached container; kill -9 the daemon and restart it: every
#    lazy layer's connection is resumed (none detached and remounted), containerd
#    reconnects, `ctr task exec` into the container that ran across the crash reads an
#    uncached range and a file of the other layer correctly, each lazy layer is
#    mounted once.
#
# Every wait is bounded (a hang is a FAIL, not a stuck test). Needs root, /dev/fuse,
# and a kernel with FUSE_NOTIFY_RESEND (6.9+) for reads caught mid-flight by the crash.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry),
#      OUT (default tests/e2e/out; the small image is $OUT/small:small),
#      FERRY_TIMEOUT (seconds per ferry call, 120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "FUSE mounts, chroot"
need_cmd jq tar gzip timeout chroot mkfifo sha256sum head tail awk
[[ -e /dev/fuse ]] || skip "no /dev/fuse"

FT=${FERRY_TIMEOUT:-120}
find_ferry
e2e_init

small_image
require_ferry daemon

# ---------------------------------------------------------------- helpers
# mounts_at DIR: how many mounts mountinfo lists at DIR
mounts_at() { awk -v d="$1" '$5 == d' /proc/self/mountinfo | wc -l; }
# holder_pid SOCKET: pid of the fd holder serving SOCKET (empty when none)
holder_pid() {
    ps -eo pid=,args= | awk -v s="--fd-holder $1" 'index($0, s) { print $1; exit }'
}
# abort_fuse_at DIR: abort the FUSE connection mounted at DIR (cleanup: never leave a
# process stuck on a connection nobody serves)
abort_fuse_at() {
    local dev
    dev=$(awk -v d="$1" '$5 == d { split($3, a, ":"); print a[2] }' /proc/self/mountinfo | head -1)
    [[ -n $dev && -e /sys/fs/fuse/connections/$dev/abort ]] && echo 1 >"/sys/fs/fuse/connections/$dev/abort"
    return 0
}
# ask CMDS MARK [SECONDS]: send shell commands to the chrooted worker, then wait for
# the line MARK in its output (default 30 s); non-zero on timeout
ask() {
    printf '%s; echo %s\n' "$1" "$2" >&7
    wait_mark "$2" "${3:-30}"
}
wait_mark() {
    local deadline=$((SECONDS + $2))
    until grep -qx "$1" "$WORK_OUT"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}
# between A B: the worker's output lines between marker lines A and B
between() { awk -v a="$1" -v b="$2" '$0 == a { on = 1; next } $0 == b { on = 0 } on' "$WORK_OUT"; }
# start_daemon: the daemon in the background, waiting for its status
start_daemon() {
    "$FERRY" --log info daemon --config "$CFG" >>"$E2E_TMP/daemon.log" 2>&1 &
    DAEMON=$!
    E2E_PIDS+=("$DAEMON")
    wait_for 30 "daemon status" "$FERRY" status --socket "$SOCK"
}
resumed_lines() { grep -c "resumed the kept FUSE connection" "$E2E_TMP/daemon.log" || true; }
# the daemon log without colours
plain_log() { sed 's/\x1b\[[0-9;]*m//g' "$E2E_TMP/daemon.log"; }

# ---------------------------------------------------------------- setup
echo "# setup: indexed small image in a ferry registry, reference tree"
publish_indexed_small e2e/small:v1 # IMG, REG_ADDR, IMAGE
REF=$E2E_TMP/ref
oci_extract "$SMALL" small "$REF"

SOCK=$E2E_TMP/run/daemon.sock
HSOCK=$E2E_TMP/run/fdstore.sock
CFG=$E2E_TMP/daemon.toml
cat >"$CFG" <<TOML
[store]
path = "$E2E_TMP/store"
[control]
socket = "$SOCK"
[snapshotter]
enabled = false
# Reads must reach the registry when the test says they do (a stopped registry holds
# them): no warm-up, no readahead or nearby-file fetch bringing a range along before it is read.
[fetch]
readahead = "0"
whole_file = "0"
nearby = "0"
[warm]
prefetch = false
background_fill = false
[file_cache]
enabled = false
TOML
M=$E2E_TMP/mnt
mkdir -p "$M"
WORK_OUT=$E2E_TMP/worker.out
WORK_FIFO=$E2E_TMP/worker.fifo
mkfifo "$WORK_FIFO"
: >"$WORK_OUT"
WORKER=""
HOLDER=""
# Cleanup, LIFO: unblock anything waiting on the mount, stop the worker and holder.
e2e_defer '[[ -n $HOLDER ]] && kill -9 $HOLDER'
e2e_defer 'abort_fuse_at "$M"; [[ -n $WORKER ]] && kill -9 $WORKER'

# ---------------------------------------------------------------- 1. mount, worker
echo "# 1. daemon with an fd holder, a mount, a process using it"
if start_daemon; then
    pass "the daemon answers on $SOCK"
else
    fail "the daemon did not come up"
    show "$E2E_TMP/daemon.log" 30
    e2e_summary || exit 1
fi
HOLDER=$(holder_pid "$HSOCK")
if [[ -n $HOLDER && -S $HSOCK ]] && [[ $(ps -o sid= -p "$HOLDER" | tr -d ' ') == "$HOLDER" ]]; then
    pass "the daemon started its fd holder (pid $HOLDER, own session) on $HSOCK"
else
    fail "no fd holder on $HSOCK (pid '${HOLDER}')"
    show "$E2E_TMP/daemon.log" 20
fi
fy "$E2E_TMP/m.out" "$E2E_TMP/m.err" mount --socket "$SOCK" "$IMAGE" "$M"
if [[ $RC == 0 && $(mounts_at "$M") == 1 ]]; then
    pass "ferry mount $IMAGE $M"
else
    fail "ferry mount: exit $RC, $(mounts_at "$M") mounts at $M"
    show "$E2E_TMP/m.err"
    e2e_summary || exit 1
fi

# The worker: a busybox shell chrooted into the mount, reading commands from the FIFO
# (held open read-write on fd 7 so it never sees EOF between commands).
exec 7<>"$WORK_FIFO"
chroot "$M" /bin/sh <&7 >"$WORK_OUT" 2>&1 &
WORKER=$!
if ask 'exec 3</data/sub/dir/numbers.txt; cat /etc/motd' '==A'; then
    if [[ "$(awk '$0 == "==A" { exit } { print }' "$WORK_OUT")" == "$(cat "$REF/etc/motd")" ]]; then
        pass "the process reads /etc/motd and holds numbers.txt open (fd 3)"
    else
        fail "the process read a wrong /etc/motd"
        show "$WORK_OUT"
    fi
else
    fail "the chrooted process did not answer"
    show "$WORK_OUT"
fi
fy "$E2E_TMP/st0.json" "$E2E_TMP/st0.err" status --socket "$SOCK" --json
fetched_before=$(jq '.mounts[0].stats.bytes_fetched' "$E2E_TMP/st0.json" 2>/dev/null || echo "?")

# ---------------------------------------------------------------- 2. crash
echo "# 2. kill -9 the daemon; the process asks for an uncached file meanwhile"
kill -9 "$DAEMON"
{ wait "$DAEMON"; } 2>/dev/null || true
if [[ $(mounts_at "$M") == 1 && -n $HOLDER ]] && kill -0 "$HOLDER" 2>/dev/null; then
    pass "after kill -9: the mount is in place and the holder (pid $HOLDER) lives"
else
    fail "after kill -9: $(mounts_at "$M") mounts, holder alive: $(kill -0 "${HOLDER:-0}" 2>/dev/null && echo yes || echo no)"
fi
# Read while no daemon serves: the request waits in the connection's queue.
printf '%s\n' 'echo ==B0; cat /app/hello.txt; echo ==B' >&7
wait_mark '==B0' 10 || true
sleep 1
if ! grep -qx '==B' "$WORK_OUT"; then
    pass "a read with no daemon waits (does not fail with ENOTCONN)"
else
    fail "a read with no daemon returned: $(between '==B0' '==B' | head -2)"
fi

# ---------------------------------------------------------------- 3. restart
echo "# 3. restart: the connection is resumed"
if start_daemon; then
    pass "the restarted daemon answers"
else
    fail "the daemon did not restart"
    show "$E2E_TMP/daemon.log" 30
fi
if [[ $(resumed_lines) == 1 ]]; then
    pass "the restarted daemon resumed the kept connection ($(plain_log | grep -m1 'resumed the kept' | grep -o 'generation=[0-9]*'))"
else
    fail "no resume logged ($(resumed_lines) lines)"
    show "$E2E_TMP/daemon.log" 20
fi
if wait_mark '==B' 30 && [[ "$(between '==B0' '==B')" == "$(cat "$REF/app/hello.txt")" ]]; then
    pass "the read issued while the daemon was dead completed with the right bytes"
else
    fail "the waiting read: $(between '==B0' '==B' | head -3 | tr '\n' ' ')"
    show "$WORK_OUT"
fi
want_head=$(head -c 65536 "$REF/data/sub/dir/numbers.txt" | sha256sum | cut -d' ' -f1)
want_tail=$(tail -c 100000 "$REF/data/sub/dir/numbers.txt" | sha256sum | cut -d' ' -f1)
if ask 'echo ==C0; busybox head -c 65536 <&3 | sha256sum' '==C'; then
    got=$(between '==C0' '==C' | cut -d' ' -f1)
    if [[ $got == "$want_head" ]]; then
        pass "the file opened before the crash reads correctly after it (first 64 KiB)"
    else
        fail "the file opened before the crash: sha256 $got, want $want_head"
        show "$WORK_OUT"
    fi
else
    fail "reading through the fd opened before the crash hung"
fi
if ask 'echo ==D0; busybox tail -c 100000 /data/sub/dir/numbers.txt | sha256sum; ls /app' '==D'; then
    got=$(between '==D0' '==D' | head -1 | cut -d' ' -f1)
    listing=$(between '==D0' '==D' | tail -n +2 | tr '\n' ' ')
    if [[ $got == "$want_tail" && $listing == *hello.txt*start.sh* ]]; then
        pass "a fresh open reads the uncached tail of numbers.txt correctly; readdir works"
    else
        fail "fresh open after restart: sha256 $got (want $want_tail), ls /app: $listing"
    fi
else
    fail "a fresh open after the restart hung"
fi
fy "$E2E_TMP/st1.json" "$E2E_TMP/st1.err" status --socket "$SOCK" --json
n=$(jq '.mounts | length' "$E2E_TMP/st1.json" 2>/dev/null || echo "?")
mp=$(jq -r '.mounts[0].mountpoint' "$E2E_TMP/st1.json" 2>/dev/null || echo "?")
fetched=$(jq '.mounts[0].stats.bytes_fetched' "$E2E_TMP/st1.json" 2>/dev/null || echo 0)
if [[ $n == 1 && $mp == "$M" ]] && ((fetched > 0)); then
    pass "status lists the resumed mount once; the new daemon fetched $fetched bytes for it (the first one $fetched_before)"
else
    fail "status after restart: $n mounts, mountpoint $mp, fetched $fetched"
    show "$E2E_TMP/st1.json" 20
fi
if [[ $(mounts_at "$M") == 1 ]]; then pass "exactly one mount at $M (no duplicate)"; else
    fail "$(mounts_at "$M") mounts at $M"; fi

# ---------------------------------------------------------------- 4. again
echo "# 4. a crash with a read in flight; the second resume"
want_mid=$(dd if="$REF/data/sub/dir/numbers.txt" bs=65536 skip=8 count=1 2>/dev/null | sha256sum | cut -d' ' -f1)
kill -STOP "$REG_PID"
e2e_defer 'kill -CONT $REG_PID'
printf '%s\n' 'echo ==F0; busybox dd if=/data/sub/dir/numbers.txt bs=65536 skip=8 count=1 | sha256sum; echo ==F' >&7
wait_mark '==F0' 10 || true
sleep 2
if ! grep -qx '==F' "$WORK_OUT"; then
    pass "with the registry stopped, the read is taken by the daemon and waits"
else
    fail "the read with the registry stopped returned at once"
fi
kill -9 "$DAEMON"
{ wait "$DAEMON"; } 2>/dev/null || true
kill -CONT "$REG_PID"
if start_daemon && [[ $(resumed_lines) == 2 ]]; then
    pass "the second restart resumed the connection again"
else
    fail "second restart: $(resumed_lines) resumes logged"
    show "$E2E_TMP/daemon.log" 20
fi
if wait_mark '==F' 30; then
    # dd's statistics (stderr; the image has no /dev/null) share the output
    got=$(between '==F0' '==F' | grep -- ' -$' | cut -d' ' -f1)
    if [[ $got == "$want_mid" ]]; then
        pass "the read the dead daemon had taken was resent and completed correctly"
    else
        fail "the resent read: sha256 $got, want $want_mid ($(between '==F0' '==F' | tr '\n' ' '))"
    fi
else
    fail "the read in flight at the crash never completed (no FUSE_NOTIFY_RESEND? kernel $(uname -r))"
fi
want_next=$(head -c 131072 "$REF/data/sub/dir/numbers.txt" | tail -c 65536 | sha256sum | cut -d' ' -f1)
if ask 'echo ==E0; busybox head -c 65536 <&3 | sha256sum; cat /etc/motd' '==E'; then
    got=$(between '==E0' '==E' | head -1 | cut -d' ' -f1)
    motd=$(between '==E0' '==E' | tail -n +2)
    if [[ $got == "$want_next" && $motd == "$(cat "$REF/etc/motd")" ]]; then
        pass "after the second resume: the old fd reads the next 64 KiB, /etc/motd reads"
    else
        fail "after the second resume: sha256 $got (want $want_next), motd: $motd"
    fi
else
    fail "reads after the second restart hung"
fi

# ---------------------------------------------------------------- 5. release
echo "# 5. the process exits; umount; SIGTERM; the holder lets go"
printf 'exit\n' >&7
set +e
timeout 10 tail --pid="$WORKER" -f /dev/null
set -e
WORKER=""
exec 7>&-
fy "$E2E_TMP/um.out" "$E2E_TMP/um.err" umount --socket "$SOCK" "$M"
if [[ $RC == 0 && $(mounts_at "$M") == 0 ]]; then
    pass "ferry umount of the resumed mount"
else
    fail "ferry umount: exit $RC, $(mounts_at "$M") mounts left"
    show "$E2E_TMP/um.err"
fi
kill -TERM "$DAEMON"
set +e
timeout 30 tail --pid="$DAEMON" -f /dev/null
set -e
gone=no
for _ in $(seq 50); do
    if ! kill -0 "$HOLDER" 2>/dev/null; then gone=yes; break; fi
    sleep 0.1
done
if [[ $gone == yes && ! -e $HSOCK ]]; then
    HOLDER=""
    pass "with nothing held and no daemon, the holder exited and removed its socket"
else
    fail "holder after shutdown: alive: $([[ $gone == no ]] && echo yes || echo no), socket: $([[ -e $HSOCK ]] && echo present || echo gone)"
fi

# ---------------------------------------------------------------- 6. containerd
if command -v containerd >/dev/null && command -v ctr >/dev/null && command -v runc >/dev/null; then
    echo "# 6. containerd: a running container's lazy layers across kill -9"
    cx() {
        set +e
        OUT=$(timeout "${CT:-60}" ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" "$@" 2>&1)
        RC=$?
        set -e
    }
    snap_fuse_mounts() {
        awk -v r="$SNAP_ROOT/" 'index($5, r) == 1 {
            for (i = 7; i <= NF; i++) if ($i == "-") { if ($(i + 1) ~ /^fuse/) print $5; break }
        }' /proc/self/mountinfo | LC_ALL=C sort
    }
    SNAP_SOCK=$E2E_TMP/run6/snapshotter.sock
    SNAP_ROOT=$E2E_TMP/snap6
    SNAP_LOG=$E2E_TMP/daemon6.log
    snap_paths
    CTL6=$E2E_TMP/run6/daemon.sock
    CFG6=$E2E_TMP/daemon6.toml
    cat >"$CFG6" <<TOML
[store]
path = "$E2E_TMP/store6"
[control]
socket = "$CTL6"
[snapshotter]
enabled = true
socket = "$SNAP_SOCK"
root = "$SNAP_ROOT"
[fetch]
readahead = "0"
whole_file = "0"
nearby = "0"
[warm]
prefetch = false
background_fill = false
[file_cache]
enabled = false
TOML
    start_ferry_daemon "$CFG6"
    HOLDER6=$(holder_pid "$E2E_TMP/run6/fdstore.sock")
    e2e_defer '[[ -n ${HOLDER6:-} ]] && kill -9 $HOLDER6'
    start_containerd_with_snapshotter ferry "$SNAP_SOCK"
    set +e
    PULL_OUT=$(timeout 120 "$FERRY" pull --address "$CONTAINERD_SOCK" --namespace "$CTR_NAMESPACE" \
        --snapshotter ferry --snapshotter-root "$SNAP_ROOT" "$IMAGE" 2>&1)
    PULL_RC=$?
    set -e
    LAZY=$(snap_fuse_mounts | wc -l)
    if [[ $PULL_RC == 0 ]] && ((LAZY >= 2)); then
        pass "ferry pull through the snapshotter: $LAZY lazy layers ($(tail -1 <<<"$PULL_OUT"))"
    else
        fail "ferry pull: exit $PULL_RC, $LAZY lazy layers"
        show <(echo "$PULL_OUT")
    fi
    CT=120 cx run -d --snapshotter ferry "$IMAGE" "live-$$" busybox sleep 3600
    CT=60 cx task exec --exec-id pre "live-$$" busybox dd if=/data/sub/dir/numbers.txt bs=4096 count=4 status=none
    if [[ $RC == 0 && $OUT == "$(dd if="$REF/data/sub/dir/numbers.txt" bs=4096 count=4 status=none)" ]]; then
        pass "a detached container reads the head of numbers.txt through its lazy layers"
    else
        fail "container before the crash: exit $RC"
        show <(echo "$OUT")
    fi
    kill -9 "$SNAP_PID"
    { wait "$SNAP_PID"; } 2>/dev/null || true
    SNAP_PID=""
    start_ferry_daemon "$CFG6"
    resumed6=$(grep -c "resumed the kept FUSE connection" "$SNAP_LOG" || true)
    detached6=$(grep -c "detached a stale mount" "$SNAP_LOG" || true)
    if [[ $resumed6 == "$LAZY" && $detached6 == 0 ]]; then
        pass "after kill -9 the restarted daemon resumed all $LAZY lazy layers (none detached)"
    else
        fail "restart under containerd: $resumed6 resumed, $detached6 detached of $LAZY"
        show "$SNAP_LOG" 20
    fi
    wait_for 60 "containerd reconnects" ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" snapshots --snapshotter ferry ls ||
        fail "containerd did not reconnect to the restarted daemon"
    CT=60 cx task exec --exec-id post "live-$$" busybox dd if=/data/sub/dir/numbers.txt bs=4096 skip=128 count=1 status=none
    if [[ $RC == 0 && $OUT == "$(dd if="$REF/data/sub/dir/numbers.txt" bs=4096 skip=128 count=1 status=none)" ]]; then
        pass "the container that ran across the crash reads an uncached range correctly"
    else
        fail "uncached read in the running container after the restart: exit $RC"
        show <(echo "$OUT")
    fi
    CT=60 cx task exec --exec-id post2 "live-$$" busybox cat /app/hello.txt
    if [[ $RC == 0 && $OUT == "$(cat "$REF/app/hello.txt")" ]]; then
        pass "... and a file of the other lazy layer"
    else
        fail "reading /app/hello.txt in the running container: exit $RC"
        show <(echo "$OUT")
    fi
    if [[ $(snap_fuse_mounts | wc -l) == "$LAZY" && -z $(snap_fuse_mounts | uniq -d) ]]; then
        pass "each lazy layer is mounted once after the restart"
    else
        fail "lazy layer mounts after the restart: $(snap_fuse_mounts | wc -l) (want $LAZY)"
    fi
    CT=30 cx task kill -s SIGKILL "live-$$"
    CT=30 cx task rm -f "live-$$"
    CT=30 cx container rm "live-$$"
    CT=60 cx image rm --sync "$IMAGE"
else
    echo "# 6. skipped: containerd, ctr or runc not installed"
fi

e2e_summary
