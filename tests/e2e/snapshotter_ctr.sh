#!/usr/bin/env bash
# tests/e2e/snapshotter_ctr.sh — `ferry snapshotter` as containerd's proxy snapshotter,
# driven by containerd + runc through `ctr` (needs root): once with the system's
# containerd (Debian 12: 1.6), once with containerd 2.x (lib.sh per_containerd; its
# `ctr image pull` goes through the transfer service).
#
#   bash tests/e2e/snapshotter_ctr.sh     (E2E_CONTAINERD=system or =2: one version only)
#
# 1. `ferry snapshotter` on a private socket/root; a private containerd with
#    [proxy_plugins.ferry] pointing at it; the small image (bench/make-image.sh --small)
#    pushed to a private docker-registry.
# 2. `ctr image pull --snapshotter ferry --plain-http` unpacks through ferry; `ctr run
#    --snapshotter ferry` prints the same as the same image under overlayfs (default
#    command, and a listing + checksums of the merged tree incl. whiteouts).
# 3. A container that writes, renames and deletes files leaves every committed layer
#    directory byte-for-byte unchanged; its writes are in its own upper dir, which goes
#    away with the container.
# 4. `ctr snapshots prepare/mounts/commit/view` by hand: a committed snapshot on top of the
#    image shows the new file and the image's files; usage of the image's layers equals
#    what overlayfs reports (inodes).
# 5. `ctr snapshots ls/info/usage` show the layers; kill -9 the snapshotter while a
#    container runs, restart it: same snapshots listed, the running container still
#    answers `ctr task exec`, a new container starts, and removal still works.
# 6. SIGTERM stops it and removes the socket; no mount refers to its root at the end.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), E2E_KEEP=1,
#      E2E_VERBOSE=1 (print service logs on failure).
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# once with the system containerd (1.6), once with containerd 2.x (lib.sh, containerd_flavours)
per_containerd "$0" "$@"

need_root "private containerd"
need_cmd containerd ctr runc docker-registry skopeo jq curl sha256sum timeout mount umount
find_ferry
e2e_init

small_image
require_ferry snapshotter

# ferry snapshotter: start_ferry_snapshotter / stop_ferry_snapshotter (lib.sh) set
# SNAP_ROOT, SNAP_SOCK, SNAP_LOG, SNAP_PID; a start waits for a new "serving on" line
snap_paths

# run NAME ARGS...: ctr run with a timeout; output in $OUT, exit code in $RC
run() {
    set +e
    OUT=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run "$@" 2>&1)
    RC=$?
    set -e
}
# probe SNAPSHOTTER REF NAME: run $PROBE (which ends by printing "end") in a container.
# ctr can lose the tail of the output of a container that exits right after writing a
# lot of it (seen under CPU load, on 1.6 and 2.x, with either snapshotter: the copy from
# the container's pipe is cut when the task is deleted), so the container waits a second
# before it exits; output still cut short despite exit 0 is logged and run once more
probe() {
    run --rm --snapshotter "$1" "$2" "$3" sh -c "$PROBE; sleep 1"
    if [[ $RC == 0 && $OUT != *end ]]; then
        e2e_log "$1 probe output cut short after $(wc -l <<<"$OUT") lines: running it again"
        run --rm --snapshotter "$1" "$2" "$3-again" sh -c "$PROBE; sleep 1"
    fi
}
show() { sed 's/^/    | /' <<<"$1" | tail -"${2:-10}"; }
# layer_sums: one line per entry of every committed layer directory (path, type, mode,
# size, link target, sha256 of regular files)
layer_sums() {
    local d
    for d in "${LAYER_DIRS[@]}"; do
        (cd "$d" && find . -printf '%p\t%y\t%m\t%s\t%l\n' | LC_ALL=C sort | sed "s#^#$d\t#")
        (cd "$d" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0r sha256sum | sed "s#^#$d\t#")
    done
}
snap_ls() { ctr_ snapshots --snapshotter ferry ls | tail -n +2 | awk '{print $1, $2, $3}' | LC_ALL=C sort; }

start_ferry_snapshotter
start_registry
start_containerd_with_snapshotter ferry "$SNAP_SOCK"
REF=$REGISTRY/snap/small:small
push_oci "$SMALL" small snap/small:small || e2e_die "skopeo push failed"

# ---------------------------------------------------------------- 2. pull + run
t0=$SECONDS
if ctr_ image pull --snapshotter ferry --plain-http "$REF" >"$E2E_TMP/pull-ferry.log" 2>&1; then
    pass "ctr image pull --snapshotter ferry ($((SECONDS - t0))s)"
else
    fail "ctr image pull --snapshotter ferry"; show "$(cat "$E2E_TMP/pull-ferry.log")"
fi
ctr_ image pull --snapshotter overlayfs --plain-http "$REF" >"$E2E_TMP/pull-ovl.log" 2>&1 ||
    { show "$(cat "$E2E_TMP/pull-ovl.log")"; e2e_die "overlayfs pull failed"; }

run --rm --snapshotter ferry "$REF" "ferry-default-$$"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "ctr run --snapshotter ferry: '$OUT'"
else
    fail "ctr run --snapshotter ferry: exit $RC"; show "$OUT"
fi

# '..' of a top-level directory is the container's own root, whose times runc
# sets when it makes the container: two runs a minute apart differ there.
PROBE='cd /; ls -lan bin app data data/sub/dir etc tmp | grep -v " \.\.\$"; cat app/start.sh app/hello.txt data/overwritten.txt data/sub/dir/numbers.txt etc/passwd; sha256sum bin/busybox etc/motd; ls tmp/remove-me.txt 2>&1; echo end'
probe overlayfs "$REF" "ovl-probe-$$"
OVL_OUT=$OUT
[[ $RC == 0 ]] || { show "$OVL_OUT"; e2e_die "overlayfs probe failed (exit $RC)"; }
probe ferry "$REF" "ferry-probe-$$"
if [[ $RC == 0 && $OUT == "$OVL_OUT" && $OUT == *"end" ]]; then
    pass "merged tree under ferry == under overlayfs ($(wc -l <<<"$OUT") lines: listing, contents, checksums, whiteout)"
else
    fail "ferry probe differs from overlayfs (exit $RC)"
    diff <(echo "$OVL_OUT") <(echo "$OUT") | sed 's/^/    | /' | head -20 || true
fi

# ---------------------------------------------------------------- 3. writes stay in the upper dir
# `ctr run --rm` leaves the removal of the container's snapshot to containerd's GC
snapshot_dirs() { find "$SNAP_ROOT/snapshots" -mindepth 2 -maxdepth 2 -name fs | LC_ALL=C sort; }
dir_count_is() { [[ $(snapshot_dirs | wc -l) == "$1" ]]; }
wait_for 30 "probe snapshots collected" dir_count_is 2 || true
mapfile -t LAYER_DIRS < <(snapshot_dirs)
if [[ ${#LAYER_DIRS[@]} == 2 ]]; then
    pass "two committed layer directories after the pull"
else
    fail "expected 2 layer directories, found ${#LAYER_DIRS[@]}: ${LAYER_DIRS[*]}"
fi
layer_sums >"$E2E_TMP/layers-before"
WRITE='echo changed > /data/overwritten.txt; echo new > /app/new.txt; rm /app/hello.txt; echo more >> /data/sub/dir/numbers.txt; cat /data/overwritten.txt /app/new.txt'
run --snapshotter ferry "$REF" "writer-$$" sh -c "$WRITE"
if [[ $RC == 0 && $OUT == $'changed\nnew' ]]; then
    pass "a container writes, appends and deletes files"
else
    fail "writer container: exit $RC"; show "$OUT"
fi
layer_sums >"$E2E_TMP/layers-after"
if cmp -s "$E2E_TMP/layers-before" "$E2E_TMP/layers-after"; then
    pass "committed layer directories unchanged by the container's writes ($(wc -l <"$E2E_TMP/layers-before") entries)"
else
    fail "committed layers changed"; diff "$E2E_TMP/layers-before" "$E2E_TMP/layers-after" | head -10 || true
fi
UPPER=$(find "$SNAP_ROOT/snapshots" -mindepth 4 -maxdepth 4 -path '*/fs/app/new.txt' | head -1)
UPPER=${UPPER%/app/new.txt}
if [[ -n $UPPER && -f $UPPER/data/overwritten.txt && -c $UPPER/app/hello.txt ]]; then
    pass "the writes are in the container's upper dir (hello.txt a whiteout device)"
else
    fail "container upper dir not found or incomplete: '$UPPER'"
fi
ctr_ container rm "writer-$$" >/dev/null 2>&1 || true
if wait_for 20 "upper removed" test ! -e "$UPPER"; then
    pass "removing the container removes its snapshot directory"
else
    fail "upper dir $UPPER still there after ctr container rm"
fi

# ---------------------------------------------------------------- 4. snapshots by hand
TOP=$(ctr_ snapshots --snapshotter ferry ls | awk '$3 == "Committed" && $2 != "" {print $1}' | head -1)
MNT=$E2E_TMP/mnt
mkdir -p "$MNT"
# by_hand: prepare on the image's top layer, mount, write, unmount, commit, view
by_hand() {
    local s=(snapshots --snapshotter ferry)
    [[ -n $TOP ]] || { e2e_log "no committed top layer"; return 1; }
    ctr_ "${s[@]}" prepare hand-active "$TOP" >/dev/null || return 1
    eval "$(ctr_ "${s[@]}" mounts "$MNT" hand-active)" || return 1
    echo by-hand >"$MNT/hand.txt"
    umount "$MNT" || return 1
    ctr_ "${s[@]}" commit hand-committed hand-active || return 1
    ctr_ "${s[@]}" view hand-view hand-committed >/dev/null || return 1
    # ctr's lease ends with each command: without a GC root containerd's collector may
    # remove these unreferenced snapshots whenever it runs (e.g. around the restart below).
    ctr_ "${s[@]}" label hand-committed containerd.io/gc.root=e2e >/dev/null || return 1
    ctr_ "${s[@]}" label hand-view containerd.io/gc.root=e2e >/dev/null || return 1
    eval "$(ctr_ "${s[@]}" mounts "$MNT" hand-view)" || return 1
}
if by_hand; then
    if [[ $(cat "$MNT/hand.txt" 2>/dev/null) == by-hand && -f $MNT/app/start.sh && -x $MNT/bin/busybox ]]; then
        pass "prepare/mounts/commit/view by hand: the view shows the new file over the image"
    else
        fail "view of hand-committed lacks files: $(ls "$MNT" 2>&1 | tr '\n' ' ')"
    fi
else
    fail "ctr snapshots prepare/mounts/commit/view by hand (top=$TOP)"
fi
umount "$MNT" 2>/dev/null || true
layer_sums >"$E2E_TMP/layers-after2"
if cmp -s "$E2E_TMP/layers-before" "$E2E_TMP/layers-after2"; then
    pass "image layers unchanged by the hand-made commit"
else
    fail "image layers changed by the hand-made commit"
fi

INFO=$(ctr_ snapshots --snapshotter ferry info "$TOP" 2>&1 || true)
if [[ $(jq -r '.Kind | tostring | ascii_downcase' <<<"$INFO" 2>/dev/null) == committed ]] &&
    [[ $(jq -r .Name <<<"$INFO") == "$TOP" ]]; then
    pass "ctr snapshots info: $(jq -c '{Name: .Name[0:19], Kind, Parent: .Parent[0:19]}' <<<"$INFO")"
else
    fail "ctr snapshots info $TOP"; show "$INFO"
fi
# usage_of SNAPSHOTTER KEY -> inode count (ctr prints KEY, a human size, INODES)
usage_of() { ctr_ snapshots --snapshotter "$1" usage "$2" | awk 'NR == 2 {print $NF}'; }
ok=1
for key in $(ctr_ snapshots --snapshotter ferry ls | awk '$1 ~ /^sha256:/ {print $1}'); do
    ferry_inodes=$(usage_of ferry "$key")
    ovl_inodes=$(usage_of overlayfs "$key")
    if [[ -z $ferry_inodes || $ferry_inodes != "$ovl_inodes" || $ferry_inodes == 0 ]]; then
        ok=0
        e2e_log "usage inodes $key: ferry '$ferry_inodes' overlayfs '$ovl_inodes'"
    fi
done
if ((ok)); then
    pass "ctr snapshots usage: inode counts equal overlayfs's for every layer"
else
    fail "usage inode counts differ from overlayfs"
fi
SIZE=$(ctr_ snapshots --snapshotter ferry usage | awk 'NR > 1' | head -5)
e2e_log "usage: $(tr '\n' ';' <<<"$SIZE")"

# ---------------------------------------------------------------- 5. kill -9 and restart
run -d --snapshotter ferry "$REF" "long-$$" sh -c 'busybox sleep 300'
[[ $RC == 0 ]] || { fail "detached container: exit $RC"; show "$OUT"; }
wait_for 20 "task running" sh -c "ctr -a '$CONTAINERD_SOCK' -n '$CTR_NAMESPACE' task ls | grep -q 'long-$$.*RUNNING'" || true
BEFORE=$(snap_ls)
kill -9 "$SNAP_PID"
wait "$SNAP_PID" 2>/dev/null || true
SNAP_PID=""
start_ferry_snapshotter
# containerd redials the proxy with backoff after the connection broke
wait_for 60 "containerd reconnects" ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" snapshots --snapshotter ferry ls ||
    fail "containerd did not reconnect to the restarted snapshotter within 60s"
AFTER=$(snap_ls || true)
if [[ -n $BEFORE && $BEFORE == "$AFTER" ]]; then
    pass "after kill -9 + restart, ctr snapshots ls lists the same $(wc -l <<<"$AFTER") snapshots"
else
    fail "snapshot list changed across the restart"; diff <(echo "$BEFORE") <(echo "$AFTER") | head || true
fi
ok=1
for key in $(awk '{print $1}' <<<"$AFTER"); do
    ctr_ snapshots --snapshotter ferry usage "$key" >/dev/null 2>&1 || { ok=0; e2e_log "usage $key fails after restart"; }
done
if ((ok)); then
    pass "every snapshot is known to the restarted snapshotter (Usage answers)"
else
    fail "restarted snapshotter lost snapshots"
fi
set +e
EXEC=$(timeout 30 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" task exec --exec-id probe "long-$$" cat /app/hello.txt 2>&1)
set -e
if [[ -n $EXEC && $EXEC != *rror* ]]; then
    pass "the container running across the restart still serves files ('$EXEC')"
else
    fail "task exec in the running container after restart"; show "$EXEC"
fi
run --rm --snapshotter ferry "$REF" "after-restart-$$"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "a new container starts after the restart"
else
    fail "new container after restart: exit $RC"; show "$OUT"
fi
ctr_ task kill -s SIGKILL "long-$$" >/dev/null 2>&1 || true
wait_for 20 "task stopped" sh -c "! ctr -a '$CONTAINERD_SOCK' -n '$CTR_NAMESPACE' task ls | grep -q 'long-$$.*RUNNING'" || true
ctr_ task rm -f "long-$$" >/dev/null 2>&1 || true
if ctr_ container rm "long-$$" >/dev/null 2>&1; then
    pass "container created before the restart is removed through the restarted snapshotter"
else
    fail "ctr container rm long-$$"
fi

# ---------------------------------------------------------------- 6. teardown
ctr_ snapshots --snapshotter ferry rm hand-view hand-committed >/dev/null 2>&1 || true
ctr_ image rm "$REF" >/dev/null 2>&1 || true
if grep -qF "$SNAP_ROOT" /proc/self/mountinfo; then
    fail "mounts still refer to $SNAP_ROOT"; grep -F "$SNAP_ROOT" /proc/self/mountinfo | head -3
else
    pass "no mount refers to the snapshotter's root after the containers are gone"
fi
kill -TERM "$SNAP_PID"
if wait "$SNAP_PID" && [[ ! -e $SNAP_SOCK ]]; then
    pass "SIGTERM: clean exit, socket removed"
else
    fail "SIGTERM: exit status or socket left behind"
fi
SNAP_PID=""
if [[ $E2E_FAILED != 0 && ${E2E_VERBOSE:-} == 1 ]]; then
    tail -40 "$SNAP_LOG" >&2
fi
e2e_summary
