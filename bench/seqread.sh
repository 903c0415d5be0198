#!/usr/bin/env bash
# Sequential read of one big, fully cached file through ferry versus the same file on
# the native disk, page cache dropped before every read, in three configurations of the
# same mount code (crates/fs/examples/seqmount.rs):
#   off          no file cache: every read inflates spans from the chunk store;
#   pread        file cache, no passthrough: reads answered with pread from the cached file;
#   passthrough  file cache + FUSE passthrough: reads never reach the ferry process.
# Usage (root): bash bench/seqread.sh   (env: SIZE_MIB=1024 RUNS=3 MODES="off pread passthrough";
#               NO_BUILD=1 uses the binaries already in target/release)
# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh"

SIZE_MIB=${SIZE_MIB:-1024}
RUNS=${RUNS:-3}
MODES=${MODES:-"off pread passthrough"}
OUT=$BENCH_ROOT/bench/out/seqread
SEQMOUNT=$BENCH_ROOT/target/release/examples/seqmount
[ "$(id -u)" = 0 ] || { echo "seqread.sh needs root (FUSE mounts, drop_caches)" >&2; exit 1; }

if [ "${NO_BUILD:-0}" != 1 ]; then
    [ -x "$FERRY" ] || ensure_ferry
    cargo build --release -q -p ferry-fs --example seqmount
fi

# ---- input: one layer holding big.bin, half random and half text per MiB (gzip still
# has work to do, and inflating it costs what real binaries cost).
mkdir -p "$OUT"
if [ ! -f "$OUT/image/index.json" ] || [ "$(cat "$OUT/size" 2>/dev/null)" != "$SIZE_MIB" ]; then
    rm -rf "$OUT/layer" "$OUT/image"
    mkdir -p "$OUT/layer"
    python3 - "$OUT/layer/big.bin" "$SIZE_MIB" <<'PY'
import os, sys
path, mib = sys.argv[1], int(sys.argv[2])
words = b"the quick brown fox jumps over the lazy dog while ferry reads spans; " * 64
text = (words * (1 + (512 << 10) // len(words)))[: 512 << 10]
with open(path, "wb") as f:
    for i in range(mib):
        f.write(os.urandom(512 << 10))
        f.write(text[i % 97:] + text[: i % 97])
PY
    python3 "$BENCH_ROOT/bench/oci-layout.py" write --out "$OUT/image" --tag seq "$OUT/layer" >/dev/null
    "$FERRY" index "oci:$OUT/image:seq" >/dev/null
    echo "$SIZE_MIB" >"$OUT/size"
fi
NATIVE=$OUT/layer/big.bin
BYTES=$(stat -c %s "$NATIVE")
SUM=$(sha256sum "$NATIVE" | cut -d' ' -f1)

drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }
timed_cat() { local t; drop; t=$(now); cat "$1" >/dev/null; since "$t"; }
stat_of() { jq -r "$2" "$1" 2>/dev/null || echo 0; }

declare -A FERRY_T NATIVE_T NOTE
for mode in $MODES; do
    mnt=$OUT/mnt-$mode store=$OUT/store-$mode stats=$OUT/stats-$mode.json
    mountpoint -q "$mnt" 2>/dev/null && umount "$mnt"
    rm -rf "$store" "$stats"; mkdir -p "$mnt"
    "$SEQMOUNT" "oci:$OUT/image:seq" "$mnt" --store "$store" --file-cache "$mode" --stats "$stats" \
        2>"$OUT/seqmount-$mode.log" &
    pid=$!
    for _ in $(seq 100); do mountpoint -q "$mnt" && break; sleep 0.1; done
    mountpoint -q "$mnt" || { cat "$OUT/seqmount-$mode.log" >&2; exit 1; }
    # Fill: the first read fetches every span into the chunk store (and, with a file
    # cache, queues the file for materialization once read in full).
    t=$(now); got=$(sha256sum "$mnt/big.bin" | cut -d' ' -f1); fill=$(since "$t")
    [ "$got" = "$SUM" ] || { echo "FAIL $mode: wrong bytes through ferry" >&2; exit 1; }
    if [ "$mode" != off ]; then
        t=$(now)
        for _ in $(seq 1200); do
            [ "$(stat_of "$stats" .file_cache.materialized)" -ge 1 ] && break; sleep 0.1
        done
        [ "$(stat_of "$stats" .file_cache.materialized)" -ge 1 ] || { echo "FAIL $mode: not materialized" >&2; exit 1; }
        echo "$mode: first read ${fill}s, materialized $(since "$t")s later" >&2
    else
        echo "$mode: first read ${fill}s" >&2
    fi
    sleep 0.5 # let the fill read's release reach the daemon
    reqs0=$(stat_of "$stats" .read_requests)
    ft=() nt=()
    for _ in $(seq "$RUNS"); do
        ft+=("$(timed_cat "$mnt/big.bin")")
        nt+=("$(timed_cat "$NATIVE")")
    done
    sleep 0.3
    reqs=$(( $(stat_of "$stats" .read_requests) - reqs0 ))
    FERRY_T[$mode]="${ft[*]}" NATIVE_T[$mode]="${nt[*]}"
    NOTE[$mode]="FUSE reads during timed runs: $reqs; passthrough opens: $(stat_of "$stats" .file_cache.passthrough_opens); pread opens: $(stat_of "$stats" .file_cache.pread_opens)"
    got=$(sha256sum "$mnt/big.bin" | cut -d' ' -f1)
    [ "$got" = "$SUM" ] || { echo "FAIL $mode: wrong bytes on reread" >&2; exit 1; }
    kill -TERM "$pid"; wait "$pid" || true
    rm -rf "$store"
done

median() { tr ' ' '\n' | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
mibs() { awk -v b="$BYTES" -v t="$1" 'BEGIN { printf "%.0f", b / 1048576 / t }'; }
echo
echo "file: $(awk -v b="$BYTES" 'BEGIN { printf "%.2f GiB", b / 1073741824 }'), $RUNS runs per side, page cache dropped before each read"
printf '| %-11s | %-22s | %-22s | %9s | %9s | %s |\n' mode "ferry s (runs)" "native s (runs)" "ferry MiB/s" "native MiB/s" "x native (median)"
printf '|---|---|---|---:|---:|---:|\n'
for mode in $MODES; do
    fm=$(echo "${FERRY_T[$mode]}" | median) nm=$(echo "${NATIVE_T[$mode]}" | median)
    printf '| %-11s | %-22s | %-22s | %9s | %9s | %s |\n' "$mode" "${FERRY_T[$mode]}" "${NATIVE_T[$mode]}" \
        "$(mibs "$fm")" "$(mibs "$nm")" "$(ratio "$nm" "$fm")"
done
for mode in $MODES; do echo "$mode: ${NOTE[$mode]}"; done
