#!/usr/bin/env bash
# tests/e2e/node_cache.sh — node image caches: `ferry prewarm` and `ferry store
# export/import`.
#
#   bash tests/e2e/node_cache.sh
#
# Setup: the small image, indexed in 64 KiB spans, pushed to a `ferry registry serve` on
# loopback (publish_indexed_small); a startup trace recorded for it (`ferry trace record
# --publish`, a busybox command reading a few files) and published as its referrer.
#
# 1. With a daemon (prefetch and fill off, so only prewarm fetches): `ferry prewarm
#    IMAGE` goes through the daemon, plans the trace's hot set and fetches it; the store
#    grows; a second prewarm fetches nothing and says so.
# 2. Without a daemon: `ferry prewarm --full` against the same store (same config),
#    killed -9 mid-way (through a proxy adding 150 ms a request, 64 KiB requests, one
#    at a time), then run again: it completes and fetches only what was missing (less
#    than the layers' total); a third run fetches nothing.
# 3. `ferry store export` → a directory with ferry-store.json (format 2, the image
#    recorded with its layers, every object listed); `ferry store import` into a fresh
#    root verifies and adds every object; a corrupted copy of the export is refused
#    with nothing imported; an export claiming format 99 is refused by name.
# 4. The registry stopped: a daemon on the imported root serves the image's files from
#    the imported store: the image is mounted from an OCI layout whose layer blobs are
#    sparse files of zeros (so any byte not in the store would fail verification), and
#    every file equals the reference tree.
#
# Env: FERRY, OUT, FERRY_TIMEOUT (120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

mount_prologue cmp truncate
require_ferry prewarm

is_mounted() { grep -q " $1 " /proc/self/mountinfo; }
store_bytes() { "$FERRY" store --store "$1" du --json | jq -r .bytes; }
# chunk_bytes STORE: bytes of the entry files, read while a process holds the store
chunk_bytes() { find "$1/chunks" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}'; }
# fetched_of FILE: the bytes `ferry prewarm --json` says it fetched (summed over images)
fetched_of() { jq -s 'map(.report.fetched_bytes) | add // 0' "$1"; }

# ---------------------------------------------------------------- setup
echo "# setup: indexed small image in a ferry registry, its startup trace, reference tree"
publish_indexed_small e2e/cache:v1 # IMG, REG_ADDR, IMAGE
reference_tree "$IMG"
fy "$E2E_TMP/tr.out" "$E2E_TMP/tr.err" trace record --publish --no-store "$IMAGE" -- \
    /bin/busybox sh -c 'cat /etc/motd; ls /'
if [[ $RC == 0 ]]; then
    pass "startup trace recorded and published ($(tail -1 "$E2E_TMP/tr.err" | cut -c1-100))"
else
    fail "ferry trace record --publish: exit $RC"
    show "$E2E_TMP/tr.err"
fi

STORE=$E2E_TMP/store
SOCK=$E2E_TMP/run/daemon.sock
CFG=$E2E_TMP/daemon.toml
cat >"$CFG" <<TOML
[store]
path = "$STORE"
[control]
socket = "$SOCK"
[snapshotter]
enabled = false
[warm]
prefetch = false
background_fill = false
[trace]
auto_record = false
TOML

# ---------------------------------------------------------------- 1. through the daemon
echo "# 1. ferry prewarm through the daemon"
daemon_start "$CFG" "$E2E_TMP/daemon.log" || { show "$E2E_TMP/daemon.log"; e2e_die "daemon did not start"; }
fy "$E2E_TMP/p1.out" "$E2E_TMP/p1.err" prewarm --config "$CFG" --json "$IMAGE"
F1=$(fetched_of "$E2E_TMP/p1.out" 2>/dev/null || echo 0)
COV=$(jq -r .report.coverage "$E2E_TMP/p1.out" 2>/dev/null || true)
if [[ $RC == 0 ]] && grep -q "through the daemon" "$E2E_TMP/p1.err" && ((F1 > 0)) && [[ $COV == trace ]]; then
    pass "prewarm through the daemon fetched the trace's hot set: $F1 of $(jq -r .report.planned_bytes "$E2E_TMP/p1.out") bytes planned"
else
    fail "prewarm through the daemon: exit $RC, fetched $F1, coverage $COV"
    show "$E2E_TMP/p1.err"
    show "$E2E_TMP/daemon.log"
fi
P1=$(jq -r .report.planned_bytes "$E2E_TMP/p1.out" 2>/dev/null || echo 0)
fy "$E2E_TMP/p2.out" "$E2E_TMP/p2.err" prewarm --config "$CFG" --json "$IMAGE"
F2=$(fetched_of "$E2E_TMP/p2.out" 2>/dev/null || echo -1)
PRES2=$(jq -r .report.present_bytes "$E2E_TMP/p2.out" 2>/dev/null || echo 0)
if [[ $RC == 0 && $F2 == 0 && $PRES2 == "$P1" ]]; then
    pass "a second prewarm fetches nothing: the hot set ($PRES2 bytes) is all in the store"
else
    fail "second prewarm: exit $RC, fetched $F2, present $PRES2 of $P1"
    show "$E2E_TMP/p2.err"
fi
daemon_stop
HOT_BYTES=$(store_bytes "$STORE")
if ((HOT_BYTES > 0)); then
    pass "the store holds the hot set after the daemon stopped ($HOT_BYTES bytes)"
else
    fail "store empty after prewarm"
fi

# ---------------------------------------------------------------- 2. --full, killed, resumed
echo "# 2. ferry prewarm --full without a daemon, killed mid-way and resumed"
# A slow path to the same registry (each request waits 150 ms), so the small image
# takes seconds, not milliseconds: the store keys are the spans' digests, so what is
# fetched through it is what a prewarm of $IMAGE needs.
cat >"$E2E_TMP/slowproxy.py" <<'PY'
import http.server, sys, time, urllib.request
up = sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_any(self, method):
        time.sleep(0.15)
        body = None
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            body = self.rfile.read(n)
        req = urllib.request.Request("http://" + up + self.path, data=body, method=method)
        for k, v in self.headers.items():
            if k.lower() not in ("host", "connection"):
                req.add_header(k, v)
        try:
            r = urllib.request.urlopen(req)
        except urllib.error.HTTPError as e:
            r = e
        data = r.read()
        self.send_response(r.status if hasattr(r, "status") else r.code)
        for k, v in r.headers.items():
            if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)
    def do_GET(self): self.do_any("GET")
    def do_HEAD(self): self.do_any("HEAD")
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PY
SLOW_PORT=$(free_port)
python3 "$E2E_TMP/slowproxy.py" "$SLOW_PORT" "$REG_ADDR" 2>/dev/null &
SLOW_PID=$!
E2E_PIDS+=("$SLOW_PID")
SLOW_IMAGE=127.0.0.1:$SLOW_PORT/e2e/cache:v1
wait_for 10 "slow proxy" curl -sf --noproxy '*' -o /dev/null "http://127.0.0.1:$SLOW_PORT/v2/" || true
# On a store of its own: the trace of part 1 covers most of this small image.
STORE=$E2E_TMP/store-full
HOT_BYTES=0
sed -i "s#path = \"$E2E_TMP/store\"#path = \"$STORE\"#" "$CFG"
SLOW=$E2E_TMP/slow.toml
sed 's/^\[warm\]/[fetch]\nconcurrency = 1\nrequest_size = "64K"\nreadahead = "0"\n[warm]/' "$CFG" >"$SLOW"
TOTAL=$(oci_manifest "$IMG" small | jq '[.layers[].size] | add')
"$FERRY" prewarm --config "$SLOW" --full --json "$SLOW_IMAGE" >"$E2E_TMP/k.out" 2>"$E2E_TMP/k.err" &
KPID=$!
# The windows blobs (~a third of the layers' size) arrive first; kill once spans follow.
deadline=$((SECONDS + 60))
while kill -0 "$KPID" 2>/dev/null && (($(chunk_bytes "$STORE") < HOT_BYTES + TOTAL * 7 / 10)) && ((SECONDS < deadline)); do
    sleep 0.05
done
if kill -9 "$KPID" 2>/dev/null; then
    wait "$KPID" 2>/dev/null || true
    pass "prewarm --full killed -9 mid-way"
    KILLED=1
else
    wait "$KPID" 2>/dev/null || true
    fail "prewarm --full ended before it could be killed (image too small or link too fast)"
    KILLED=0
fi
fy "$E2E_TMP/r.out" "$E2E_TMP/r.err" prewarm --config "$CFG" --full --json "$IMAGE"
FR=$(fetched_of "$E2E_TMP/r.out" 2>/dev/null || echo 0)
PR=$(jq -r .report.present_bytes "$E2E_TMP/r.out" 2>/dev/null || echo 0)
if [[ $RC == 0 ]] && ((KILLED == 0 || (PR > HOT_BYTES && FR < TOTAL * 9 / 10))); then
    pass "the rerun completed, fetching only the rest: $FR bytes fetched, $PR of $TOTAL already present"
else
    fail "rerun after kill: exit $RC, fetched $FR, present $PR, total $TOTAL, hot $HOT_BYTES"
    show "$E2E_TMP/r.err"
fi
fy "$E2E_TMP/r2.out" "$E2E_TMP/r2.err" prewarm --config "$CFG" --full --json "$IMAGE"
if [[ $RC == 0 && $(fetched_of "$E2E_TMP/r2.out") == 0 ]]; then
    pass "a third --full run fetches nothing ($(jq -r .report.present_bytes "$E2E_TMP/r2.out") bytes present)"
else
    fail "third --full run: exit $RC"
    show "$E2E_TMP/r2.err"
fi

# ---------------------------------------------------------------- 3. export / import
echo "# 3. ferry store export / import"
EXP=$E2E_TMP/export
fy "$E2E_TMP/e.out" "$E2E_TMP/e.err" store --store "$STORE" export --json "$EXP"
M=$EXP/ferry-store.json
if [[ $RC == 0 && -f $M ]] && [[ $(jq -r .format "$M") == 2 ]] &&
    jq -e --arg i "$IMAGE" '.images[] | select(.reference == $i) | .layers | length > 0' "$M" >/dev/null &&
    [[ $(jq '.objects | length' "$M") == $(find "$EXP/objects" -type f | wc -l) ]]; then
    pass "export: $(jq '.objects | length' "$M") objects, $(jq .total_bytes "$M") bytes, image $IMAGE recorded with its layers"
else
    fail "ferry store export: exit $RC"
    show "$E2E_TMP/e.err"
fi
BAD=$E2E_TMP/export-bad
cp -a "$EXP" "$BAD"
victim=$(find "$BAD/objects" -type f -print -quit)
# flip every bit of the first byte: writing a fixed byte changes nothing when the
# object already starts with it (a busybox chunk can start with 0x58, 'X')
python3 -c 'import sys; f = open(sys.argv[1], "r+b"); b = f.read(1); f.seek(0); f.write(bytes([b[0] ^ 0xFF]))' "$victim"
cmp -s "$victim" "$EXP/objects/${victim#"$BAD/objects/"}" && e2e_die "corrupting $victim changed nothing"
fy "$E2E_TMP/ib.out" "$E2E_TMP/ib.err" store --store "$E2E_TMP/store-bad" import "$BAD"
if [[ $RC != 0 ]] && grep -q "nothing was imported" "$E2E_TMP/ib.err" &&
    [[ $("$FERRY" store --store "$E2E_TMP/store-bad" du --json | jq .entries) == 0 ]]; then
    pass "a corrupted export is refused, nothing imported: $(grep -o 'does not hash.*' "$E2E_TMP/ib.err" | head -1)"
else
    fail "corrupted import: exit $RC"
    show "$E2E_TMP/ib.err"
fi
V99=$E2E_TMP/export-v99
cp -a "$EXP" "$V99"
jq '.format = 99' "$EXP/ferry-store.json" >"$V99/ferry-store.json"
fy "$E2E_TMP/iv.out" "$E2E_TMP/iv.err" store --store "$E2E_TMP/store-v99" import "$V99"
if [[ $RC != 0 ]] && grep -q "format 99" "$E2E_TMP/iv.err"; then
    pass "an unknown export format is refused: $(grep -o 'is a store export.*' "$E2E_TMP/iv.err" | cut -c1-90)"
else
    fail "format 99 import: exit $RC"
    show "$E2E_TMP/iv.err"
fi
FRESH=$E2E_TMP/store-fresh
fy "$E2E_TMP/i.out" "$E2E_TMP/i.err" store --store "$FRESH" import --json "$EXP"
N_IMP=$(jq -r .imported "$E2E_TMP/i.out" 2>/dev/null || echo 0)
if [[ $RC == 0 && $N_IMP == $(jq '.objects | length' "$M") ]]; then
    pass "import into a fresh root: $N_IMP objects verified and added in $(jq -r .seconds "$E2E_TMP/i.out" | cut -c1-5)s"
else
    fail "import: exit $RC, imported $N_IMP"
    show "$E2E_TMP/i.err"
fi
fy "$E2E_TMP/vf.out" "$E2E_TMP/vf.err" store --store "$FRESH" verify --json
if [[ $RC == 0 && $(jq '.dropped | length' "$E2E_TMP/vf.out") == 0 ]]; then
    pass "ferry store verify on the imported root: every entry good"
else
    fail "verify after import: exit $RC"
    show "$E2E_TMP/vf.err"
fi

# ---------------------------------------------------------------- 4. registry down
echo "# 4. registry stopped: a daemon on the imported root serves the image"
kill "$REG_PID" "$SLOW_PID" 2>/dev/null || true
wait "$REG_PID" "$SLOW_PID" 2>/dev/null || true
if curl -s --noproxy '*' --max-time 2 "http://$REG_ADDR/v2/" >/dev/null; then
    fail "the registry still answers on $REG_ADDR"
fi
# The image's metadata (manifest, ferry index) in a layout whose layer blobs are sparse
# zeros of the right size: a byte not in the store would fail verification.
HOLLOW=$E2E_TMP/hollow
cp -a "$IMG" "$HOLLOW"
for d in $(oci_manifest "$IMG" small | jq -r '.layers[].digest'); do
    f=$HOLLOW/blobs/sha256/${d#sha256:}
    size=$(stat -c %s "$f")
    rm -f "$f"
    truncate -s "$size" "$f"
done
CFG2=$E2E_TMP/daemon2.toml
sed -e "s#path = \"$STORE\"#path = \"$FRESH\"#" -e "s#$SOCK#$E2E_TMP/run2/daemon.sock#" "$CFG" >"$CFG2"
daemon_start "$CFG2" "$E2E_TMP/daemon2.log" || { show "$E2E_TMP/daemon2.log"; e2e_die "daemon 2 did not start"; }
MNT=$E2E_TMP/mnt
mkdir -p "$MNT"
fy "$E2E_TMP/m.out" "$E2E_TMP/m.err" mount --config "$CFG2" "oci:$HOLLOW:small" "$MNT"
if [[ $RC == 0 ]] && is_mounted "$MNT" && tree_equals_ref "$MNT" "$E2E_TMP/mnt.sums"; then
    pass "every file of the image read back from the imported store, registry down ($(wc -l <"$E2E_TMP/mnt.sums") files)"
else
    fail "offline read from the imported store: mount exit $RC"
    show "$E2E_TMP/m.err"
    show "$E2E_TMP/mnt.sums.err"
    show "$E2E_TMP/daemon2.log"
fi
ERRS=$("$FERRY" status --config "$CFG2" --json | jq '[.mounts[].stats.fetch_errors // 0] | add // 0')
if [[ $ERRS == 0 ]]; then
    pass "no fetch errors: nothing was asked of the (stopped) registry or the hollow layout"
else
    fail "$ERRS fetch errors while reading from the imported store"
fi
"$FERRY" umount --config "$CFG2" "$MNT" >/dev/null 2>&1 || true
daemon_stop

e2e_summary
