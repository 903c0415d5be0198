#!/usr/bin/env bash
# tests/e2e/seed_store.sh — issue 17's read-only seed store: `[store] seed = PATH`, a
# `ferry store export` directory used in place under the live store.
#
#   bash tests/e2e/seed_store.sh
#
# Setup: the small image, indexed in 64 KiB spans, pushed to a `ferry registry serve` on
# loopback (publish_indexed_small); its tree extracted normally as the reference.
#
# 1. Bake: `ferry prewarm --full --no-daemon` into a store of its own, `ferry store
#    export` of it: the seed. Its files are made read-only (chmod -R a-w) and it is
#    used through a read-only bind mount, so any write would fail (EROFS, also for
#    root); a checksum of the whole directory (paths, modes, sizes, mtimes, contents) is
#    taken. `ferry store --seed` shows it (du) and hashes it (verify) without writing;
#    a directory that is not an export is refused by `ferry store --seed` and by the
#    daemon, both saying what a seed must be.
# 2. A corrupted seed (a copy with every object's first byte flipped), registry up: a
#    daemon on it with an empty live store reads every file of the image right; the
#    seed's objects are counted corrupt (status and /metrics), none served, and what was
#    fetched instead went to the live store.
# 3. The registry's layer blobs zeroed (same sizes, registry restarted on its address:
#    manifest and ferry index still served, any layer byte fetched fails verification):
#    a fresh daemon with the good seed and an empty live store mounts the image from the
#    registry and reads every file right, with no fetch error; the live store holds no
#    chunk; status and /metrics show seed hits and bytes served.
# 4. The seed directory is unchanged (checksum before = after).
#
# Env: FERRY, FERRY_TIMEOUT (120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

mount_prologue cmp truncate sha256sum
require_ferry prewarm

is_mounted() { grep -q " $1 " /proc/self/mountinfo; }
# seed_sum DIR: every path with type, mode, size and mtime, then every file's sha256
seed_sum() {
    (cd "$1" && find . -printf '%p %y %m %s %T@\n' | LC_ALL=C sort &&
        find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
}
chunk_files() { find "$1/chunks" -type f 2>/dev/null | wc -l; }
# metric TEXT NAME: the value of an unlabelled series, 0 when absent
metric() { awk -v n="$2" '$1 == n {print $2; found = 1} END {if (!found) print 0}' "$1"; }

# ---------------------------------------------------------------- setup
echo "# setup: indexed small image in a ferry registry, reference tree"
publish_indexed_small e2e/seed:v1 # IMG, REG_ADDR, IMAGE
reference_tree "$IMG"

# daemon_config FILE LIVE SEED SOCKET [METRICS_PORT]
daemon_config() {
    cat >"$1" <<TOML
[store]
path = "$2"
seed = "$3"
[control]
socket = "$4"
[snapshotter]
enabled = false
[warm]
prefetch = false
background_fill = false
[trace]
auto_record = false
TOML
    if [[ -n ${5:-} ]]; then
        printf '[metrics]\naddr = "127.0.0.1:%s"\n' "$5" >>"$1"
    fi
}

# mount_with_seed N SEED OK FAIL: a fresh daemon N (live store live<N>, metrics port
# MPORT<N>, config CFG<N>) over seed store SEED mounts the image at MNT<N>; passes with
# OK when every file reads as in the reference tree, fails with FAIL otherwise.
mount_with_seed() {
    local n=$1 cfg=$E2E_TMP/daemon$1.toml mnt=$E2E_TMP/mnt$1 port
    port=$(free_port)
    printf -v "MPORT$n" %s "$port"
    printf -v "CFG$n" %s "$cfg"
    printf -v "LIVE$n" %s "$E2E_TMP/live$n"
    printf -v "MNT$n" %s "$mnt"
    daemon_config "$cfg" "$E2E_TMP/live$n" "$2" "$E2E_TMP/run$n/daemon.sock" "$port"
    daemon_start "$cfg" "$E2E_TMP/daemon$n.log" || { show "$E2E_TMP/daemon$n.log"; e2e_die "daemon $n did not start"; }
    mkdir -p "$mnt"
    fy "$E2E_TMP/m$n.out" "$E2E_TMP/m$n.err" mount --config "$cfg" "$IMAGE" "$mnt"
    if [[ $RC == 0 ]] && is_mounted "$mnt" && tree_equals_ref "$mnt" "$E2E_TMP/mnt$n.sums"; then
        pass "$3 ($(wc -l <"$E2E_TMP/mnt$n.sums") files)"
    else
        fail "$4: mount exit $RC"
        show "$E2E_TMP/m$n.err"
        show "$E2E_TMP/mnt$n.sums.err"
        show "$E2E_TMP/daemon$n.log"
    fi
}

# ---------------------------------------------------------------- 1. bake
echo "# 1. bake a seed: prewarm --full, export, read-only"
BAKE=$E2E_TMP/bake
cat >"$E2E_TMP/bake.toml" <<TOML
[store]
path = "$BAKE"
[control]
socket = "$E2E_TMP/run-bake/daemon.sock"
TOML
fy "$E2E_TMP/pw.out" "$E2E_TMP/pw.err" prewarm --config "$E2E_TMP/bake.toml" --no-daemon --full --json "$IMAGE"
FETCHED=$(jq -s 'map(.report.fetched_bytes) | add // 0' "$E2E_TMP/pw.out" 2>/dev/null || echo 0)
if [[ $RC == 0 ]] && ((FETCHED > 0)); then
    pass "prewarm --full filled the bake store ($FETCHED bytes fetched)"
else
    fail "prewarm --full: exit $RC, fetched $FETCHED"
    show "$E2E_TMP/pw.err"
fi
SEED=$E2E_TMP/seed
fy "$E2E_TMP/ex.out" "$E2E_TMP/ex.err" store --store "$BAKE" export --json "$SEED"
M=$SEED/ferry-store.json
N_OBJ=$(jq '.objects | length' "$M" 2>/dev/null || echo 0)
if [[ $RC == 0 ]] && ((N_OBJ > 0)) && [[ $N_OBJ == $(find "$SEED/objects" -type f | wc -l) ]] &&
    jq -e --arg i "$IMAGE" '.images[] | select(.reference == $i)' "$M" >/dev/null; then
    pass "exported the seed: $N_OBJ objects, $(jq .total_bytes "$M") bytes, image recorded"
else
    fail "ferry store export: exit $RC, $N_OBJ objects"
    show "$E2E_TMP/ex.err"
fi
chmod -R a-w "$SEED"
SEED_RO=$E2E_TMP/seed-ro
mkdir -p "$SEED_RO"
mount --bind "$SEED" "$SEED_RO"
e2e_defer "umount '$SEED_RO' 2>/dev/null || umount -l '$SEED_RO' 2>/dev/null || true"
mount -o remount,bind,ro "$SEED_RO"
if touch "$SEED_RO/probe" 2>/dev/null; then
    fail "the read-only bind mount of the seed accepts writes"
    rm -f "$SEED_RO/probe"
fi
seed_sum "$SEED" >"$E2E_TMP/seed.before"

fy "$E2E_TMP/du.out" "$E2E_TMP/du.err" store --store "$E2E_TMP/inspect" --seed "$SEED_RO" du --json
fy "$E2E_TMP/vf.out" "$E2E_TMP/vf.err" store --store "$E2E_TMP/inspect" --seed "$SEED_RO" verify --json
if [[ $RC == 0 ]] && [[ $(jq .seed.objects "$E2E_TMP/du.out") == "$N_OBJ" ]] &&
    [[ $(jq .seed.good_entries "$E2E_TMP/vf.out") == "$N_OBJ" ]] &&
    [[ $(jq '.seed.dropped | length' "$E2E_TMP/vf.out") == 0 ]]; then
    pass "ferry store --seed: du shows the seed's $N_OBJ objects, verify hashes every one good"
else
    fail "ferry store --seed du/verify: exit $RC"
    show "$E2E_TMP/du.err"
    show "$E2E_TMP/vf.err"
fi

PLAIN=$E2E_TMP/not-an-export
mkdir -p "$PLAIN/objects"
fy "$E2E_TMP/np.out" "$E2E_TMP/np.err" store --store "$E2E_TMP/inspect" --seed "$PLAIN" du
if [[ $RC != 0 ]] && grep -q "not a ferry store export" "$E2E_TMP/np.err" && grep -q "ferry store export DIR" "$E2E_TMP/np.err"; then
    pass "a directory that is not an export is refused: $(grep -o 'seed store.*' "$E2E_TMP/np.err" | cut -c1-110)"
else
    fail "ferry store --seed on a plain directory: exit $RC"
    show "$E2E_TMP/np.err"
fi
daemon_config "$E2E_TMP/badseed.toml" "$E2E_TMP/live-bad" "$PLAIN" "$E2E_TMP/run-bad/daemon.sock"
set +e
timeout 60 "$FERRY" daemon --config "$E2E_TMP/badseed.toml" >"$E2E_TMP/badseed.log" 2>&1
RC=$?
set -e
if [[ $RC != 0 && $RC != 124 ]] && grep -q "seed" "$E2E_TMP/badseed.log" && grep -q "ferry store export" "$E2E_TMP/badseed.log"; then
    pass "the daemon refuses to start on a seed that is not an export (exit $RC)"
else
    fail "daemon with a bad seed: exit $RC"
    show "$E2E_TMP/badseed.log"
fi

# ---------------------------------------------------------------- 2. corrupted seed
echo "# 2. a corrupted seed: every object a counted miss, fetched into the live store"
BADSEED=$E2E_TMP/seed-corrupt
cp -a "$SEED" "$BADSEED"
chmod -R u+w "$BADSEED"
python3 - "$BADSEED/objects" <<'PY'
import os, sys
for d, _, files in os.walk(sys.argv[1]):
    for name in files:
        with open(os.path.join(d, name), "r+b") as f:
            b = f.read(1)
            if b:
                f.seek(0)
                f.write(bytes([b[0] ^ 0xFF]))
PY
mount_with_seed 1 "$BADSEED" "with every seed object corrupt, every file still reads right" "read with a corrupted seed"
"$FERRY" status --config "$CFG1" --json >"$E2E_TMP/st1.json"
curl -sf --noproxy '*' "http://127.0.0.1:$MPORT1/metrics" >"$E2E_TMP/metrics1.txt" || true
CORRUPT=$(jq '.store.seed.corrupt // 0' "$E2E_TMP/st1.json")
HITS1=$(jq '.store.seed.hits // -1' "$E2E_TMP/st1.json")
LIVE1_N=$(chunk_files "$LIVE1")
if ((CORRUPT > 0 && HITS1 == 0 && LIVE1_N > 0)) &&
    (($(metric "$E2E_TMP/metrics1.txt" ferry_store_seed_corrupt_total) == CORRUPT)); then
    pass "corrupt seed objects are counted ($CORRUPT, also in /metrics), none served, and the refetched bytes went to the live store ($LIVE1_N chunks)"
else
    fail "corrupted seed: corrupt $CORRUPT, seed hits $HITS1, live chunks $LIVE1_N, metric $(metric "$E2E_TMP/metrics1.txt" ferry_store_seed_corrupt_total)"
    show "$E2E_TMP/daemon1.log"
fi
if grep -q "seed object not usable" "$E2E_TMP/daemon1.log"; then
    pass "the daemon logged the bad seed objects"
else
    fail "no log line for the bad seed objects"
fi
"$FERRY" umount --config "$CFG1" "$MNT1" >/dev/null 2>&1 || true
daemon_stop

# ---------------------------------------------------------------- 3. registry blobs zeroed
echo "# 3. the registry's layer blobs zeroed: a fresh daemon reads the image from the seed"
kill "$REG_PID" 2>/dev/null || true
wait "$REG_PID" 2>/dev/null || true
LAYERS=$(oci_manifest "$IMG" small | jq -r '.layers[].digest')
for d in $LAYERS; do
    hex=${d#sha256:}
    f=$REG_DATA/blobs/sha256/${hex:0:2}/$hex
    [[ -f $f ]] || e2e_die "layer blob $d not found at $f"
    size=$(stat -c %s "$f")
    rm -f "$f"
    truncate -s "$size" "$f"
done
start_ferry_registry reg "$E2E_TMP/reg.toml" "$REG_ADDR" || e2e_die "the registry did not restart"
REPO_URL=http://$REG_ADDR/v2/e2e/seed
ZEROED=0
for d in $LAYERS; do
    got=$(curl -sf --noproxy '*' "$REPO_URL/blobs/$d" | sha256sum | cut -d' ' -f1)
    [[ sha256:$got != "$d" ]] && ZEROED=$((ZEROED + 1))
done
if ((ZEROED == $(wc -w <<<"$LAYERS"))); then
    pass "the registry serves the manifest but every layer blob's bytes are zeros ($ZEROED layers)"
else
    fail "only $ZEROED layer blobs no longer match their digest"
fi

mount_with_seed 2 "$SEED_RO" "every file of the image read right from the seed, layer blobs zeroed" "read from the seed"
"$FERRY" status --config "$CFG2" --json >"$E2E_TMP/st2.json"
"$FERRY" status --config "$CFG2" >"$E2E_TMP/st2.txt"
curl -sf --noproxy '*' "http://127.0.0.1:$MPORT2/metrics" >"$E2E_TMP/metrics2.txt" || true
ERRS=$(jq '[.mounts[].stats.fetch_errors // 0] | add // 0' "$E2E_TMP/st2.json")
HITS=$(jq '.store.seed.hits // 0' "$E2E_TMP/st2.json")
SERVED=$(jq '.store.seed.bytes_served // 0' "$E2E_TMP/st2.json")
if [[ $ERRS == 0 ]] && ((HITS > 0 && SERVED > 0)) && [[ $(jq '.store.seed.corrupt' "$E2E_TMP/st2.json") == 0 ]]; then
    pass "status: $HITS seed hits, $SERVED bytes served from the seed, no corrupt object, no fetch error"
else
    fail "status after reading from the seed: $ERRS fetch errors, $HITS hits, $SERVED bytes"
    show "$E2E_TMP/st2.json" 30
fi
if grep -q "seed store: $SEED_RO (read-only; $N_OBJ objects" "$E2E_TMP/st2.txt"; then
    pass "ferry status names the seed: $(grep 'seed store' "$E2E_TMP/st2.txt" | cut -c1-120)"
else
    fail "ferry status does not show the seed"
    show "$E2E_TMP/st2.txt"
fi
MHITS=$(metric "$E2E_TMP/metrics2.txt" ferry_store_seed_hits_total)
MSERVED=$(metric "$E2E_TMP/metrics2.txt" ferry_store_seed_served_bytes_total)
MOBJ=$(metric "$E2E_TMP/metrics2.txt" ferry_store_seed_objects)
if ((MHITS > 0 && MSERVED > 0)) && [[ $MOBJ == "$N_OBJ" ]]; then
    pass "/metrics: ferry_store_seed_hits_total $MHITS, ferry_store_seed_served_bytes_total $MSERVED, ferry_store_seed_objects $MOBJ"
else
    fail "/metrics: seed hits $MHITS, served $MSERVED, objects $MOBJ"
    grep ferry_store_ "$E2E_TMP/metrics2.txt" | head -20 || true
fi
LIVE2_N=$(chunk_files "$LIVE2")
if [[ $LIVE2_N == 0 && $(jq '.store.entries' "$E2E_TMP/st2.json") == 0 ]]; then
    pass "the live store got nothing written: no chunk file, 0 entries"
else
    fail "the live store holds $LIVE2_N chunk files after reading seeded objects"
fi
"$FERRY" umount --config "$CFG2" "$MNT2" >/dev/null 2>&1 || true
daemon_stop

# ---------------------------------------------------------------- 4. seed unchanged
echo "# 4. the seed directory is unchanged"
seed_sum "$SEED" >"$E2E_TMP/seed.after"
if cmp -s "$E2E_TMP/seed.before" "$E2E_TMP/seed.after"; then
    pass "the seed is byte for byte what was baked ($(wc -l <"$E2E_TMP/seed.before") lines of checksums: paths, modes, sizes, mtimes, contents)"
else
    fail "the seed directory changed"
    diff "$E2E_TMP/seed.before" "$E2E_TMP/seed.after" | head -20 || true
fi

e2e_summary
