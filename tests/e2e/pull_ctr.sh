#!/usr/bin/env bash
# tests/e2e/pull_ctr.sh — `ferry pull` into a real containerd with `ferry snapshotter`
# (needs root), once with the system's containerd (1.6) and once with containerd 2.x
# (lib.sh per_containerd). Sections 2-5 pull an image without an index, so every layer
# takes the fast path: parallel Range download, unpack into the snapshotter's staging
# dir, adoption by a staged Prepare. Section 6 pulls the same image indexed: every layer
# lazily.
#
#   bash tests/e2e/pull_ctr.sh          (E2E_CONTAINERD=system or =2: one version only)
#
# 1. `ferry snapshotter` + a private containerd with [proxy_plugins.ferry] + a private
#    docker-registry with the small image (bench/make-image.sh --small) pushed.
# 2. `ferry pull --plain-http` creates the image record named as ctr names it; every
#    layer is unpacked (none lazy); the staging directory is empty afterwards.
# 3. `ctr run --snapshotter ferry IMAGE` prints the image's default output, and a probe
#    of the merged tree (listing, contents, checksums, whiteout, opaque dir) equals the
#    same image pulled by `ctr image pull` and run on containerd's overlayfs snapshotter.
# 4. A second `ferry pull` finds every layer present and downloads nothing.
# 5. Bad input: a missing tag fails with a clear message and leaves no image, no lease,
#    no new snapshot and no staging leftovers; a missing --snapshotter-root is refused.
# 6. Lazily: the small image indexed (`ferry index`) on a ferry registry; `ferry pull`
#    mounts every layer over FUSE (one mount per layer under the snapshotter's root) and
#    containerd's content store gets no layer blob; `ctr run` prints the default output;
#    `ctr image rm --sync` lets containerd's garbage collector remove the snapshots (its
#    List and Remove carry no namespace) and every mount goes away. On containerd 2.x,
#    `ctr image pull --snapshotter ferry` (the transfer service) is lazy too, and its
#    removal releases the mounts as well.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), E2E_KEEP=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# once with the system containerd (1.6), once with containerd 2.x (lib.sh, containerd_flavours)
per_containerd "$0" "$@"

need_root "private containerd"
need_cmd containerd ctr runc docker-registry skopeo jq curl timeout
[[ -e /dev/fuse ]] || skip "no /dev/fuse"
find_ferry
e2e_init

small_image
require_ferry pull

start_ferry_snapshotter # SNAP_ROOT, SNAP_SOCK, SNAP_LOG (lib.sh)

start_registry
start_containerd_with_snapshotter ferry "$SNAP_SOCK"
REF=$REGISTRY/app/small:v1
push_oci "$SMALL" small app/small:v1 || e2e_die "skopeo push failed"

show() { sed 's/^/    | /' <<<"$1" | tail -"${2:-12}"; }
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
fpull() {
    set +e
    PULL_OUT=$(timeout 300 "$FERRY" pull --address "$CONTAINERD_SOCK" --namespace "$CTR_NAMESPACE" \
        --snapshotter ferry --snapshotter-root "$SNAP_ROOT" --plain-http "$@" 2>&1)
    PULL_RC=$?
    set -e
}
staging_left() { find "$SNAP_ROOT/staging" -mindepth 1 | wc -l; }
LAYERS=$(jq '.layers | length' <(oci_manifest "$SMALL" small))

# ---------------------------------------------------------------- 2. ferry pull
t0=$SECONDS
fpull "$REF"
if [[ $PULL_RC == 0 && $PULL_OUT == *"$LAYERS layers (0 lazy, $LAYERS unpacked, 0 already present)"* ]]; then
    pass "ferry pull: $(tail -1 <<<"$PULL_OUT") ($((SECONDS - t0))s)"
else
    fail "ferry pull: exit $PULL_RC"; show "$PULL_OUT"
fi
if ctr_ image ls -q | grep -xF "$REF" >/dev/null; then
    pass "image record named '$REF', as ctr names it"
else
    fail "no image record $REF: $(ctr_ image ls -q | tr '\n' ' ')"
fi
if [[ $(staging_left) == 0 ]]; then
    pass "staging directory empty after the pull (layers adopted, blobs removed)"
else
    fail "staging leftovers: $(find "$SNAP_ROOT/staging" -mindepth 1 | head -3 | tr '\n' ' ')"
fi
if grep -q 'adopted staged layer' "$SNAP_LOG"; then
    pass "the snapshotter adopted $(grep -c 'adopted staged layer' "$SNAP_LOG") staged layers"
else
    fail "snapshotter log has no adopted staged layer"
fi

# ---------------------------------------------------------------- 3. run + compare
run --rm --snapshotter ferry "$REF" "pulled-default-$$"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "ctr run --snapshotter ferry after ferry pull: '$OUT'"
else
    fail "ctr run --snapshotter ferry: exit $RC"; show "$OUT"
fi
OVL_REF=$REGISTRY/app/small-ovl:v1
push_oci "$SMALL" small app/small-ovl:v1 || e2e_die "skopeo push (overlay copy) failed"
ctr_ image pull --snapshotter overlayfs --plain-http "$OVL_REF" >"$E2E_TMP/pull-ovl.log" 2>&1 ||
    { show "$(cat "$E2E_TMP/pull-ovl.log")"; e2e_die "overlayfs pull failed"; }
PROBE='cd /; ls -lnA --full-time bin app data/sub data data/sub/dir etc tmp 2>&1; cat app/start.sh app/hello.txt data/overwritten.txt data/sub/dir/numbers.txt etc/passwd; sha256sum bin/busybox etc/motd; ls tmp/remove-me.txt 2>&1; find / -xdev | sort | md5sum; echo end'
probe overlayfs "$OVL_REF" "ovl-probe-$$"
OVL_OUT=$OUT
[[ $RC == 0 ]] || { show "$OVL_OUT"; e2e_die "overlayfs probe failed (exit $RC)"; }
probe ferry "$REF" "ferry-probe-$$"
if [[ $RC == 0 && $OUT == "$OVL_OUT" && $OUT == *"end" ]]; then
    pass "merged tree after ferry pull == ctr pull on overlayfs ($(wc -l <<<"$OUT") lines: listing with mtimes, contents, checksums, whiteouts, full file list)"
else
    fail "ferry-pulled tree differs from overlayfs (exit $RC)"
    diff <(echo "$OVL_OUT") <(echo "$OUT") | sed 's/^/    | /' | head -20 || true
fi
for key in $(ctr_ snapshots --snapshotter ferry ls | awk '$NF == "Committed" {print $1}'); do
    u=$(ctr_ snapshots --snapshotter ferry usage "$key" | awk 'NR == 2 {print $NF}')
    o=$(ctr_ snapshots --snapshotter overlayfs usage "$key" 2>/dev/null | awk 'NR == 2 {print $NF}')
    if [[ -n $u && $u == "$o" && $u != 0 ]]; then
        pass "usage of ${key:0:19}: $u inodes, as overlayfs counts"
    else
        fail "usage of $key: ferry '$u' overlayfs '$o'"
    fi
done

# ---------------------------------------------------------------- 4. pull again
fpull "$REF"
if [[ $PULL_RC == 0 && $PULL_OUT == *"0 unpacked, $LAYERS already present), 0 B downloaded"* ]]; then
    pass "second ferry pull: everything present, nothing downloaded"
else
    fail "second ferry pull: exit $PULL_RC"; show "$PULL_OUT"
fi

# ---------------------------------------------------------------- 5. bad input
SNAPS_BEFORE=$(ctr_ snapshots --snapshotter ferry ls | wc -l)
fpull "$REGISTRY/app/small:no-such-tag"
if [[ $PULL_RC != 0 && $PULL_OUT == *"not found"* ]]; then
    pass "missing tag refused: $(grep -m1 -i 'not found' <<<"$PULL_OUT" | cut -c1-120)"
else
    fail "missing tag: exit $PULL_RC"; show "$PULL_OUT"
fi
if ! ctr_ image ls -q | grep 'no-such-tag' >/dev/null && [[ -z $(ctr_ leases ls -q 2>/dev/null | grep ferry-pull || true) ]] &&
    [[ $(ctr_ snapshots --snapshotter ferry ls | wc -l) == "$SNAPS_BEFORE" && $(staging_left) == 0 ]]; then
    pass "failed pull left no image, lease, snapshot or staging file"
else
    fail "failed pull left something: images $(ctr_ image ls -q | tr '\n' ' ') leases $(ctr_ leases ls -q | tr '\n' ' ')"
fi
ctr_ image rm "$REF" >/dev/null 2>&1 || true
ctr_ snapshots --snapshotter ferry ls >/dev/null
fpull --snapshotter-root "$E2E_TMP/not-the-root" "$REGISTRY/app/small-ovl:v1"
if [[ $PULL_RC != 0 && $PULL_OUT == *"--snapshotter-root"* ]]; then
    pass "a wrong --snapshotter-root is refused with a hint"
elif [[ $PULL_RC == 0 && $PULL_OUT == *"already present"* ]]; then
    pass "layers already present: --snapshotter-root not needed (nothing to unpack)"
else
    fail "wrong --snapshotter-root: exit $PULL_RC"; show "$PULL_OUT"
fi
if [[ -z $(ctr_ leases ls -q 2>/dev/null | grep ferry-pull || true) ]]; then
    pass "no ferry-pull lease left behind"
else
    fail "leases left: $(ctr_ leases ls -q | tr '\n' ' ')"
fi

# ---------------------------------------------------------------- 6. lazily
# fuse_mounts: FUSE mounts under the snapshotter's root (the lazy layers)
fuse_mounts() {
    awk -v r="$(realpath -m "$SNAP_ROOT")/" 'index($5, r) == 1 {
        for (i = 7; i <= NF; i++) if ($i == "-") { if ($(i + 1) ~ /^fuse/) n++; break }
    } END { print n + 0 }' /proc/self/mountinfo
}
fuse_mounts_are() { [[ $(fuse_mounts) == "$1" ]]; }
ferry_snapshots() { ctr_ snapshots --snapshotter ferry ls | awk 'NR > 1 { print $1 }'; }
no_ferry_snapshots() { [[ -z $(ferry_snapshots) ]]; }
# the indexed image has the same layers (chain ids, blobs) as the one pulled above: start
# from an empty snapshotter and content store
# shellcheck disable=SC2046 # image names have no spaces
ctr_ image rm --sync $(ctr_ image ls -q) >/dev/null 2>&1 || true
wait_for 20 "snapshots collected" no_ferry_snapshots ||
    e2e_log "warning: snapshots left before the lazy pull: $(ferry_snapshots | tr '\n' ' ')"
FUSE_BEFORE=$(fuse_mounts)
publish_indexed_small lazy/small:v1 # IMG (indexed layout), IMAGE on a fresh ferry registry
t0=$SECONDS
fpull "$IMAGE"
if [[ $PULL_RC == 0 && $PULL_OUT == *"$LAYERS layers ($LAYERS lazy, 0 unpacked, 0 already present)"* ]]; then
    pass "ferry pull of the indexed image: $(tail -1 <<<"$PULL_OUT") ($((SECONDS - t0))s)"
else
    fail "ferry pull of the indexed image: exit $PULL_RC"; show "$PULL_OUT"
fi
if [[ $(fuse_mounts) == $((FUSE_BEFORE + LAYERS)) ]]; then
    pass "every layer is a FUSE mount under the snapshotter's root ($LAYERS)"
else
    fail "FUSE mounts under $SNAP_ROOT: $(fuse_mounts), want $((FUSE_BEFORE + LAYERS))"
fi
blobs=0
CONTENT=$(ctr_ content ls -q || true)
for l in $(oci_manifest "$IMG" small | jq -r '.layers[].digest'); do
    grep -xF "$l" <<<"$CONTENT" >/dev/null && blobs=$((blobs + 1))
done
# (the manifest and config are there: the listing itself worked)
if [[ $blobs == 0 && $CONTENT == *sha256:* ]]; then
    pass "no layer blob in containerd's content store: nothing downloaded or unpacked"
else
    fail "$blobs of $LAYERS layer blobs in containerd's content store"
fi
run --rm --snapshotter ferry "$IMAGE" "lazy-$$"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "ctr run --snapshotter ferry on the lazy layers: '$OUT'"
else
    fail "ctr run --snapshotter ferry on the lazy layers: exit $RC"; show "$OUT"
fi
set +e
RM_OUT=$(timeout 60 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" image rm --sync "$IMAGE" 2>&1)
RC=$?
set -e
if [[ $RC == 0 ]] && wait_for 20 "lazy layers released" fuse_mounts_are "$FUSE_BEFORE"; then
    pass "ctr image rm --sync: containerd's collector removed the lazy snapshots, every FUSE mount went away"
else
    fail "after ctr image rm --sync (exit $RC): $(fuse_mounts) FUSE mounts under $SNAP_ROOT, want $FUSE_BEFORE"
    show "$RM_OUT"
fi
# containerd 2.x's `ctr image pull` goes through the transfer service, which passes the
# image ref and layer labels to a snapshotter exporting enable_remote_snapshot_annotations
# (lib.sh containerd_add_proxy_snapshotter): lazy too (1.x's passes none: it downloads)
if ((CONTAINERD_MAJOR >= 2)); then
    set +e
    CP_OUT=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" image pull --plain-http \
        --snapshotter ferry "$IMAGE" 2>&1)
    RC=$?
    set -e
    if [[ $RC == 0 && $(fuse_mounts) == $((FUSE_BEFORE + LAYERS)) ]]; then
        pass "ctr image pull --snapshotter ferry (transfer service): every layer a FUSE mount"
    else
        fail "ctr image pull --snapshotter ferry (transfer service): exit $RC, $(fuse_mounts) FUSE mounts"
        show "$CP_OUT"
    fi
    timeout 60 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" image rm --sync "$IMAGE" >/dev/null 2>&1 || true
    if wait_for 20 "lazy layers released" fuse_mounts_are "$FUSE_BEFORE"; then
        pass "ctr image rm --sync after the transfer-service pull releases every FUSE mount"
    else
        fail "$(fuse_mounts) FUSE mounts left after ctr image rm --sync of the transfer-service pull"
    fi
fi
e2e_summary
