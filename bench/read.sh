#!/usr/bin/env bash
# Random 4 KiB reads through the ferry index, per span size: the index blob (what a
# mount fetches and decodes whole) and the windows blob (fetched a window at a time) as
# shares of the layers, compressed bytes fetched per read (span + the window it needs,
# both counted), and latency p50/p99 from local blobs. Every read is cold: nothing is
# cached between reads, so each pays its span and its window.
# This is the measurement the default span is chosen by.
# Usage: bash bench/read.sh [SPANS_KIB...]   (default: 256 512 1024); SAMPLES=N reads
source "$(dirname "$0")/lib.sh"
ensure_ferry; ensure_image
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
spans=("$@"); [ ${#spans[@]} -gt 0 ] || spans=(256 512 1024)
layers=$(layer_blobs "$IMG" "$TAG" | xargs cat | wc -c)
# artifact_bytes LAYOUT MEDIA_TYPE: total size of that kind of blob in the layout's
# ferry index artifacts.
artifact_bytes() {
    jq -r '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] | startswith("sha256-")) | .digest' "$1/index.json" |
        while read -r d; do jq -r '.manifests[].digest' "$1/blobs/sha256/${d#sha256:}"; done |
        while read -r a; do jq -r --arg m "$2" '.layers[] | select(.mediaType == $m) | .size' "$1/blobs/sha256/${a#sha256:}"; done |
        awk '{ s += $1 } END { print s + 0 }'
}
pct() { awk -v a="$1" -v b="$layers" 'BEGIN { printf "%.2f", 100 * a / b }'; }
printf '%-8s %12s %7s %12s %8s %10s %10s %10s %9s %9s\n' \
    span index index% windows win% bytes_p50 bytes_p99 bytes_mean p50_ms p99_ms
for s in "${spans[@]}"; do
    clone_layout "$IMG" "$work/s$s"
    "$FERRY" index --span $((s << 10)) "oci:$work/s$s:$TAG" > "$work/s$s.txt"
    idx=$(artifact_bytes "$work/s$s" application/vnd.ferry.layer.index.v1)
    win=$(artifact_bytes "$work/s$s" application/vnd.ferry.layer.windows.v1)
    j=$("$FERRY" bench read --json --samples "${SAMPLES:-2000}" "oci:$work/s$s:$TAG")
    printf '%-8s %12s %6s%% %12s %7s%% %10s %10s %10.0f %9.3f %9.3f\n' "${s}KiB" \
        "$idx" "$(pct "$idx")" "$win" "$(pct "$win")" \
        "$(jq .bytes_p50 <<<"$j")" "$(jq .bytes_p99 <<<"$j")" "$(jq .bytes_mean <<<"$j")" \
        "$(jq .p50_ms <<<"$j")" "$(jq .p99_ms <<<"$j")"
    rm -rf "$work/s$s"
done
