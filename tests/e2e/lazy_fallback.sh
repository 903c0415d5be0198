#!/usr/bin/env bash
# tests/e2e/lazy_fallback.sh — an image the lazy path cannot serve falls back to the
# ordinary download-and-unpack for that image only, and says why (issue 14). Needs root;
# runs once with the system's containerd (1.6) and once with containerd 2.x (lib.sh
# per_containerd).
#
#   bash tests/e2e/lazy_fallback.sh     (E2E_CONTAINERD=system or =2: one version only)
#
# One `ferry daemon` (snapshotter on, control socket, metrics) and a private containerd
# with ferry as its proxy snapshotter; ferry's registry holds three images:
#   lazy/small:v1  the small image, indexed (`ferry index`, pushed with `ferry copy`)
#   plain/one:v1   a one-layer image built here from the small image's files plus a file
#                  of its own (so its chain id is its own), pushed without an index
#   plain/two:v1   the same with another file
# 1. `ctr image pull --snapshotter ferry plain/one:v1`: containerd's own pull. It runs
#    (`ready plain`) and `ferry status --json` names it: on 2.x (the transfer service
#    passes the image labels) with reason `no-index`; on 1.6 not at all (`ctr` unpacks
#    without even the target label, so the snapshotter is never asked for a lazy layer).
# 2. `ferry pull plain/two:v1`: summary "1 unpacked", runs, status names it with reason
#    `no-index`, 1 layer, its manifest digest; the snapshotter's log has the line with
#    image, layer, reason and the hint (`ferry index`); `ferry status` (table) shows the
#    "not lazy" section; /metrics counts `ferry_not_lazy_layers_total{reason="no-index"}`.
# 3. In the same daemon `ferry pull lazy/small:v1` is lazy: summary "2 lazy", one FUSE
#    mount per layer under the snapshotter's root, it runs, and status does not list it.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), E2E_KEEP=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
per_containerd "$0" "$@"

need_root "private containerd, FUSE mounts"
need_cmd containerd ctr runc jq curl python3 tar timeout
[[ -e /dev/fuse ]] || skip "no /dev/fuse"
find_ferry
e2e_init
small_image
require_ferry pull

METRICS_PORT=$(free_port)
lazy_snapshotter_daemon "[metrics]
addr = \"127.0.0.1:$METRICS_PORT\"
" # SNAP_SOCK, SNAP_ROOT, SNAP_LOG, CTL_SOCK (lib.sh)
start_containerd_with_snapshotter ferry "$SNAP_SOCK"
publish_indexed_small lazy/small:v1 # IMAGE on a fresh ferry registry at REG_ADDR

# plain_image NAME: a one-layer image at $E2E_TMP/NAME (tag NAME) with the small image's
# files, /app/start.sh printing "ready plain" and /app/NAME.txt, pushed to
# $REG_ADDR/plain/NAME:v1 without an index
plain_image() {
    local name=$1 root=$E2E_TMP/$1-root
    oci_extract "$SMALL" small "$root"
    printf '#!/bin/sh\necho "ready plain"\n' >"$root/app/start.sh"
    chmod 755 "$root/app/start.sh"
    printf 'only in %s\n' "$name" >"$root/app/$name.txt"
    python3 "$FERRY_ROOT/bench/oci-layout.py" write --out "$E2E_TMP/$name" --tag "$name" \
        --cmd '["/app/start.sh"]' --env PATH=/bin "$root" >"$E2E_TMP/$name-write.log" 2>&1 ||
        { show "$E2E_TMP/$name-write.log"; e2e_die "writing the $name image failed"; }
    fy "$E2E_TMP/$name-cp.out" "$E2E_TMP/$name-cp.err" copy "oci:$E2E_TMP/$name:$name" \
        "$REG_ADDR/plain/$name:v1"
    [[ $RC == 0 ]] || { show "$E2E_TMP/$name-cp.err"; e2e_die "ferry copy of $name failed"; }
}
plain_image one
plain_image two
ONE=$REG_ADDR/plain/one:v1
TWO=$REG_ADDR/plain/two:v1

showv() { sed 's/^/    | /' <<<"$1" | tail -"${2:-12}"; }
run() {
    set +e
    OUT=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm --snapshotter ferry "$@" 2>&1)
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
status_json() { timeout 30 "$FERRY" status --json --socket "$CTL_SOCK"; }
# fuse_mounts: FUSE mounts under the snapshotter's root (the lazy layers)
fuse_mounts() {
    awk -v r="$(realpath -m "$SNAP_ROOT")/" 'index($5, r) == 1 {
        for (i = 7; i <= NF; i++) if ($i == "-") { if ($(i + 1) ~ /^fuse/) n++; break }
    } END { print n + 0 }' /proc/self/mountinfo
}

# ---------------------------------------------------------------- 1. containerd's own pull
set +e
CP_OUT=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" image pull --plain-http \
    --snapshotter ferry "$ONE" 2>&1)
RC=$?
set -e
if [[ $RC == 0 && $(fuse_mounts) == 0 ]]; then
    pass "ctr image pull --snapshotter ferry of the unindexed image: unpacked, no FUSE mount"
else
    fail "ctr image pull of $ONE: exit $RC, $(fuse_mounts) FUSE mounts"; showv "$CP_OUT"
fi
run "$ONE" "one-$$"
if [[ $RC == 0 && $OUT == "ready plain" ]]; then
    pass "the image containerd unpacked runs: '$OUT'"
else
    fail "ctr run $ONE: exit $RC"; showv "$OUT"
fi
status_json >"$E2E_TMP/status1.json" 2>"$E2E_TMP/status1.err" || true
if ((CONTAINERD_MAJOR >= 2)); then
    # the transfer service passes the image reference (lib.sh exports the annotations)
    want='.image != null and (.image | contains("plain/one")) and .reason == "no-index"'
    what="named with reason no-index"
    count=1
else
    # containerd 1.6's ctr unpacks client-side without even the target label: the
    # snapshotter is never told this is an image layer, so there is nothing to record
    want='true'
    what="nothing recorded (ctr 1.6 does not say the Prepare is an image layer's)"
    count=0
fi
if jq -e "[.not_lazy.images[] | select($want)] | length == $count" "$E2E_TMP/status1.json" >/dev/null 2>&1; then
    pass "ferry status --json after containerd's pull: $what"
else
    fail "ferry status --json after containerd's pull: want $what"
    show "$E2E_TMP/status1.json" 30
    show "$E2E_TMP/status1.err"
fi

# ---------------------------------------------------------------- 2. ferry pull, no index
fpull "$TWO"
if [[ $PULL_RC == 0 && $PULL_OUT == *"1 layers (0 lazy, 1 unpacked, 0 already present)"* ]]; then
    pass "ferry pull of the unindexed image: $(tail -1 <<<"$PULL_OUT")"
else
    fail "ferry pull $TWO: exit $PULL_RC"; showv "$PULL_OUT"
fi
run "$TWO" "two-$$"
if [[ $RC == 0 && $OUT == "ready plain" ]]; then
    pass "the image ferry pull unpacked runs: '$OUT'"
else
    fail "ctr run $TWO: exit $RC"; showv "$OUT"
fi
# (ferry copy keeps the layout's manifest as it is)
TWO_MANIFEST=$(jq -r '.manifests[0].digest' "$E2E_TMP/two/index.json")
status_json >"$E2E_TMP/status2.json" 2>"$E2E_TMP/status2.err" || true
entry=$(jq -c --arg i "$TWO" '.not_lazy.images[] | select(.image == $i)' "$E2E_TMP/status2.json" 2>/dev/null || true)
if [[ -n $entry ]] && jq -e --arg m "$TWO_MANIFEST" \
    '.reason == "no-index" and .layers == 1 and .reasons["no-index"] == 1 and .manifest_digest == $m and (.hint | contains("ferry index"))' \
    <<<"$entry" >/dev/null; then
    pass "ferry status --json names $TWO: reason no-index, 1 layer, manifest ${TWO_MANIFEST:7:12}, hint"
else
    fail "ferry status --json entry for $TWO (manifest $TWO_MANIFEST): ${entry:-none}"
    show "$E2E_TMP/status2.json" 30
fi
LINE=$(grep 'layer not served lazily' "$SNAP_LOG" | grep -F "$TWO" | grep -F 'no-index' | tail -1 || true)
TWO_LAYER=$(oci_manifest "$E2E_TMP/two" two | jq -r '.layers[0].digest')
if [[ -n $LINE && $LINE == *"$TWO_LAYER"* && $LINE == *"ferry index"* ]]; then
    pass "the snapshotter's log says image, layer, reason and what to do: $(cut -c1-160 <<<"$LINE")…"
else
    fail "no log line with $TWO, its layer $TWO_LAYER, no-index and the hint in $SNAP_LOG"
    grep 'not served lazily' "$SNAP_LOG" | tail -3 | sed 's/^/    | /' || true
fi
TABLE=$(timeout 30 "$FERRY" status --socket "$CTL_SOCK" 2>&1 || true)
if grep -q '^not lazy: ' <<<"$TABLE" && grep -F "$TWO" <<<"$TABLE" | grep -q 'no-index'; then
    pass "ferry status shows the not-lazy section with the image and its reason"
else
    fail "ferry status has no not-lazy line for $TWO"; showv "$TABLE" 20
fi
curl -fsS --noproxy '*' --max-time 5 "http://127.0.0.1:$METRICS_PORT/metrics" >"$E2E_TMP/metrics.txt" 2>/dev/null || true
# containerd 2.x's pull of plain/one counted one no-index layer too
want_metric=1
((CONTAINERD_MAJOR >= 2)) && want_metric=2
if grep -qx "ferry_not_lazy_layers_total{reason=\"no-index\"} $want_metric" "$E2E_TMP/metrics.txt"; then
    pass "/metrics: ferry_not_lazy_layers_total{reason=\"no-index\"} $want_metric"
else
    fail "/metrics: want ferry_not_lazy_layers_total{reason=\"no-index\"} $want_metric"
    grep 'not_lazy' "$E2E_TMP/metrics.txt" | sed 's/^/    | /' || true
fi

# ---------------------------------------------------------------- 3. the indexed image, same run
LAYERS=$(jq '.layers | length' <(oci_manifest "$IMG" small))
FUSE_BEFORE=$(fuse_mounts)
fpull "$IMAGE"
if [[ $PULL_RC == 0 && $PULL_OUT == *"$LAYERS layers ($LAYERS lazy, 0 unpacked, 0 already present)"* ]]; then
    pass "ferry pull of the indexed image in the same daemon: $(tail -1 <<<"$PULL_OUT")"
else
    fail "ferry pull $IMAGE: exit $PULL_RC"; showv "$PULL_OUT"
fi
if [[ $(fuse_mounts) == $((FUSE_BEFORE + LAYERS)) ]]; then
    pass "every layer of the indexed image is a FUSE mount under the snapshotter's root ($LAYERS)"
else
    fail "FUSE mounts under $SNAP_ROOT: $(fuse_mounts), want $((FUSE_BEFORE + LAYERS))"
fi
run "$IMAGE" "lazy-$$"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "the lazy image runs: '$OUT'"
else
    fail "ctr run $IMAGE: exit $RC"; showv "$OUT"
fi
status_json >"$E2E_TMP/status3.json" 2>/dev/null || true
if jq -e '[.not_lazy.images[] | select(.image != null and (.image | contains("lazy/small")))] | length == 0' \
    "$E2E_TMP/status3.json" >/dev/null 2>&1 &&
    jq -e --arg i "$TWO" '[.not_lazy.images[] | select(.image == $i)] | length == 1' "$E2E_TMP/status3.json" >/dev/null 2>&1; then
    pass "status lists the unindexed images only, not the lazy one"
else
    fail "status after the lazy pull:"; show "$E2E_TMP/status3.json" 30
fi

# the lazy layers go with their image (nothing left mounted for the trap to find)
for ref in "$IMAGE" "$ONE" "$TWO"; do
    timeout 60 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" image rm --sync "$ref" >/dev/null 2>&1 || true
done
e2e_summary
