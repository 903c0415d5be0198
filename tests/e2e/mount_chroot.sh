#!/usr/bin/env bash
# tests/e2e/mount_chroot.sh — `ferry mount` serves an image's root filesystem lazily
# over FUSE, and a real program chrooted into it sees what it would see in the image
# extracted normally.
#
#   bash tests/e2e/mount_chroot.sh
#
# Setup: a copy of the small image (bench/make-image.sh --small), indexed with
# `ferry index --min-layer-size 0 --span 65536`; the reference tree is oci_extract of the original.
# The walk: busybox, chrooted (`chroot DIR /bin/busybox sh -c …`), lists every path
# with type, mode, owner, size, link count and mtime (regular files), symlink targets
# and the md5sum of every file; it runs in the reference tree and in the mount, and
# the outputs must be identical.
#
# 1. OCI layout: `ferry mount oci:IMG:small MNT` (returns once mounted), a small
#    read fetches less than the image, the chroot walk matches, `ferry umount`
#    leaves no mount and the server process exits.
# 2. Registry: Debian's docker-registry, image and index artifact pushed with
#    `ferry copy`; mount from the registry with an empty store: a small read fetches
#    less than the layers hold; the walk matches; mounting again over the same store
#    fetches nothing. Then the registry stops: an uncached read fails with EIO
#    within the --timeout (plus the client's retries), the mount keeps answering.
# 3. A layer alone (`--layer`): the upper layer's whiteout is a 0/0 character device
#    and its files are there, the lower layer's are not.
# 4. An image without any index (layers fetched whole): the walk matches.
# 5. `ferry mount --foreground` unmounts cleanly on SIGTERM.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry),
#      OUT (default tests/e2e/out; the small image is $OUT/small:small),
#      FERRY_TIMEOUT (seconds per ferry call, 120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "FUSE mounts and chroot"
need_cmd docker-registry skopeo jq curl tar gzip md5sum chroot timeout mountpoint
[[ -e /dev/fuse ]] || skip "no /dev/fuse"

FT=${FERRY_TIMEOUT:-120}
find_ferry
e2e_init

small_image
require_ferry mount

# ---------------------------------------------------------------- helpers
showdiff() { { diff "$1" "$2" | grep '^[<>]' | sed 's/^</-/; s/^>/+/' | show /dev/stdin 20; } || true; }
# stat_of FILE KEY: a number from a --stats-file JSON
stat_of() { jq -r ".$2" "$1"; }

# The walk, run by the image's own busybox inside a chroot.
WALK='
B=/bin/busybox
cd /
$B find . ! -type f ! -type l | $B sort | while read -r p; do
    $B stat -c "%n %F %a %u:%g" "$p"
done
$B find . -type l | $B sort | while read -r p; do
    echo "$p -> $($B readlink "$p")"
done
$B find . -type f | $B sort | while read -r p; do
    $B stat -c "%n %a %u:%g %s %h %Y" "$p"
done
$B find . -type f | $B sort | $B xargs $B md5sum
echo "walked $($B find . | $B wc -l) paths"
'
# walk ROOT OUTFILE: run the walk chrooted into ROOT
walk() {
    timeout "$FT" chroot "$1" /bin/busybox sh -c "$WALK" >"$2" 2>&1
}
# compare_walk NAME ROOT: the walk in ROOT must equal the walk in the reference tree
compare_walk() {
    local got=$E2E_TMP/walk.$RANDOM
    if ! walk "$2" "$got"; then
        fail "$1: the chrooted walk failed"
        show "$got"
        return
    fi
    if cmp -s "$E2E_TMP/want.walk" "$got"; then
        pass "$1: chrooted busybox walk identical ($(tail -1 "$got"), $(grep -c '^[0-9a-f]\{32\} ' "$got") md5sums)"
    else
        fail "$1: the walk differs (- extracted, + mounted)"
        showdiff "$E2E_TMP/want.walk" "$got"
    fi
}
# unmount_ok NAME MNT [PID]: `ferry umount MNT` leaves no mount and the server exits
unmount_ok() {
    fy "$E2E_TMP/um.out" "$E2E_TMP/um.err" umount "$2"
    local gone=1 i
    if [[ -n ${3:-} ]]; then
        gone=0
        for i in $(seq 100); do
            kill -0 "$3" 2>/dev/null || { gone=1; break; }
            sleep 0.1
        done
    fi
    if [[ $RC == 0 ]] && ! mountpoint -q "$2" && ! grep -q " $2 " /proc/self/mountinfo && [[ $gone == 1 ]]; then
        pass "$1: ferry umount leaves no mount behind and the server exits"
    else
        fail "$1: ferry umount exit $RC, still mounted: $(mountpoint -q "$2" && echo yes || echo no), server gone: $gone"
        show "$E2E_TMP/um.err"
        umount -l "$2" 2>/dev/null || true
    fi
}
# server_pid MNT: pid of the `ferry mount … MNT --foreground` process
server_pid() { pgrep -f -- "mount .* $1 --foreground" | head -1 || true; }
# daemon_pid SOCKET: pid of the node daemon `ferry mount` started on that control socket
daemon_pid() { pgrep -f -- "daemon --socket $1" | head -1 || true; }
# wait_stats FILE: wait until the stats file exists and counts a fetch or a hit
wait_stats() {
    local i
    for i in $(seq 50); do
        if [[ -s $1 ]] && (($(stat_of "$1" bytes_fetched) + $(stat_of "$1" cache_hits) > 0)); then
            return 0
        fi
        sleep 0.1
    done
    return 1
}
# small_read NAME MNT STATS: reading /etc/motd fetches less than the whole image
small_read() {
    local got fetched total
    got=$(head -c 200 "$2/etc/motd" 2>&1 || true)
    if ! wait_stats "$3"; then
        fail "$1: no counters after a read ($got)"
        return
    fi
    fetched=$(stat_of "$3" bytes_fetched)
    total=$(stat_of "$3" bytes_total)
    if [[ $got == "ferry small test image"* ]] && ((fetched > 0 && fetched < total)); then
        pass "$1: reading /etc/motd fetched $fetched of $total bytes"
    else
        fail "$1: /etc/motd read '$got', fetched $fetched of $total bytes"
    fi
}

# ---------------------------------------------------------------- setup
echo "# setup: indexed copy of the small image, reference tree"
IMG=$E2E_TMP/img
cp -a "$SMALL" "$IMG"
fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index --min-layer-size 0 --span 65536 "oci:$IMG:small"
if [[ $RC == 0 ]]; then pass "ferry index --min-layer-size 0 --span 65536"; else
    fail "ferry index: exit $RC"; show "$E2E_TMP/index.err"; e2e_summary || exit 1; fi
REF=$E2E_TMP/ref
oci_extract "$SMALL" small "$REF"
walk "$REF" "$E2E_TMP/want.walk" || { show "$E2E_TMP/want.walk"; e2e_die "the walk fails in the extracted tree"; }
e2e_log "reference: $(tail -1 "$E2E_TMP/want.walk")"

# ---------------------------------------------------------------- 1. OCI layout
echo "# 1. mount from the OCI layout"
MNT=$E2E_TMP/mnt-layout
mkdir -p "$MNT"
STATS=$E2E_TMP/layout.stats.json
fy "$E2E_TMP/m1.out" "$E2E_TMP/m1.err" mount "oci:$IMG:small" "$MNT" --store "$E2E_TMP/store1" --stats-file "$STATS"
if [[ $RC == 0 ]] && mountpoint -q "$MNT"; then
    pass "ferry mount oci:IMG:small returns with the mount in place ($(grep " $MNT " /proc/self/mountinfo | awk '{print $9}'))"
    PID=$(server_pid "$MNT")
    small_read "layout" "$MNT" "$STATS"
    compare_walk "layout" "$MNT"
    unmount_ok "layout" "$MNT" "$PID"
else
    fail "ferry mount oci:IMG:small: exit $RC"
    show "$E2E_TMP/m1.err"
fi

# ---------------------------------------------------------------- 2. registry
echo "# 2. mount from a registry (docker-registry, referrers tag fallback)"
start_registry
fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy "oci:$IMG:small" "$REGISTRY/e2e/small:v1"
if [[ $RC == 0 ]]; then pass "ferry copy the indexed image to $REGISTRY/e2e/small:v1"; else
    fail "ferry copy: exit $RC"; show "$E2E_TMP/cp.err"; fi
MNT=$E2E_TMP/mnt-registry
mkdir -p "$MNT"
STATS=$E2E_TMP/registry.stats.json
fy "$E2E_TMP/m2.out" "$E2E_TMP/m2.err" mount "$REGISTRY/e2e/small:v1" "$MNT" --store "$E2E_TMP/store2" --stats-file "$STATS"
if [[ $RC == 0 ]] && mountpoint -q "$MNT"; then
    pass "ferry mount $REGISTRY/e2e/small:v1"
    PID=$(server_pid "$MNT")
    small_read "registry" "$MNT" "$STATS"
    compare_walk "registry" "$MNT"
    unmount_ok "registry" "$MNT" "$PID"
    # Again over the warm store: nothing is fetched.
    rm -f "$STATS"
    fy "$E2E_TMP/m3.out" "$E2E_TMP/m3.err" mount "$REGISTRY/e2e/small:v1" "$MNT" --store "$E2E_TMP/store2" --stats-file "$STATS"
    if [[ $RC == 0 ]]; then
        PID=$(server_pid "$MNT")
        compare_walk "registry, warm store" "$MNT"
        wait_stats "$STATS" || true
        fetched=$(stat_of "$STATS" bytes_fetched 2>/dev/null || echo "?")
        hits=$(stat_of "$STATS" cache_hits 2>/dev/null || echo "?")
        if [[ $fetched == 0 && $hits != 0 && $hits != "?" ]]; then
            pass "registry, warm store: 0 bytes fetched, $hits spans from the chunk store"
        else
            fail "registry, warm store: fetched $fetched bytes, $hits cache hits"
        fi
        unmount_ok "registry, warm store" "$MNT" "$PID"
    else
        fail "second ferry mount from the registry: exit $RC"
        show "$E2E_TMP/m3.err"
    fi
else
    fail "ferry mount $REGISTRY/e2e/small:v1: exit $RC"
    show "$E2E_TMP/m2.err"
fi

# Registry gone: uncached reads fail with EIO, bounded; the mount keeps answering.
if [[ -n ${REGISTRY_PID:-} ]]; then
    STATS=$E2E_TMP/gone.stats.json
    fy "$E2E_TMP/m6.out" "$E2E_TMP/m6.err" mount "$REGISTRY/e2e/small:v1" "$MNT" --store "$E2E_TMP/store-gone" --stats-file "$STATS" --timeout 5
    if [[ $RC == 0 ]]; then
        PID=$(server_pid "$MNT")
        head -c 10 "$MNT/etc/motd" >/dev/null
        stop_registry || true
        t0=$(date +%s)
        err=$(timeout 90 cat "$MNT/data/sub/dir/numbers.txt" 2>&1 >/dev/null) && rc=0 || rc=$?
        t1=$(date +%s)
        motd=$(head -c 22 "$MNT/etc/motd" 2>&1 || true)
        if [[ $rc != 0 && $rc != 124 && $err == *"Input/output error"* && $motd == "ferry small test image" ]] &&
            ls "$MNT/data/sub/dir" >/dev/null; then
            pass "registry gone: uncached read fails with EIO after $((t1 - t0)) s, cached file and metadata still served"
        else
            fail "registry gone: cat exit $rc ($err) after $((t1 - t0)) s, motd '$motd'"
        fi
        unmount_ok "registry gone" "$MNT" "$PID"
    else
        fail "ferry mount for the registry-gone check: exit $RC"
        show "$E2E_TMP/m6.err"
    fi
fi

# ---------------------------------------------------------------- 3. one layer
echo "# 3. one layer alone, whiteouts as overlayfs expects"
UPPER=$(oci_manifest "$IMG" small | jq -r '.layers[-1].digest')
MNT=$E2E_TMP/mnt-layer
mkdir -p "$MNT"
# Served by the node daemon `ferry mount` starts (no --stats-file/--foreground): a private
# one on its own control socket, stopped at the end of section 4.
DSOCK=$E2E_TMP/run/daemon.sock
mkdir -p "$E2E_TMP/run"
fy "$E2E_TMP/m4.out" "$E2E_TMP/m4.err" mount "oci:$IMG:small" "$MNT" --layer "$UPPER" --store "$E2E_TMP/store1" --socket "$DSOCK"
DPID=$(daemon_pid "$DSOCK")
[[ -n $DPID ]] && E2E_PIDS+=("$DPID")
if [[ $RC == 0 ]]; then
    PID=""
    wh=$(stat -c '%F %t:%T' "$MNT/tmp/remove-me.txt" 2>&1 || true)
    over=$(cat "$MNT/data/overwritten.txt" 2>&1 || true)
    if [[ $wh == "character special file 0:0" && $over == "new version (layer 2)" && ! -e $MNT/bin/busybox ]]; then
        pass "--layer: whiteout is a 0/0 char device, the layer's files only"
    else
        fail "--layer: whiteout '$wh', overwritten.txt '$over', busybox present: $([[ -e $MNT/bin/busybox ]] && echo yes || echo no)"
    fi
    unmount_ok "--layer" "$MNT" "$PID"
else
    fail "ferry mount --layer: exit $RC"
    show "$E2E_TMP/m4.err"
fi

# ---------------------------------------------------------------- 4. no index
echo "# 4. an image without any index (whole layers)"
MNT=$E2E_TMP/mnt-whole
mkdir -p "$MNT"
fy "$E2E_TMP/m5.out" "$E2E_TMP/m5.err" mount "oci:$SMALL:small" "$MNT" --socket "$DSOCK"
if [[ $RC == 0 ]]; then
    compare_walk "unindexed layers (same daemon)" "$MNT"
    if "$FERRY" status --json --socket "$DSOCK" | jq -e --arg m "$MNT" '.mounts[] | select(.mountpoint == $m)' >/dev/null; then
        pass "ferry status lists the daemon's mount of the unindexed image"
    else
        fail "ferry status does not list $MNT"
    fi
    unmount_ok "unindexed layers" "$MNT"
else
    fail "ferry mount of the unindexed image: exit $RC"
    show "$E2E_TMP/m5.err"
fi
if [[ -n $DPID ]]; then
    kill -TERM "$DPID"
    if wait_for 20 "daemon exit" bash -c "! kill -0 $DPID" && [[ ! -S $DSOCK ]]; then
        pass "the node daemon exits on SIGTERM and removes its socket"
    else
        fail "the node daemon (pid $DPID) did not exit cleanly on SIGTERM"
    fi
fi

# ---------------------------------------------------------------- 5. SIGTERM
echo "# 5. --foreground unmounts on SIGTERM"
MNT=$E2E_TMP/mnt-fg
mkdir -p "$MNT"
"$FERRY" mount "oci:$IMG:small" "$MNT" --foreground --store "$E2E_TMP/store1" >"$E2E_TMP/fg.log" 2>&1 &
FG=$!
E2E_PIDS+=("$FG")
wait_for 30 "foreground mount" mountpoint -q "$MNT" || true
if mountpoint -q "$MNT"; then
    cat "$MNT/app/hello.txt" >/dev/null
    kill -TERM "$FG"
    set +e
    timeout 30 tail --pid="$FG" -f /dev/null
    wait "$FG"
    rc=$?
    set -e
    if [[ $rc == 0 ]] && ! mountpoint -q "$MNT"; then
        pass "SIGTERM: clean unmount, exit 0"
    else
        fail "SIGTERM: exit $rc, still mounted: $(mountpoint -q "$MNT" && echo yes || echo no)"
        show "$E2E_TMP/fg.log"
        umount -l "$MNT" 2>/dev/null || true
    fi
else
    fail "ferry mount --foreground did not mount"
    show "$E2E_TMP/fg.log"
fi

e2e_summary
