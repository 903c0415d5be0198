#!/usr/bin/env bash
# bench/pull.sh — the ordinary (unindexed) pull, ferry's fast path against containerd's:
#
#   (a) containerd: `ctr image pull` (overlayfs) + `ctr run`: fetch every layer, then
#       unpack them one after another through the diff service
#   (b) ferry: `ferry pull` + `ctr run --snapshotter ferry`: each layer downloaded with
#       parallel Range requests and unpacked into the snapshotter's staging directory at
#       the same time (the unpacker consumes the in-order prefix while later pieces are
#       still landing; --unpack-concurrency layers at once, largest first; at most
#       --max-buffer bytes held), then adopted in chain order
#
# The image ($IMG:$TAG, default the 1.2 GB Debian layout from bench/make-image.sh) is
# pushed with skopeo to a private docker-registry without any ferry index, so nothing is
# lazy: this measures the path every unindexed image takes. Each phase gets a fresh
# containerd root and, for ferry, a fresh daemon and snapshotter root. Prints seconds per
# phase (pull, run, total), bytes ferry downloaded, its peak buffer and peak RSS (GNU
# time), and the ratio (a)/(b).
#
#   bench/pull.sh [RUNS]        RUNS rounds (default 1); medians are reported
#
# Env: IMG, TAG, START_CMD (default /app/start.sh), CONCURRENCY (default 10),
# CHUNK (default 16M), MAX_BUFFER (default 256M), UNPACK (default: ferry's, the CPUs),
# OUT (default bench/out/pull), SKIP_BUILD=1 (use $FERRY as it is, no cargo build).
# Needs root, containerd, runc, docker-registry, skopeo, GNU time.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"
# shellcheck source=bench/lib-containerd.sh
source "$HERE/lib-containerd.sh"

RUNS=${1:-1}
START_CMD=${START_CMD:-/app/start.sh}
CONCURRENCY=${CONCURRENCY:-10}
CHUNK=${CHUNK:-16M}
MAX_BUFFER=${MAX_BUFFER:-256M}
UNPACK=${UNPACK:-}
OUT=${OUT:-$BENCH_ROOT/bench/out/pull}
mkdir -p "$OUT"
loopback_only
need_root "containerd"
need_cmd containerd ctr runc docker-registry skopeo jq /usr/bin/time
[[ ${SKIP_BUILD:-} == 1 ]] || ensure_ferry
ensure_image
e2e_init

start_registry >/dev/null
REF=$REGISTRY/bench/pull:$TAG
echo "pushing $IMG:$TAG to $REF (no ferry index)"
push_oci "$IMG" "$TAG" "bench/pull:$TAG" || e2e_die "skopeo push failed"
SIZE=$(jq '[.layers[].size] | add' <(oci_manifest "$IMG" "$TAG"))
LAYERS=$(jq '.layers | length' <(oci_manifest "$IMG" "$TAG"))
echo "image: $LAYERS layers, $SIZE compressed bytes"

run_start() { # SNAPSHOTTER
    CTR_ID=$((CTR_ID + 1))
    timeout 600 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm --snapshotter "$1" "$REF" \
        "bench-pull-$CTR_ID" sh -c "$START_CMD" >"$E2E_TMP/run.out" 2>&1 ||
        { tail -5 "$E2E_TMP/run.out" >&2; e2e_die "ctr run ($1) failed"; }
}

: >"$OUT/ctr.txt"
: >"$OUT/ferry.txt"
for round in $(seq "$RUNS"); do
    # (a) containerd's own pull
    stop_daemon
    fresh_containerd
    sync
    echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
    T0=$(now)
    ctr_ image pull --plain-http "$REF" >"$E2E_TMP/ctr-pull.log" 2>&1 ||
        { tail -5 "$E2E_TMP/ctr-pull.log" >&2; e2e_die "ctr image pull failed"; }
    pull_s=$(since "$T0")
    T1=$(now)
    run_start overlayfs
    run_s=$(since "$T1")
    total=$(since "$T0")
    echo "$pull_s $run_s $total" >>"$OUT/ctr.txt"
    echo "round $round (a) ctr image pull + ctr run: pull ${pull_s}s run ${run_s}s total ${total}s"

    # (b) ferry pull, fast path
    rm -rf "$E2E_TMP/ferry"
    start_daemon "$E2E_TMP/ferry/store" "$(printf '[warm]\nprefetch = false\nbackground_fill = false')"
    fresh_containerd "$E2E_TMP/ferry/run/snapshotter.sock"
    sync
    echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
    T0=$(now)
    /usr/bin/time -f 'max_rss_kb=%M' -o "$E2E_TMP/ferry-pull.time" \
        "$FERRY" pull --address "$CONTAINERD_SOCK" --namespace "$CTR_NAMESPACE" --plain-http \
        --snapshotter ferry --snapshotter-root "$E2E_TMP/ferry/snapshotter" \
        --concurrency "$CONCURRENCY" --chunk-size "$CHUNK" --max-buffer "$MAX_BUFFER" \
        ${UNPACK:+--unpack-concurrency "$UNPACK"} "$REF" >"$E2E_TMP/ferry-pull.log" 2>&1 ||
        { tail -5 "$E2E_TMP/ferry-pull.log" >&2; e2e_die "ferry pull failed"; }
    pull_s=$(since "$T0")
    T1=$(now)
    run_start ferry
    run_s=$(since "$T1")
    total=$(since "$T0")
    rss=$(sed -n 's/.*max_rss_kb=\([0-9]*\).*/\1/p' "$E2E_TMP/ferry-pull.time")
    echo "$pull_s $run_s $total ${rss:-0}" >>"$OUT/ferry.txt"
    echo "round $round (b) ferry pull + ctr run:      pull ${pull_s}s run ${run_s}s total ${total}s"
    echo "    $(tail -1 "$E2E_TMP/ferry-pull.log"); ferry pull $(cat "$E2E_TMP/ferry-pull.time")"
done
stop_daemon
stop_containerd >/dev/null 2>&1 || true

ctr_total=$(awk '{print $3}' "$OUT/ctr.txt" | median)
ferry_total=$(awk '{print $3}' "$OUT/ferry.txt" | median)
ctr_pull=$(awk '{print $1}' "$OUT/ctr.txt" | median)
ferry_pull=$(awk '{print $1}' "$OUT/ferry.txt" | median)
ferry_rss=$(awk '{print $4}' "$OUT/ferry.txt" | median)
echo
echo "median of $RUNS: ctr pull+run ${ctr_total}s (pull ${ctr_pull}s), ferry pull+run ${ferry_total}s (pull ${ferry_pull}s)"
echo "ratio ctr/ferry: total $(ratio "$ctr_total" "$ferry_total")x, pull $(ratio "$ctr_pull" "$ferry_pull")x"
jq -n --arg ct "$ctr_total" --arg ft "$ferry_total" --arg cp "$ctr_pull" --arg fp "$ferry_pull" --arg rss "$ferry_rss" \
    --argjson layers "$LAYERS" --argjson size "$SIZE" --argjson runs "$RUNS" \
    '{image_layers: $layers, image_bytes: $size, runs: $runs, ctr_total_s: ($ct|tonumber), ferry_total_s: ($ft|tonumber), ctr_pull_s: ($cp|tonumber), ferry_pull_s: ($fp|tonumber), ferry_max_rss_kb: ($rss|tonumber)}' >"$OUT/results.json"
echo "results: $OUT/results.json"
