#!/usr/bin/env bash
# tests/e2e/p2p_fleet.sh — issue 13's fleet start: 16 `ferry daemon`s with `[p2p]`, each
# in its own network namespace, start the same image at once from ferry's registry.
#
#   bash tests/e2e/p2p_fleet.sh
#
# Network: a Linux bridge in the root namespace (10.R.0.1/24, R random per run), 16
# namespaces each with a veth on it (10.R.0.11 … 10.R.0.26); ferry's registries listen on
# the bridge address. Every daemon has `[p2p] enabled`, the same static `peers` list of
# all 16 `ip:7050`, one shared `token_file`, `roots = 2`, `fan_out = 4`, and is started
# with `nsenter --net` only (its FUSE mounts are in the root mount namespace, where the
# readers run). Daemon 16's peer port is a python proxy in its namespace in front of its
# real peer server (127.0.0.1:7051 there): pass-through in phases 1-2, flipping a byte
# of every body from phase 3 on. Everything (daemons, proxy, mounts, namespaces, veths, the
# bridge) goes in the EXIT trap, on failure too. Layers are mounted one each through the
# daemon (`ferry mount --layer`, the path that reads peers; a merged `ferry mount` reads
# the registry only, docs/p2p.md). Prefetch, background fill and the file cache are off,
# so what moves is what the readers read.
#
# 1. Fleet start: all 16 mount layer A (24 MiB of random data + small files) and md5sum
#    every file at once; every daemon's files equal the layer extracted by tar.
# 2. Registry account: `ferry_registry_response_bytes_total{route="blob_pull"}` of the
#    fleet's registry over the start, minus 16 × the image's other blobs (config, index
#    artifact), is at most R × the layer blob plus SLACK (env P2P_SLACK, default 3 × the
#    blob, so at most 5 copies of 16); and the daemons' summed `bytes_from_peers`
#    (`ferry status --json`) is > 0. The registry has no per-range log, so this bounds
#    the copies on average over the blob (every daemon reads every byte), not each piece.
#    Why slack: a child asks its parent while the parent's own read of the piece is in
#    flight; the peer server waits up to peer_timeout / 4 for it to arrive, but with 16
#    daemons on 2 loaded cores a parent's read (itself waiting on its own parent)
#    sometimes takes longer, and the child reads the registry. Measured: 1.7-3.6 copies;
#    12.7-14.5 when the server answered 404 at once (before that wait), 16 without peers;
#    so the bound tells the tree from no tree. (A read is routed by the piece its first
#    byte lies in, so a root of that piece fetches the whole merged request — readahead
#    2 MiB — from the registry, later pieces included: with 256K pieces this went to 4.8
#    copies. Keep piece_size at least the request size.)
#    The layers are uncompressed tar, so that the account is the layer's alone: a gzip
#    layer's index has a windows blob (about half the layer for random data), routed
#    through peers as well; p2p_windows.sh checks that.
# 3. Deaths mid-transfer: all 16 mount layer B (16 MiB random) and read it slowly (1 MiB
#    per 0.25 s); once a reader is past 2 MiB, with every reader still short of the end,
#    4 daemons get kill -9 and their veths go down (a dead machine: connects to it hang);
#    the 12 others' reads finish, each md5 matching, within pieces × peer_timeout + 30 s.
# 4. Corrupt peer: from phase 3 on, daemon 16's proxy flips a byte of every body. Daemon
#    16 reads layer D (64 files of 256 KiB: 16 pieces, so 16 trees) first, then the 11
#    other live daemons read it (so daemon 16 holds what they ask it for, as parent or
#    fallback): the proxy corrupted answers, the others' status shows `peer_corrupt` > 0,
#    and every md5 of phases 3 and 4 is right.
# 5. Pull rights: a second registry with token auth (`private/**`: robot may pull,
#    nobody else), daemon 1 mounts private/app (robot's credentials) and reads it; from
#    daemon 2's namespace, curl to daemon 1's peer server with the cluster token and
#    (a) no registry credential, (b) a token of user `other` (no rights on private/**):
#    403 and an empty body; (c) no cluster token: 401; (d) robot's token: 206 with the
#    blob's bytes (the control: the refusals are about rights, not a broken request).
#
# peer_timeout is 2 s (P2P_PEER_TIMEOUT_MS): at 500 ms the server's wait for spans in
# flight (a quarter of it) was too short for 16 daemons on 2 loaded cores (2.9-5.2 copies).
#
# Env: FERRY, FERRY_TIMEOUT (seconds per ferry call, 60),
#      P2P_SLACK (bytes), P2P_PEER_TIMEOUT_MS (2000), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "network namespaces, FUSE mounts"
need_cmd ip nsenter python3 curl jq tar gzip md5sum sha256sum timeout
[[ -e /dev/fuse ]] || skip "no /dev/fuse"

FT=${FERRY_TIMEOUT:-60}
N=16
R=2
KILLED=(3 6 9 12) # a quarter of 16
BAD=$N            # the corrupting peer
find_ferry
e2e_init
require_ferry daemon
T0=$SECONDS

# ---------------------------------------------------------------- network
netns_fleet fy "$N"

# ---------------------------------------------------------------- images
# layout DIR LAYERDIR...: an OCI layout (tag "t") with one tar+gzip layer per LAYERDIR
layout() {
    local dir=$1 l tgz dig diffs=() descs=() cfg cd man md
    shift
    mkdir -p "$dir/blobs/sha256"
    echo '{"imageLayoutVersion":"1.0.0"}' >"$dir/oci-layout"
    for l in "$@"; do
        tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@1700000000 -C "$l" -cf "$dir/layer.tar" .
        diffs+=("\"sha256:$(sha256sum "$dir/layer.tar" | cut -d' ' -f1)\"")
        cp "$dir/layer.tar" "$dir/layer.tgz"
        dig=$(sha256sum "$dir/layer.tgz" | cut -d' ' -f1)
        mv "$dir/layer.tgz" "$dir/blobs/sha256/$dig"
        descs+=("{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar\",\"digest\":\"sha256:$dig\",\"size\":$(stat -c %s "$dir/blobs/sha256/$dig")}")
        rm -f "$dir/layer.tar"
    done
    cfg=$(printf '{"architecture":"amd64","os":"linux","config":{},"rootfs":{"type":"layers","diff_ids":[%s]}}' "$(IFS=,; echo "${diffs[*]}")")
    cd=$(printf '%s' "$cfg" | sha256sum | cut -d' ' -f1)
    printf '%s' "$cfg" >"$dir/blobs/sha256/$cd"
    man=$(printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[%s]}' \
        "$cd" "${#cfg}" "$(IFS=,; echo "${descs[*]}")")
    md=$(printf '%s' "$man" | sha256sum | cut -d' ' -f1)
    printf '%s' "$man" >"$dir/blobs/sha256/$md"
    printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"t"}}]}\n' \
        "$md" "${#man}" >"$dir/index.json"
}
SRC=$E2E_TMP/src
mkdir -p "$SRC/a/data" "$SRC/a/etc" "$SRC/b" "$SRC/c"
head -c $((24 << 20)) /dev/urandom >"$SRC/a/data/big.bin"
head -c $((3 << 20 | 12345)) /dev/urandom >"$SRC/a/data/mid.bin"
for i in 1 2 3 4 5; do seq $((i * 1000)) >"$SRC/a/etc/small$i.txt"; done
echo "hello from the fleet" >"$SRC/a/etc/motd"
head -c $((16 << 20)) /dev/urandom >"$SRC/b/slow.bin"
head -c $((1 << 20)) /dev/urandom >"$SRC/c/secret.bin"
mkdir -p "$SRC/d"
for i in $(seq 64); do head -c $((256 << 10)) /dev/urandom >"$SRC/d/late$i.bin"; done
IMG=$E2E_TMP/img
PRIV=$E2E_TMP/priv
layout "$IMG" "$SRC/a" "$SRC/b" "$SRC/d"
layout "$PRIV" "$SRC/c"
for d in "$IMG" "$PRIV"; do
    fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index --min-layer-size 0 --span 65536 "oci:$d:t"
    [[ $RC == 0 ]] || { show "$E2E_TMP/index.err"; e2e_die "ferry index of $d failed"; }
done
LAYER_A=$(oci_manifest "$IMG" t | jq -r '.layers[0].digest')
LAYER_B=$(oci_manifest "$IMG" t | jq -r '.layers[1].digest')
LAYER_D=$(oci_manifest "$IMG" t | jq -r '.layers[2].digest')
LAYER_C=$(oci_manifest "$PRIV" t | jq -r '.layers[0].digest')
SIZE_A=$(stat -c %s "$IMG/blobs/sha256/${LAYER_A#sha256:}")
SIZE_B=$(stat -c %s "$IMG/blobs/sha256/${LAYER_B#sha256:}")
SIZE_D=$(stat -c %s "$IMG/blobs/sha256/${LAYER_D#sha256:}")
# every other blob of the layout (config, manifest, the index artifact and its blobs)
META=$(($(du -bc "$IMG"/blobs/sha256/* | tail -1 | cut -f1) - SIZE_A - SIZE_B - SIZE_D))
# reference: each layer extracted by tar, md5 of every file
for l in a b d; do
    (cd "$SRC/$l" && find . -type f | sort | xargs md5sum) >"$E2E_TMP/ref-$l.md5"
done
e2e_log "layer A $LAYER_A ($SIZE_A bytes), layer B $LAYER_B ($SIZE_B bytes), other blobs $META bytes"

# ---------------------------------------------------------------- registries
: >"$E2E_TMP/open.toml"
start_ferry_registry open "$E2E_TMP/open.toml" "$HOST_IP:$(free_port)" || e2e_die "registry did not start"
OPEN=$REG_ADDR
IMAGE=$OPEN/fleet/app:v1
fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy --plain-http "oci:$IMG:t" "$IMAGE"
[[ $RC == 0 ]] || { show "$E2E_TMP/cp.err"; e2e_die "ferry copy to $IMAGE failed"; }

make_htpasswd "$E2E_TMP/htpasswd" pusher pushpw robot robotpw other otherpw || e2e_die "no htpasswd"
token_auth_toml "$E2E_TMP/auth.toml" 5m "private/** pusher *" "private/** robot pull" "other/** other *"
start_ferry_registry auth "$E2E_TMP/auth.toml" "$HOST_IP:$(free_port)" || e2e_die "auth registry did not start"
AUTH=$REG_ADDR
PIMAGE=$AUTH/private/app:v1
mkdir -p "$E2E_TMP/docker-pusher" "$E2E_TMP/docker-robot"
printf '{"auths":{"%s":{"auth":"%s"}}}\n' "$AUTH" "$(printf pusher:pushpw | base64 -w0)" >"$E2E_TMP/docker-pusher/config.json"
printf '{"auths":{"%s":{"auth":"%s"}}}\n' "$AUTH" "$(printf robot:robotpw | base64 -w0)" >"$E2E_TMP/docker-robot/config.json"
DOCKER_CONFIG=$E2E_TMP/docker-pusher fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy --plain-http "oci:$PRIV:t" "$PIMAGE"
[[ $RC == 0 ]] || { show "$E2E_TMP/cp.err"; e2e_die "ferry copy to $PIMAGE failed"; }
reach() { in_ns "$N" curl -s -o /dev/null --max-time 2 "http://$OPEN/v2/"; }
wait_for 10 "node $N reaches the registry" reach || e2e_die "namespace $(ns "$N") cannot reach http://$OPEN"
# The daemons see only robot's credentials.
export DOCKER_CONFIG=$E2E_TMP/docker-robot REGISTRY_AUTH_FILE=$E2E_TMP/no-auth.json
unset XDG_RUNTIME_DIR || true

# ---------------------------------------------------------------- daemons
head -c 32 /dev/urandom | sha256sum | cut -d' ' -f1 >"$E2E_TMP/p2p-token"
chmod 600 "$E2E_TMP/p2p-token"
TOKEN=$(cat "$E2E_TMP/p2p-token")
PEERS=$(for ((i = 1; i <= N; i++)); do printf '"%s:7050",' "$(node_ip "$i")"; done)
PEERS="[${PEERS%,}]"
PEER_TIMEOUT_MS=${P2P_PEER_TIMEOUT_MS:-2000}
declare -A DPID
sock() { echo "$E2E_TMP/n$1/daemon.sock"; }
start_daemon() {
    local i=$1 listen="$(node_ip "$1"):7050"
    [[ $i == "$BAD" ]] && listen=127.0.0.1:7051
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
[snapshotter]
enabled = false
[trace]
auto_record = false
[registry]
plain_http = ["$OPEN", "$AUTH"]
config_path = ""
[p2p]
enabled = true
listen = "$listen"
self_name = "$(node_ip "$i"):7050"
peers = $PEERS
token_file = "$E2E_TMP/p2p-token"
peer_timeout = "${PEER_TIMEOUT_MS}ms"
roots = $R
fan_out = 4
fallbacks = 2
penalty = "60s"
EOF
    in_ns "$i" "$FERRY" --log info daemon --config "$E2E_TMP/n$i/daemon.toml" >"$E2E_TMP/n$i.log" 2>&1 &
    DPID[$i]=$!
    E2E_PIDS+=("${DPID[$i]}")
}
for ((i = 1; i <= N; i++)); do start_daemon "$i"; done
# the corrupting proxy: in front of daemon $BAD's peer server, a byte of every body
# flipped while $E2E_TMP/corrupt exists
cat >"$E2E_TMP/proxy.py" <<'PY'
import http.client, http.server, os, sys, socketserver
listen, port, flag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        c = http.client.HTTPConnection("127.0.0.1", 7051, timeout=30)
        hdrs = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        c.request(self.command, self.path, headers=hdrs)
        r = c.getresponse()
        body = r.read()
        if body and os.path.exists(flag):
            b = bytearray(body); b[len(b) // 2] ^= 0x55; body = bytes(b)
            with open(flag + ".count", "a") as f: f.write("x\n")
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("content-length", "connection", "transfer-encoding"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD": self.wfile.write(body)
        c.close()
    do_HEAD = do_GET
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S((listen, port), H).serve_forever()
PY
in_ns "$BAD" python3 "$E2E_TMP/proxy.py" "$(node_ip "$BAD")" 7050 "$E2E_TMP/corrupt" >"$E2E_TMP/proxy.log" 2>&1 &
PROXY=$!
E2E_PIDS+=("$PROXY")
up() { timeout 5 "$FERRY" status --socket "$(sock "$1")" >/dev/null 2>&1; }
all_up() { local i; for ((i = 1; i <= N; i++)); do up "$i" || return 1; done; }
if wait_for 60 "daemons" all_up; then
    pass "$N daemons with [p2p] answer on their control sockets ($((SECONDS - T0))s since start)"
else
    for ((i = 1; i <= N; i++)); do up "$i" || { e2e_log "daemon $i down:"; tail -5 "$E2E_TMP/n$i.log" >&2; }; done
    fail "not every daemon came up"
    e2e_summary || exit 1
fi
proxy_up() {
    [[ $(in_ns 1 curl -s -o /dev/null -w '%{http_code}' --max-time 5 -H "Authorization: Bearer $TOKEN" \
        "http://$(node_ip "$BAD"):7050/v2/") == 200 ]]
}
wait_for 30 "the proxy" proxy_up || e2e_die "the proxy in front of daemon $BAD does not answer"

# status_json I: daemon I's `ferry status --json` (empty on failure)
status_json() { timeout 10 "$FERRY" status --socket "$(sock "$1")" --json 2>/dev/null || true; }
# p2p_sum FIELD I...: the sum of .p2p.FIELD over daemons I...
p2p_sum() {
    local f=$1 s=0 v i
    shift
    for i in "$@"; do
        v=$(status_json "$i" | jq -r ".p2p.$f // 0" 2>/dev/null)
        s=$((s + ${v:-0}))
    done
    echo "$s"
}
reg_blob_bytes() {
    curl -s --max-time 10 "http://$OPEN/metrics" |
        awk '/^ferry_registry_response_bytes_total\{route="blob_pull"\}/ { print $2 }' | head -1
}
# mount_layer I LAYER DIR IMAGE: daemon I mounts LAYER of IMAGE at DIR
mount_layer() {
    mkdir -p "$3"
    timeout "$FT" "$FERRY" mount --socket "$(sock "$1")" "$4" "$3" --layer "$2" \
        >"$E2E_TMP/n$1/mount.out" 2>"$E2E_TMP/n$1/mount.err"
}
ALL=()
for ((i = 1; i <= N; i++)); do ALL+=("$i"); done

# ---------------------------------------------------------------- 1+2. fleet start
echo "# 1. fleet start: $N daemons mount layer A and read every file at once"
before=$(reg_blob_bytes)
t1=$SECONDS
readers=()
for i in "${ALL[@]}"; do
    (
        m=$E2E_TMP/n$i/mnt-a
        mount_layer "$i" "$LAYER_A" "$m" "$IMAGE" || { echo "mount failed: $(tail -1 "$E2E_TMP/n$i/mount.err")" >"$E2E_TMP/n$i/a.md5"; exit 0; }
        (cd "$m" && timeout 120 find . -type f | sort | timeout 120 xargs md5sum) >"$E2E_TMP/n$i/a.md5" 2>&1
    ) &
    readers+=($!)
done
wait "${readers[@]}"
ok=0 bad=""
for i in "${ALL[@]}"; do
    if cmp -s "$E2E_TMP/n$i/a.md5" "$E2E_TMP/ref-a.md5"; then ok=$((ok + 1)); else bad+=" $i"; fi
done
if [[ $ok == "$N" ]]; then
    pass "all $N daemons read every file of layer A ($(wc -l <"$E2E_TMP/ref-a.md5") files, md5 equal to tar's) in $((SECONDS - t1))s"
else
    fail "layer A read wrong or failed on daemons:$bad"
    for i in $bad; do show "$E2E_TMP/n$i/a.md5" 3; done
fi
after=$(reg_blob_bytes)
egress=$((after - before))
layer_egress=$((egress - N * META))
SLACK=${P2P_SLACK:-$((3 * SIZE_A))}
limit=$((R * SIZE_A + SLACK))
from_peers=$(p2p_sum bytes_from_peers "${ALL[@]}")
from_origin=$(p2p_sum bytes_from_origin "${ALL[@]}")
served=$(p2p_sum bytes_served "${ALL[@]}")
fallbacks=$(p2p_sum fallbacks_to_origin "${ALL[@]}")
pfail=$(p2p_sum peer_failures "${ALL[@]}")
e2e_log "registry blob bytes: $egress ($(awk -v a="$egress" -v b="$SIZE_A" 'BEGIN { printf "%.2f", a / b }') x layer A); daemons: from peers $from_peers, from origin $from_origin, served $served, fallbacks to origin $fallbacks, peer failures $pfail"
if ((layer_egress <= limit)); then
    pass "registry sent layer A $(awk -v a="$layer_egress" -v b="$SIZE_A" 'BEGIN { printf "%.2f", a / b }') times over ($layer_egress bytes, limit R x blob + slack = $limit)"
else
    fail "registry sent $layer_egress bytes of layer A: $(awk -v a="$layer_egress" -v b="$SIZE_A" 'BEGIN { printf "%.2f", a / b }') x the blob, more than $limit"
fi
if ((from_peers > 0 && served > 0)); then
    pass "the daemons got $from_peers bytes from peers (served $served, from origin $from_origin)"
else
    fail "bytes_from_peers $from_peers, bytes_served $served (from origin $from_origin)"
fi

# ---------------------------------------------------------------- 3+4. deaths, a corrupt peer
echo "# 3. layer B read slowly by $N daemons; ${#KILLED[@]} killed mid-transfer; daemon $BAD's proxy corrupts every body"
touch "$E2E_TMP/corrupt"
corrupt_before=$(p2p_sum peer_corrupt "${ALL[@]}")
mpids=()
for i in "${ALL[@]}"; do
    mount_layer "$i" "$LAYER_B" "$E2E_TMP/n$i/mnt-b" "$IMAGE" &
    mpids+=($!)
done
mounted=0
for p in "${mpids[@]}"; do wait "$p" && mounted=$((mounted + 1)); done
[[ $mounted == "$N" ]] || fail "layer B: only $mounted of $N mounts succeeded"
# slow.py FILE PROGRESS: md5 of FILE read 1 MiB per 0.25 s, bytes read so far in PROGRESS
cat >"$E2E_TMP/slow.py" <<'PY'
import hashlib, sys, time
h = hashlib.md5(); n = 0
with open(sys.argv[1], "rb", buffering=0) as f:
    while True:
        b = f.read(1 << 20)
        if not b: break
        h.update(b); n += len(b)
        open(sys.argv[2], "w").write(str(n))
        time.sleep(0.25)
print(h.hexdigest())
PY
want_b=$(awk '$2 == "./slow.bin" { print $1 }' "$E2E_TMP/ref-b.md5")
SLOW_SIZE=$(stat -c %s "$SRC/b/slow.bin")
declare -A RPID
t3=$SECONDS
for i in "${ALL[@]}"; do
    echo 0 >"$E2E_TMP/n$i/progress"
    timeout 120 python3 "$E2E_TMP/slow.py" "$E2E_TMP/n$i/mnt-b/slow.bin" "$E2E_TMP/n$i/progress" \
        >"$E2E_TMP/n$i/b.md5" 2>"$E2E_TMP/n$i/b.err" &
    RPID[$i]=$!
done
# (empty while the reader rewrites the file: read as 0, not as a syntax error)
progress() {
    local p
    p=$(cat "$E2E_TMP/n$1/progress" 2>/dev/null) || true
    [[ $p =~ ^[0-9]+$ ]] || p=0
    echo "$p"
}
some_progress() { local i; for i in "${ALL[@]}"; do (($(progress "$i") >= 2 << 20)) && return 0; done; return 1; }
wait_for 60 "a reader past 2 MiB" some_progress || true
# a dead machine: the process gone and its link down (connects to it hang until timeout)
for i in "${KILLED[@]}"; do
    { kill -9 "${DPID[$i]}" && wait "${DPID[$i]}"; } 2>/dev/null || true
    ip link set "${TAG}h$i" down
done
tk=$SECONDS
unfinished=0
for i in "${ALL[@]}"; do (($(progress "$i") < SLOW_SIZE)) && unfinished=$((unfinished + 1)); done
e2e_log "killed daemons ${KILLED[*]} $((tk - t3))s into the read; $unfinished of $N readers unfinished"
for i in "${KILLED[@]}"; do { kill -9 "${RPID[$i]}" && wait "${RPID[$i]}"; } 2>/dev/null || true; done
LIVE=()
for i in "${ALL[@]}"; do [[ " ${KILLED[*]} " == *" $i "* ]] || LIVE+=("$i"); done
ok=0 bad=""
for i in "${LIVE[@]}"; do wait "${RPID[$i]}" || true; done
took=$((SECONDS - tk))
for i in "${LIVE[@]}"; do
    if [[ $(cat "$E2E_TMP/n$i/b.md5") == "$want_b" ]]; then ok=$((ok + 1)); else bad+=" $i"; fi
done
# each 1 MiB read may wait a peer_timeout on a dead parent before the registry; 30 s more
# for a loaded 2-core machine
bound=$(((SLOW_SIZE >> 20) * PEER_TIMEOUT_MS / 1000 + 30))
if ((unfinished == N)) && [[ $ok == "${#LIVE[@]}" ]] && ((took <= bound)); then
    pass "killed ${#KILLED[@]} daemons mid-read (every reader unfinished): all ${#LIVE[@]} others read slow.bin correctly ${took}s later (bound ${bound}s)"
else
    fail "after the kills: $unfinished/$N readers were unfinished, $ok/${#LIVE[@]} correct (wrong:$bad), ${took}s (bound ${bound}s)"
    for i in $bad; do show "$E2E_TMP/n$i/b.err" 3; done
fi

# ---------------------------------------------------------------- 4. a corrupt peer, for sure
# In 3 daemon $BAD may hold little when asked (404s carry no body to corrupt). Here it
# holds all of layer D before the others read it, so for nearly every piece someone asks
# it (as parent, or as a fallback after a parent that does not hold the piece yet).
echo "# 4. daemon $BAD reads layer D first; the other $((${#LIVE[@]} - 1)) live daemons then read it through a corrupting proxy"
# read_d I: md5 of every file of daemon I's layer D mount, as ref-d.md5 lists them
read_d() { (cd "$E2E_TMP/n$1/mnt-d" && timeout 120 find . -type f | sort | timeout 120 xargs md5sum) >"$E2E_TMP/n$1/d.md5" 2>&1; }
mount_layer "$BAD" "$LAYER_D" "$E2E_TMP/n$BAD/mnt-d" "$IMAGE" && read_d "$BAD"
cmp -s "$E2E_TMP/n$BAD/d.md5" "$E2E_TMP/ref-d.md5" || fail "daemon $BAD could not read layer D"
OTHERS=()
for i in "${LIVE[@]}"; do [[ $i == "$BAD" ]] || OTHERS+=("$i"); done
readers=()
for i in "${OTHERS[@]}"; do
    (mount_layer "$i" "$LAYER_D" "$E2E_TMP/n$i/mnt-d" "$IMAGE" && read_d "$i") &
    readers+=($!)
done
wait "${readers[@]}" || true
okd=0 badd=""
for i in "${OTHERS[@]}"; do
    if cmp -s "$E2E_TMP/n$i/d.md5" "$E2E_TMP/ref-d.md5"; then okd=$((okd + 1)); else badd+=" $i"; fi
done
corrupted=$(wc -l <"$E2E_TMP/corrupt.count" 2>/dev/null || echo 0)
corrupt_seen=$(($(p2p_sum peer_corrupt "${OTHERS[@]}") - corrupt_before))
failures=$(p2p_sum peer_failures "${OTHERS[@]}")
if ((corrupted > 0 && corrupt_seen > 0)) && [[ $ok == "${#LIVE[@]}" && $okd == "${#OTHERS[@]}" ]]; then
    pass "daemon $BAD's proxy corrupted $corrupted answers: the others counted $corrupt_seen corrupt (peer_failures $failures); every md5 of 3 and 4 right"
else
    fail "corrupt peer: proxy corrupted ${corrupted:-0} answers, others counted peer_corrupt $corrupt_seen; layer D right on $okd/${#OTHERS[@]} (wrong:$badd)"
fi
rm -f "$E2E_TMP/corrupt"

# ---------------------------------------------------------------- 5. pull rights
echo "# 5. a peer without pull rights for a private repository is refused"
PRIV_BLOB=$PRIV/blobs/sha256/${LAYER_C#sha256:}
if mount_layer 1 "$LAYER_C" "$E2E_TMP/n1/mnt-c" "$PIMAGE" &&
    [[ $(md5sum <"$E2E_TMP/n1/mnt-c/secret.bin" | cut -d' ' -f1) == $(md5sum <"$SRC/c/secret.bin" | cut -d' ' -f1) ]]; then
    pass "daemon 1 mounts $PIMAGE with robot's pull right and reads it"
else
    fail "daemon 1 could not mount or read $PIMAGE: $(tail -1 "$E2E_TMP/n1/mount.err")"
fi
# registry_token USER:PASS SCOPE: a token from the auth registry's token service
registry_token() {
    local chal realm service
    http_req GET "http://$AUTH/v2/"
    chal=$(http_header www-authenticate)
    realm=$(sed -n 's/.*realm="\([^"]*\)".*/\1/p' <<<"$chal")
    service=$(sed -n 's/.*service="\([^"]*\)".*/\1/p' <<<"$chal")
    [[ -n $realm ]] || return 1
    http_req GET "$realm" -G --data-urlencode "service=$service" --data-urlencode "scope=$2" -u "$1"
    [[ $HTTP_CODE == 200 ]] || return 1
    jq -er '.token // .access_token' "$HTTP_BODY"
}
ROBOT_TOK=$(registry_token robot:robotpw repository:private/app:pull) || e2e_die "no token for robot"
OTHER_TOK=$(registry_token other:otherpw repository:private/app:pull) || e2e_die "no token for other"
# peer_get FROM TOKEN CREDENTIAL: daemon FROM's namespace asks daemon 1's peer server for
# the first span of the private layer; sets CODE, body in $E2E_TMP/peer.body
peer_get() {
    local h=()
    [[ -n $2 ]] && h+=(-H "Authorization: Bearer $2")
    [[ -n $3 ]] && h+=(-H "X-Ferry-Registry-Authorization: $3")
    CODE=$(in_ns "$1" curl -s --max-time 10 -o "$E2E_TMP/peer.body" -w '%{http_code}' "${h[@]}" \
        -H 'Range: bytes=0-65535' "http://$(node_ip 1):7050/v2/private/app/blobs/$LAYER_C?ns=$AUTH") || true
    BYTES=$(stat -c %s "$E2E_TMP/peer.body" 2>/dev/null || echo 0)
}
peer_get 2 "$TOKEN" ""
if [[ $CODE == 403 && $BYTES == 0 ]]; then
    pass "cluster token, no registry credential: 403, no bytes"
else
    fail "cluster token, no registry credential: $CODE, $BYTES bytes"
fi
peer_get 2 "$TOKEN" "Bearer $OTHER_TOK"
if [[ $CODE == 403 && $BYTES == 0 ]]; then
    pass "cluster token, a token of a user without pull rights on private/app: 403, no bytes"
else
    fail "cluster token, other's token: $CODE, $BYTES bytes"
fi
peer_get 2 "" "Bearer $ROBOT_TOK"
if [[ $CODE == 401 && $BYTES == 0 ]]; then
    pass "robot's registry token without the cluster token: 401, no bytes"
else
    fail "no cluster token: $CODE, $BYTES bytes"
fi
peer_get 2 "$TOKEN" "Bearer $ROBOT_TOK"
if [[ $CODE == 206 ]] && cmp -s "$E2E_TMP/peer.body" <(head -c 65536 "$PRIV_BLOB"); then
    pass "control: cluster token and robot's token: 206 with the blob's first 64 KiB"
else
    fail "cluster token and robot's token: $CODE, $BYTES bytes (want 206 with the blob's bytes)"
fi

e2e_log "elapsed $((SECONDS - T0))s"
e2e_summary
