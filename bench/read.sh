#!/usr/bin/env bash
# Random 4 KiB reads through the ferry index, per span size: index size as a share of
# the layers, compressed bytes fetched per read, and latency p50/p99 from local blobs.
# This is the measurement the default span is chosen by.
# Usage: bash bench/read.sh [SPANS...]   (default: 1 2 4 8 MiB)
source "$(dirname "$0")/lib.sh"
ensure_ferry; ensure_image
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
spans=("$@"); [ ${#spans[@]} -gt 0 ] || spans=(1 2 4 8)
layers=$(layer_blobs "$IMG" "$TAG" | xargs cat | wc -c)
printf '%-8s %12s %8s %10s %10s %10s %9s %9s\n' span index index% bytes_p50 bytes_p99 bytes_mean p50_ms p99_ms
for s in "${spans[@]}"; do
    clone_layout "$IMG" "$work/s$s"
    "$FERRY" index --span $((s << 20)) "oci:$work/s$s:$TAG" > "$work/s$s.txt"
    idx=$(jq -r '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] | startswith("sha256-")) | .digest' "$work/s$s/index.json" |
        while read -r d; do jq -r '.manifests[].digest' "$work/s$s/blobs/sha256/${d#sha256:}"; done |
        while read -r a; do jq -r '.layers[].size' "$work/s$s/blobs/sha256/${a#sha256:}"; done | paste -sd+ | bc)
    j=$("$FERRY" bench read --json --samples "${SAMPLES:-2000}" "oci:$work/s$s:$TAG")
    printf '%-8s %12s %7.2f%% %10s %10s %10.0f %9.3f %9.3f\n' "${s}MiB" "$idx" "$(awk -v a="$idx" -v b="$layers" 'BEGIN{print 100*a/b}')" \
        "$(jq .bytes_p50 <<<"$j")" "$(jq .bytes_p99 <<<"$j")" "$(jq .bytes_mean <<<"$j")" "$(jq .p50_ms <<<"$j")" "$(jq .p99_ms <<<"$j")"
done
