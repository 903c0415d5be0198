#!/usr/bin/env bash
# `ferry pack DIR` versus `tar -cf - DIR | gzip -6` on the same directory, in one run.
# Usage: bash bench/pack.sh [DIR]   (default /usr: several GB of real files)
source "$(dirname "$0")/lib.sh"
ensure_ferry
DIR=${1:-/usr}
work=$(mktemp -d "${BENCH_TMP:-/var/tmp}/ferry-pack.XXXX"); trap 'rm -rf "$work"' EXIT
size=$(du -sb "$DIR" | cut -f1); files=$(find "$DIR" -xdev | wc -l)
tar -cf - "$DIR" 2>/dev/null | cat > /dev/null   # warm the page cache for both
echo "dir $DIR: $size bytes, $files entries, $(nproc) cores"
t=$(now); tar -cf - "$DIR" 2>/dev/null | gzip -6 > "$work/peer.tar.gz"; peer=$(since "$t")
t=$(now); "$FERRY" pack "$DIR" "oci:$work/img:packed" > "$work/ferry.txt"; ours=$(since "$t")
cat "$work/ferry.txt"
psize=$(stat -c %s "$work/peer.tar.gz")
fsize=$(layer_blobs "$work/img" packed | xargs stat -c %s)
printf '%-28s %8s s  %12s bytes\n' "tar | gzip -6" "$peer" "$psize" "ferry pack" "$ours" "$fsize"
echo "speedup: $(ratio "$peer" "$ours")x; size ratio ferry/gzip: $(ratio "$fsize" "$psize")"
