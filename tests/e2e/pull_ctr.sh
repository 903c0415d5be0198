#!/usr/bin/env bash
# tests/e2e/pull_ctr.sh — `ferry pull` into a real containerd with `ferry snapshotter`
# (needs root). The snapshotter runs with no lazy layers, so every layer takes the fast
# path: parallel Range download, unpack into the snapshotter's staging dir, adoption by a
# staged Prepare — exactly the path for images without an index.
#
#   bash tests/e2e/pull_ctr.sh
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
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), E2E_KEEP=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "private containerd"
need_cmd containerd ctr runc docker-registry skopeo jq curl timeout
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
run --rm --snapshotter overlayfs "$OVL_REF" "ovl-probe-$$" sh -c "$PROBE"
OVL_OUT=$OUT
[[ $RC == 0 ]] || { show "$OVL_OUT"; e2e_die "overlayfs probe failed (exit $RC)"; }
run --rm --snapshotter ferry "$REF" "ferry-probe-$$" sh -c "$PROBE"
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
e2e_summary
