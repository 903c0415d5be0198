#!/usr/bin/env bash
# tests/e2e/image_runs.sh — smoke test: an OCI layout made by bench/make-image.sh
# really runs under (a private) containerd + runc and its /app/start.sh prints "ready".
#
#   bash tests/e2e/image_runs.sh                 # small image (tests/e2e/out/small:small)
#   bash tests/e2e/image_runs.sh bench/out/image ferry-bench   # big image (slow: ~1.2 GB)
#
# Path: skopeo oci:DIR:TAG -> private docker-registry -> ctr image pull --plain-http
# (unpacked by the overlayfs snapshotter) -> ctr run --rm.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "private containerd"
need_cmd containerd ctr runc docker-registry skopeo jq curl

DIR=${1:-$FERRY_ROOT/tests/e2e/out/small}
TAG=${2:-small}
if [[ $# == 0 && ! -f $DIR/index.json ]]; then
    SMALL_OUT=$DIR "$FERRY_ROOT/bench/make-image.sh" --small >/dev/null
fi
[[ -f $DIR/index.json ]] || e2e_die "no OCI layout at $DIR (run bench/make-image.sh)"

start_containerd
start_registry
REF=$REGISTRY/image-runs:$TAG
t0=$SECONDS
if push_oci "$DIR" "$TAG" "image-runs:$TAG"; then pass "skopeo push oci:$DIR:$TAG ($((SECONDS - t0))s)"; else fail "skopeo push"; fi
t0=$SECONDS
if ctr_ image pull --plain-http "$REF" >"$E2E_TMP/pull.log" 2>&1; then
    pass "ctr image pull --plain-http (pull + unpack $((SECONDS - t0))s)"
else
    fail "ctr image pull"; tail -5 "$E2E_TMP/pull.log"
fi
t0=$SECONDS
set +e
out=$(timeout 300 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm "$REF" "ferry-e2e-$$" 2>&1)
rc=$?
set -e
if [[ $rc == 0 && $out == *ready* ]]; then
    pass "ctr run $REF -> '$out' ($((SECONDS - t0))s)"
else
    fail "ctr run $REF: exit $rc, output: $out"
fi
e2e_summary
