#!/usr/bin/env bash
# tests/e2e/p2p_windows.sh — issue 13's windows leftover: a gzip layer's inflate windows
# (the windows blob of its version-2 ferry index) travel between peers like its spans.
#
#   bash tests/e2e/p2p_windows.sh
#
# Network as in p2p_fleet.sh: a bridge (10.R.0.1/24) with ferry's registry on it, two
# namespaces, a `ferry daemon` with `[p2p]` in each (`nsenter --net` only, so the FUSE
# mounts are in the root mount namespace), both listing both, `roots = 1`, one piece per
# blob (`piece_size = 1G`). Prefetch, background fill and the file cache are off, so
# what moves is what the readers read. One image, one tar+gzip layer (random data, which
# needs a window at every checkpoint, and text), indexed with 64 KiB spans.
#
# Node B's name (`self_name`, its peer port) is picked so that node A ranks first for
# the layer blob's piece and the windows blob's piece (rendezvous hashing over the two
# names, computed here as crates/p2p does): A is the root that reads the registry, B its
# child. That is the fleet whose second node must not touch the registry; with B a root
# it would read the registry by design.
#
# 1. A mounts the layer (`ferry mount --layer`, the path that reads peers) and reads
#    every file: md5 equal to tar's; A fetched windows bytes from the registry
#    (`windows_bytes_from_origin` > 0 in `ferry status --json`: the layer has a windows
#    blob and it is read through the peer routing).
# 2. B mounts it and reads every file cold: md5 equal to tar's; B's status shows zero
#    layer bytes and zero windows bytes from the registry, layer and windows bytes from
#    peers (> 0), no fallback to the registry and no corrupt answer; A served at least
#    what B got. The registry's own account agrees:
#    `ferry_registry_response_bytes_total{route="blob_pull"}` over B's read is at most the
#    image's blobs other than the layer and its windows blob (config, index blob), far
#    below either of those.
# 3. B's Prometheus endpoint (`[metrics]`, in its namespace) has the windows series:
#    `ferry_p2p_windows_from_peers_bytes_total` equal to its status, > 0, and
#    `ferry_p2p_windows_from_origin_bytes_total` 0; `ferry status` (human) names them.
#
# Env: FERRY, FERRY_TIMEOUT (seconds per ferry call, 60), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "network namespaces, FUSE mounts"
need_cmd ip nsenter python3 curl jq tar gzip md5sum sha256sum timeout
[[ -e /dev/fuse ]] || skip "no /dev/fuse"

FT=${FERRY_TIMEOUT:-60}
A=1
B=2
find_ferry
e2e_init
require_ferry daemon
T0=$SECONDS

# ---------------------------------------------------------------- network
netns_fleet fw 2

# ---------------------------------------------------------------- image
SRC=$E2E_TMP/src
IMG=$E2E_TMP/img
mkdir -p "$SRC/data" "$SRC/etc" "$IMG/blobs/sha256"
# About 3 MiB uncompressed: under 64 windows (4 blocks of 16), so the device asks for
# windows as the reads need them, not widened into blocks.
head -c $((2 << 20 | 4321)) /dev/urandom >"$SRC/data/random.bin"
seq 100000 >"$SRC/data/numbers.txt"
for i in 1 2 3; do head -c $((64 << 10)) /dev/urandom >"$SRC/etc/small$i.bin"; done
echo "windows from a peer" >"$SRC/etc/motd"
(cd "$SRC" && find . -type f | sort | xargs md5sum) >"$E2E_TMP/ref.md5"
echo '{"imageLayoutVersion":"1.0.0"}' >"$IMG/oci-layout"
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@1700000000 -C "$SRC" -cf "$E2E_TMP/layer.tar" .
DIFF=sha256:$(sha256sum "$E2E_TMP/layer.tar" | cut -d' ' -f1)
gzip -n -6 -c "$E2E_TMP/layer.tar" >"$E2E_TMP/layer.tgz"
LAYER=sha256:$(sha256sum "$E2E_TMP/layer.tgz" | cut -d' ' -f1)
SIZE=$(stat -c %s "$E2E_TMP/layer.tgz")
mv "$E2E_TMP/layer.tgz" "$IMG/blobs/sha256/${LAYER#sha256:}"
cfg=$(printf '{"architecture":"amd64","os":"linux","config":{},"rootfs":{"type":"layers","diff_ids":["%s"]}}' "$DIFF")
cd_=$(printf '%s' "$cfg" | sha256sum | cut -d' ' -f1)
printf '%s' "$cfg" >"$IMG/blobs/sha256/$cd_"
man=$(printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"%s","size":%s}]}' \
    "$cd_" "${#cfg}" "$LAYER" "$SIZE")
md=$(printf '%s' "$man" | sha256sum | cut -d' ' -f1)
printf '%s' "$man" >"$IMG/blobs/sha256/$md"
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"t"}}]}\n' \
    "$md" "${#man}" >"$IMG/index.json"
fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index --min-layer-size 0 --span 65536 "oci:$IMG:t"
[[ $RC == 0 ]] || { show "$E2E_TMP/index.err"; e2e_die "ferry index failed"; }
# the windows blob, from the index artifact (small JSON blobs only)
WINDOWS=$(find "$IMG/blobs/sha256" -type f -size -64k -print0 |
    xargs -0 -n1 jq -r '.layers[]? | select(.mediaType == "application/vnd.ferry.layer.windows.v1") | .digest' 2>/dev/null |
    head -1 || true)
[[ $WINDOWS == sha256:* ]] || e2e_die "ferry index wrote no windows blob for the gzip layer"
WSIZE=$(stat -c %s "$IMG/blobs/sha256/${WINDOWS#sha256:}")
# every other blob of the layout (config, manifest, the index artifact, the index blob)
META=$(($(du -bc "$IMG"/blobs/sha256/* | tail -1 | cut -f1) - SIZE - WSIZE))
e2e_log "layer $LAYER ($SIZE bytes), windows blob $WINDOWS ($WSIZE bytes), other blobs $META bytes"

# ---------------------------------------------------------------- registry
: >"$E2E_TMP/open.toml"
start_ferry_registry open "$E2E_TMP/open.toml" "$HOST_IP:$(free_port)" || e2e_die "registry did not start"
OPEN=$REG_ADDR
IMAGE=$OPEN/fleet/win:v1
fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy --plain-http "oci:$IMG:t" "$IMAGE"
[[ $RC == 0 ]] || { show "$E2E_TMP/cp.err"; e2e_die "ferry copy to $IMAGE failed"; }
reach() { in_ns "$B" curl -s -o /dev/null --max-time 2 "http://$OPEN/v2/"; }
wait_for 10 "node $B reaches the registry" reach || e2e_die "namespace $(ns "$B") cannot reach http://$OPEN"
export REGISTRY_AUTH_FILE=$E2E_TMP/no-auth.json DOCKER_CONFIG=$E2E_TMP/no-docker
unset XDG_RUNTIME_DIR || true

# ---------------------------------------------------------------- names
# B's peer port: the first from 7050 at which A outranks B for piece 0 of both blobs
# (crates/p2p: member key = first 8 bytes, little-endian, of SHA-256 of the name; piece
# key = the same of SHA-256 of "<digest>\0" and the index as 4 big-endian bytes; score =
# SplitMix64 finalizer of key ^ mix(member key + golden gamma); highest score first).
NAME_A="$(node_ip "$A"):7050"
PORT_B=$(python3 - "$NAME_A" "$(node_ip "$B")" "$LAYER" "$WINDOWS" <<'PY'
import hashlib, sys
M = (1 << 64) - 1
def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)
def u64(b):
    return int.from_bytes(b[:8], "little")
def score(key, name):
    member = u64(hashlib.sha256(name.encode()).digest())
    return mix(key ^ mix((member + 0x9E3779B97F4A7C15) & M))
def piece(blob):
    return u64(hashlib.sha256(blob.encode() + b"\0" + (0).to_bytes(4, "big")).digest())
a, ip, blobs = sys.argv[1], sys.argv[2], sys.argv[3:]
for port in range(7050, 7550):
    b = f"{ip}:{port}"
    if all(score(piece(d), a) > score(piece(d), b) for d in blobs):
        print(port)
        break
PY
)
[[ -n $PORT_B ]] || e2e_die "no port for B below 7550 at which A is the root of both pieces"
NAME_B="$(node_ip "$B"):$PORT_B"
e2e_log "A is $NAME_A, B is $NAME_B (A ranks first for both blobs' pieces)"

# ---------------------------------------------------------------- daemons
head -c 32 /dev/urandom | sha256sum | cut -d' ' -f1 >"$E2E_TMP/p2p-token"
chmod 600 "$E2E_TMP/p2p-token"
sock() { echo "$E2E_TMP/n$1/daemon.sock"; }
start_daemon() {
    local i=$1 name=$2
    mkdir -p "$E2E_TMP/n$i"
    cat >"$E2E_TMP/n$i/daemon.toml" <<EOF
[store]
path = "$E2E_TMP/n$i/store"
[fuse]
keep_connections = false
[warm]
prefetch = false
background_fill = false
[file_cache]
enabled = false
[control]
socket = "$(sock "$i")"
[metrics]
addr = "$(node_ip "$i"):9100"
[snapshotter]
enabled = false
[trace]
auto_record = false
[registry]
plain_http = ["$OPEN"]
config_path = ""
[p2p]
enabled = true
listen = "$name"
self_name = "$name"
peers = ["$NAME_A", "$NAME_B"]
token_file = "$E2E_TMP/p2p-token"
peer_timeout = "2s"
roots = 1
fan_out = 4
fallbacks = 1
piece_size = "1G"
EOF
    in_ns "$i" "$FERRY" --log info daemon --config "$E2E_TMP/n$i/daemon.toml" >"$E2E_TMP/n$i.log" 2>&1 &
    E2E_PIDS+=("$!")
}
start_daemon "$A" "$NAME_A"
start_daemon "$B" "$NAME_B"
up() { timeout 5 "$FERRY" status --socket "$(sock "$1")" >/dev/null 2>&1; }
both_up() { up "$A" && up "$B"; }
if ! wait_for 60 "daemons" both_up; then
    for i in "$A" "$B"; do up "$i" || { e2e_log "daemon $i down:"; tail -5 "$E2E_TMP/n$i.log" >&2; }; done
    e2e_die "the daemons did not come up"
fi

status_json() { timeout 10 "$FERRY" status --socket "$(sock "$1")" --json 2>/dev/null || true; }
reg_blob_bytes() {
    curl -s --max-time 10 "http://$OPEN/metrics" |
        awk '/^ferry_registry_response_bytes_total\{route="blob_pull"\}/ { print $2 }' | head -1
}
# read_all I: daemon I mounts the layer and md5s every file (into n$I/read.md5)
read_all() {
    local m=$E2E_TMP/n$1/mnt
    mkdir -p "$m"
    timeout "$FT" "$FERRY" mount --socket "$(sock "$1")" "$IMAGE" "$m" --layer "$LAYER" \
        >"$E2E_TMP/n$1/mount.out" 2>"$E2E_TMP/n$1/mount.err" ||
        { echo "mount failed: $(tail -1 "$E2E_TMP/n$1/mount.err")" >"$E2E_TMP/n$1/read.md5"; return 0; }
    (cd "$m" && timeout 120 find . -type f | sort | timeout 120 xargs md5sum) >"$E2E_TMP/n$1/read.md5" 2>&1 || true
}

# ---------------------------------------------------------------- 1. A reads
echo "# 1. node A mounts the gzip layer and reads every file"
r0=$(reg_blob_bytes)
read_all "$A"
r1=$(reg_blob_bytes)
if cmp -s "$E2E_TMP/n$A/read.md5" "$E2E_TMP/ref.md5"; then
    pass "A read every file ($(wc -l <"$E2E_TMP/ref.md5") files), md5 equal to tar's"
else
    fail "A's read differs from tar's"
    show "$E2E_TMP/n$A/read.md5" 5
fi
status_json "$A" >"$E2E_TMP/n$A/status-1.json" # for a post-mortem with E2E_KEEP=1
a_win_origin=$(jq -r '.p2p.windows_bytes_from_origin // 0' "$E2E_TMP/n$A/status-1.json")
a_origin=$(jq -r '.p2p.bytes_from_origin // 0' "$E2E_TMP/n$A/status-1.json")
e2e_log "A: layer $a_origin and windows $a_win_origin bytes from the registry; registry sent $((r1 - r0)) blob bytes"
if ((a_win_origin > 0 && a_origin > 0 && r1 - r0 >= a_origin + a_win_origin)); then
    pass "A, the root, fetched $a_win_origin windows bytes and $a_origin layer bytes from the registry (registry sent $((r1 - r0)))"
else
    fail "A fetched windows $a_win_origin, layer $a_origin bytes from the registry (registry sent $((r1 - r0))): the windows blob is not read through the peer routing"
fi

# ---------------------------------------------------------------- 2. B reads cold
echo "# 2. node B mounts the same layer and reads every file cold"
read_all "$B"
r2=$(reg_blob_bytes)
if cmp -s "$E2E_TMP/n$B/read.md5" "$E2E_TMP/ref.md5"; then
    pass "B read every file, md5 equal to tar's"
else
    fail "B's read differs from tar's"
    show "$E2E_TMP/n$B/read.md5" 5
fi
SB=$(status_json "$B" | tee "$E2E_TMP/n$B/status-2.json")
SA=$(status_json "$A")
b() { jq -r ".p2p.$1 // 0" <<<"$SB"; }
b_origin=$(b bytes_from_origin) b_win_origin=$(b windows_bytes_from_origin)
b_peers=$(b bytes_from_peers) b_win_peers=$(b windows_bytes_from_peers)
b_fallbacks=$(b fallbacks_to_origin) b_corrupt=$(b peer_corrupt) b_failures=$(b peer_failures)
a_win_served=$(jq -r '.p2p.windows_bytes_served // 0' <<<"$SA")
a_served=$(jq -r '.p2p.bytes_served // 0' <<<"$SA")
e2e_log "B: from the registry layer $b_origin windows $b_win_origin; from peers layer $b_peers windows $b_win_peers; fallbacks $b_fallbacks, failures $b_failures; A served layer $a_served windows $a_win_served"
if ((b_origin == 0 && b_win_origin == 0)); then
    pass "B fetched zero layer bytes and zero windows bytes from the registry"
else
    fail "B fetched $b_origin layer bytes and $b_win_origin windows bytes from the registry"
fi
if ((b_peers > 0 && b_win_peers > 0 && b_fallbacks == 0 && b_corrupt == 0 && b_failures == 0)); then
    pass "B got $b_peers layer bytes and $b_win_peers windows bytes from A, no fallback, no failure"
else
    fail "B from peers: layer $b_peers, windows $b_win_peers; fallbacks $b_fallbacks, corrupt $b_corrupt, failures $b_failures"
fi
if ((a_win_served >= b_win_peers && a_served >= b_peers)); then
    pass "A served $a_served layer bytes and $a_win_served windows bytes"
else
    fail "A served layer $a_served, windows $a_win_served: less than B got from peers"
fi
egress=$((r2 - r1))
if ((egress <= META && egress < WSIZE && egress < SIZE)); then
    pass "the registry sent $egress blob bytes during B's read (at most the $META bytes of config and index; windows blob $WSIZE, layer $SIZE)"
else
    fail "the registry sent $egress blob bytes during B's read (more than the $META bytes of config and index)"
fi

# ---------------------------------------------------------------- 3. metrics, status
metric() {
    in_ns "$B" curl -s --max-time 10 "http://$(node_ip "$B"):9100/metrics" |
        awk -v n="$1" '$1 == n { print $2 }' | head -1
}
m_peers=$(metric ferry_p2p_windows_from_peers_bytes_total)
m_origin=$(metric ferry_p2p_windows_from_origin_bytes_total)
if [[ -n $m_peers && $m_peers == "$b_win_peers" && $m_peers -gt 0 && $m_origin == 0 ]]; then
    pass "B's /metrics: ferry_p2p_windows_from_peers_bytes_total $m_peers, ferry_p2p_windows_from_origin_bytes_total 0"
else
    fail "B's /metrics: windows from peers '${m_peers}' (status $b_win_peers), from origin '${m_origin}'"
fi
human=$(timeout 10 "$FERRY" status --socket "$(sock "$B")" 2>/dev/null | grep '^peers:' || true)
if [[ $human == *"windows "*" from peers"* ]]; then
    pass "ferry status names the windows bytes: $human"
else
    fail "ferry status has no windows figures: $human"
fi

e2e_log "elapsed $((SECONDS - T0))s"
e2e_summary
