#!/usr/bin/env bash
# `ferry index` versus `gzip -dc > /dev/null` on the same gzip layers, in one run.
# Prints per-tool wall time and the ratio; page cache warmed first for both.
# Usage: bash bench/index.sh   (IMG=… TAG=… to use another image)
source "$(dirname "$0")/lib.sh"
ensure_ferry; ensure_image
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
clone_layout "$IMG" "$work/img"
mapfile -t blobs < <(layer_blobs "$IMG" "$TAG")
total=$(cat "${blobs[@]}" | wc -c)  # also warms the page cache
echo "image $IMG:$TAG, ${#blobs[@]} layers, $total compressed bytes"

t=$(now); for b in "${blobs[@]}"; do gzip -dc "$b" > /dev/null; done; gz=$(since "$t")
t=$(now); RAYON_NUM_THREADS=1 "$FERRY" index "oci:$work/img:$TAG" > "$work/one.txt"; one=$(since "$t")
t=$(now); "$FERRY" index "oci:$work/img:$TAG" > "$work/all.txt"; all=$(since "$t")
tail -n 2 "$work/all.txt"
printf '%-36s %8s s\n' "gzip -dc > /dev/null (each layer)" "$gz" \
    "ferry index, 1 thread" "$one" "ferry index, all cores" "$all"
echo "speedup vs gzip -dc: 1 thread $(ratio "$gz" "$one")x, all cores $(ratio "$gz" "$all")x"
