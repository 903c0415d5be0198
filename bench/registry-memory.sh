#!/usr/bin/env bash
# bench/registry-memory.sh — resident memory of ferry's registry with a ~10 GB store: idle
# after a restart, after a catalog/tag/manifest sweep, and under load (issue 3: "Memory:
# resident size under load and with a 10 GB store").
#
# The store is built honestly, through the registry API with auth on: REPOS repositories
# (mem/r00…) × IMAGES tags × LAYERS layers of LAYER_MB MB of random bytes (AES-CTR keystream
# with a random key, i.e. incompressible and all distinct), each image with its own config
# and OCI manifest; every blob is a POST + PUT?digest= upload (the server hashes and fsyncs
# it). Default 50 × 4 × 5 × 10 MB = 1,000 blobs, 10 GB.
# Then the server is restarted on the store and VmRSS / VmHWM (/proc/PID/status) are read:
#   1. empty store, just started (for reference; a separate process on an empty root)
#   2. 10 GB store, just started (after 3 s idle)
#   3. after a sweep: catalog (n=100 pages, Link followed), every tag list, every manifest GET
#   4. under `ferry bench registry` at CONNECTIONS connections for DURATION s against
#      mem/r00:v1, the node-start mix of bench/registry.sh (4 KiB ranged GET per layer)
#   5. same with whole-layer GETs (--range 0: every request streams a 10 MB blob)
# RSS is sampled every 0.5 s during each load run (peak sampled) and VmHWM is the
# process's peak since the restart.
# With DOCKER_REGISTRY=1 the same is done for Debian's docker-registry (distribution 2.8)
# on its own store built the same way (after ferry's store is deleted, so the disk holds
# one store at a time).
#
# Usage: nice bash bench/registry-memory.sh
# Env: REPOS (50) IMAGES (4) LAYERS (5) LAYER_MB (10) PUSH_THREADS (3) CONNECTIONS (256)
#      DURATION (s, 20) WARMUP (s, 3) DOCKER_REGISTRY=1 KEEP_STORE=1 (keep the stores and
#      reuse a complete one next run) WORK (bench/out/registry-memory)
#      OUT (bench/out/registry-memory.json) SKIP_BUILD=1 (use $FERRY as is)
# Needs: python3, curl, jq, htpasswd (apache2-utils); docker-registry for DOCKER_REGISTRY=1.
source "$(dirname "$0")/lib.sh"

REPOS=${REPOS:-50}
IMAGES=${IMAGES:-4}
LAYERS=${LAYERS:-5}
LAYER_MB=${LAYER_MB:-10}
PUSH_THREADS=${PUSH_THREADS:-3}
CONNECTIONS=${CONNECTIONS:-256}
DURATION=${DURATION:-20}
WARMUP=${WARMUP:-3}
WORK=$(realpath -m "${WORK:-$BENCH_ROOT/bench/out/registry-memory}")
OUT=${OUT:-$BENCH_ROOT/bench/out/registry-memory.json}
USER_NAME=bench
USER_PASS=bench-$RANDOM$RANDOM
STORE_GB=$(((REPOS * IMAGES * LAYERS * LAYER_MB + 999) / 1000))

need=(python3 curl jq htpasswd)
[[ ${DOCKER_REGISTRY:-} == 1 ]] && need+=(docker-registry)
for c in "${need[@]}"; do
    command -v "$c" >/dev/null || { echo "SKIP: $c not installed"; exit 0; }
done
loopback_only

log() { printf '[registry-memory %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
mib() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1024 }'; }

mkdir -p "$WORK"
avail_gb=$(df --output=avail -B1G "$WORK" | tail -1 | tr -d ' ')
if [[ ! -f $WORK/ferry-data/.complete && $avail_gb -lt $((STORE_GB + 15)) ]]; then
    echo "SKIP: $avail_gb GB free under $WORK; a $STORE_GB GB store needs at least $((STORE_GB + 15)) GB free"
    exit 0
fi

pids=()
cleanup() {
    local rc=$? p
    set +e
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    if [[ ${KEEP_STORE:-} != 1 ]]; then
        rm -rf "$WORK/ferry-data" "$WORK/dist-data" "$WORK/empty-data"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

if [[ ${SKIP_BUILD:-} != 1 ]]; then
    log "building release ferry"
    ensure_ferry
fi
[[ -x $FERRY ]] || { echo "registry-memory.sh: no ferry binary at $FERRY" >&2; exit 1; }
htpasswd -Bbn "$USER_NAME" "$USER_PASS" >"$WORK/htpasswd" 2>/dev/null

# ---------------------------------------------------------------- helpers (python)
cat >"$WORK/push.py" <<'PY'
"""Push REPOS x IMAGES images of LAYERS random layers each through the OCI API."""
import base64, hashlib, http.client, json, os, sys, threading, time, urllib.parse
addr, user, pw = sys.argv[1], sys.argv[2], sys.argv[3]
repos, images, layers, layer_bytes, threads = map(int, sys.argv[4:9])
auth = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()
try:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    key = os.urandom(32)
    def random_bytes(n, nonce):
        enc = Cipher(algorithms.AES(key), modes.CTR(nonce.to_bytes(16, "big"))).encryptor()
        return enc.update(bytes(n))
except ImportError:
    def random_bytes(n, nonce):
        return os.urandom(n)

class Client:
    def __init__(self):
        host, port = addr.split(":")
        self.c = http.client.HTTPConnection(host, int(port), timeout=300)
    def req(self, method, path, body=None, headers=None, want=(200,)):
        h = {"Authorization": auth}
        h.update(headers or {})
        for attempt in range(3):
            try:
                self.c.request(method, path, body=body, headers=h)
                r = self.c.getresponse()
                data = r.read()
                break
            except (http.client.HTTPException, OSError):
                self.c.close()
                if attempt == 2:
                    raise
        if r.status not in want:
            raise RuntimeError(f"{method} {path} -> {r.status} {data[:200]!r}")
        return r, data
    def blob(self, repo, data):
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        r, _ = self.req("POST", f"/v2/{repo}/blobs/uploads/", want=(202,))
        loc = urllib.parse.urlsplit(r.getheader("Location"))
        path = loc.path + "?" + (loc.query + "&" if loc.query else "") + "digest=" + d
        self.req("PUT", path, data, {"Content-Type": "application/octet-stream",
                                     "Content-Length": str(len(data))}, want=(201,))
        return {"digest": d, "size": len(data)}

jobs = [(r, i) for r in range(repos) for i in range(images)]
lock = threading.Lock()
done = {"images": 0, "bytes": 0}
errors = []
t0 = time.time()
def work():
    c = Client()
    while True:
        with lock:
            if not jobs or errors:
                return
            r, i = jobs.pop(0)
        try:
            repo = f"mem/r{r:02d}"
            ls = []
            for l in range(layers):
                nonce = (r * images + i) * 1000 + l
                ls.append(dict(c.blob(repo, random_bytes(layer_bytes, nonce)),
                               mediaType="application/vnd.oci.image.layer.v1.tar+gzip"))
            cfg = json.dumps({"architecture": "amd64", "os": "linux",
                              "config": {"Cmd": ["/bin/true"]},
                              "rootfs": {"type": "layers", "diff_ids": [x["digest"] for x in ls]},
                              "ferry.bench": f"{repo}:v{i + 1}"}).encode()
            cd = dict(c.blob(repo, cfg), mediaType="application/vnd.oci.image.config.v1+json")
            m = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                            "config": cd, "layers": ls}).encode()
            c.req("PUT", f"/v2/{repo}/manifests/v{i + 1}", m,
                  {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}, want=(201,))
            with lock:
                done["images"] += 1
                done["bytes"] += layers * layer_bytes
                if done["images"] % 20 == 0:
                    el = time.time() - t0
                    print(f"  {done['images']}/{repos * images} images, {done['bytes'] / 1e9:.1f} GB, "
                          f"{done['bytes'] / 1e6 / el:.0f} MB/s", file=sys.stderr, flush=True)
        except Exception as e:  # report and stop every worker
            with lock:
                errors.append(repr(e))
            return
ts = [threading.Thread(target=work) for _ in range(threads)]
for t in ts: t.start()
for t in ts: t.join()
if errors:
    sys.exit(f"push failed: {errors[0]}")
el = time.time() - t0
print(json.dumps({"images": done["images"], "blobs": done["images"] * (layers + 1),
                  "bytes": done["bytes"], "seconds": round(el, 1),
                  "mb_per_s": round(done["bytes"] / 1e6 / el, 1)}))
PY
cat >"$WORK/sweep.py" <<'PY'
"""Catalog (paginated, Link followed), every tag list, every manifest GET."""
import base64, http.client, json, re, sys, time
addr, user, pw = sys.argv[1:4]
host, port = addr.split(":")
c = http.client.HTTPConnection(host, int(port), timeout=60)
auth = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()
def get(path, accept=None):
    h = {"Authorization": auth}
    if accept:
        h["Accept"] = accept
    c.request("GET", path, headers=h)
    r = c.getresponse()
    body = r.read()
    if r.status != 200:
        raise SystemExit(f"GET {path} -> {r.status} {body[:200]!r}")
    return r, body
t0 = time.time()
repos, path, pages = [], "/v2/_catalog?n=100", 0
while path:
    r, body = get(path)
    pages += 1
    repos += json.loads(body)["repositories"]
    m = re.search(r"<([^>]+)>", r.getheader("Link") or "")
    path = m.group(1) if m else None
    if path and path.startswith("http"):
        path = "/" + path.split("/", 3)[3]
tags = manifests = 0
for repo in repos:
    _, body = get(f"/v2/{repo}/tags/list")
    ts = json.loads(body).get("tags") or []
    tags += len(ts)
    for t in ts:
        get(f"/v2/{repo}/manifests/{t}", "application/vnd.oci.image.manifest.v1+json")
        manifests += 1
print(json.dumps({"catalog_pages": pages, "repositories": len(repos), "tags": tags,
                  "manifests": manifests, "seconds": round(time.time() - t0, 2)}))
PY

# ---------------------------------------------------------------- servers
SERVER_PID=""
start_ferry() { # ROOT
    local port
    port=$(free_port)
    SERVER_ADDR=127.0.0.1:$port
    cat >"$WORK/ferry.toml" <<EOF
[storage]
type = "filesystem"
root = "$1"

[auth]
htpasswd = "$WORK/htpasswd"
token_ttl = "1h"

[limits]
# The load tester is one client opening every connection.
max_connections_per_client = $((CONNECTIONS + 64))
EOF
    "$FERRY" registry serve --config "$WORK/ferry.toml" --addr "$SERVER_ADDR" >>"$WORK/ferry.log" 2>&1 &
    SERVER_PID=$!
    pids+=("$SERVER_PID")
    wait_http "http://$SERVER_ADDR/v2/" || { tail -20 "$WORK/ferry.log" >&2; exit 1; }
}
start_dist() { # ROOT
    local port
    port=$(free_port)
    SERVER_ADDR=127.0.0.1:$port
    cat >"$WORK/dist.yml" <<EOF
version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $1
  cache:
    blobdescriptor: inmemory
  maintenance:
    uploadpurging:
      enabled: false
auth:
  htpasswd:
    realm: bench
    path: $WORK/htpasswd
http:
  addr: $SERVER_ADDR
  secret: ferry-bench-not-secret
EOF
    docker-registry serve "$WORK/dist.yml" >>"$WORK/dist.log" 2>&1 &
    SERVER_PID=$!
    pids+=("$SERVER_PID")
    wait_http "http://$SERVER_ADDR/v2/" || { tail -20 "$WORK/dist.log" >&2; exit 1; }
}
stop_server() {
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
# sample_rss PID FILE: every 0.5 s, the highest VmRSS seen so far (KiB) into FILE
sample_rss() {
    local max=0 r
    while kill -0 "$1" 2>/dev/null; do
        r=$(awk '/^VmRSS:/ { print $2 }' "/proc/$1/status" 2>/dev/null) || break
        ((r > max)) && max=$r && echo "$max" >"$2"
        sleep 0.5
    done
}

declare -A M
# measure NAME START_FN: build (or reuse) NAME's store, restart, measure; results in M[NAME.*]
measure() {
    local name=$1 start=$2 root=$WORK/$1-data j
    log "$name: empty store, just started"
    rm -rf "$WORK/empty-data"
    mkdir -p "$WORK/empty-data"
    "$start" "$WORK/empty-data"
    sleep 3
    M[$name.empty]=$(mem_of "$SERVER_PID")
    stop_server
    rm -rf "$WORK/empty-data"

    if [[ -f $root/.complete ]]; then
        log "$name: reusing the complete store in $root"
        M[$name.push]=$(cat "$root/.complete")
    else
        rm -rf "$root"
        mkdir -p "$root"
        "$start" "$root"
        log "$name: pushing $REPOS x $IMAGES images x $LAYERS layers of $LAYER_MB MB through the API ($PUSH_THREADS threads)"
        j=$(python3 "$WORK/push.py" "$SERVER_ADDR" "$USER_NAME" "$USER_PASS" \
            "$REPOS" "$IMAGES" "$LAYERS" $((LAYER_MB * 1000 * 1000)) "$PUSH_THREADS")
        M[$name.push]=$j
        M[$name.after_push]=$(mem_of "$SERVER_PID")
        echo "$j" >"$root/.complete"
        stop_server
    fi
    M[$name.du]=$(du -sh "$root" | cut -f1)
    M[$name.files]=$(find "$root" -type f | wc -l)

    log "$name: restart on the ${M[$name.du]} store"
    "$start" "$root"
    sleep 3
    M[$name.idle]=$(mem_of "$SERVER_PID")

    log "$name: catalog / tags / manifests sweep"
    M[$name.sweep_json]=$(python3 "$WORK/sweep.py" "$SERVER_ADDR" "$USER_NAME" "$USER_PASS")
    M[$name.sweep]=$(mem_of "$SERVER_PID")

    local range mode
    for range in 4096 0; do
        mode=ranged
        [[ $range == 0 ]] && mode=whole
        log "$name: ferry bench registry --connections $CONNECTIONS --duration ${DURATION}s --range $range mem/r00:v1"
        echo 0 >"$WORK/rss.max"
        sample_rss "$SERVER_PID" "$WORK/rss.max" &
        local sampler=$!
        j=$(FERRY_BENCH_CREDS="$USER_NAME:$USER_PASS" "$FERRY" bench registry --json \
            --connections "$CONNECTIONS" --duration "${DURATION}s" --warmup "${WARMUP}s" \
            --range "$range" --timeout 60s "$SERVER_ADDR/mem/r00:v1")
        kill "$sampler" 2>/dev/null || true
        wait "$sampler" 2>/dev/null || true
        M[$name.load_$mode]="$(mem_of "$SERVER_PID") $(cat "$WORK/rss.max")"
        M[$name.load_${mode}_json]=$j
    done
    stop_server
    if [[ ${KEEP_STORE:-} != 1 ]]; then
        rm -rf "$root"
    fi
}

measure ferry start_ferry
[[ ${DOCKER_REGISTRY:-} == 1 ]] && measure dist start_dist

# ---------------------------------------------------------------- report
row() { # LABEL "rss hwm [sampled_max]"
    local rss hwm peak
    read -r rss hwm peak <<<"$2"
    printf '%-44s %10s %10s %14s\n' "$1" "$(mib "$rss")" "$(mib "$hwm")" "${peak:+$(mib "$peak")}"
}
report() { # NAME LABEL
    local n=$1
    echo
    echo "$2: store ${M[$n.du]} on disk, ${M[$n.files]} files; push: ${M[$n.push]}"
    echo "sweep: ${M[$n.sweep_json]}"
    printf '%-44s %10s %10s %14s\n' "state" "RSS MiB" "HWM MiB" "peak RSS MiB"
    row "empty store, idle after start" "${M[$n.empty]}"
    [[ -n ${M[$n.after_push]:-} ]] && row "after pushing the store (same process)" "${M[$n.after_push]}"
    row "$STORE_GB GB store, idle after restart" "${M[$n.idle]}"
    row "after catalog/tags/manifests sweep" "${M[$n.sweep]}"
    row "under load: 4 KiB ranged layer GETs" "${M[$n.load_ranged]}"
    row "under load: whole ${LAYER_MB} MB layer GETs" "${M[$n.load_whole]}"
    jq -r --arg m ranged '"  load (\($m)): LPM \(.lpm | floor), p99 \(.overall.p99_ms) ms, errors \(.errors_total)"' <<<"${M[$n.load_ranged_json]}"
    jq -r --arg m whole '"  load (\($m)): LPM \(.lpm | floor), p99 \(.overall.p99_ms) ms, errors \(.errors_total)"' <<<"${M[$n.load_whole_json]}"
}
echo
echo "Registry memory, $(nproc) CPUs, $CONNECTIONS connections, ${DURATION}s load runs (+${WARMUP}s warmup), auth on"
report ferry "ferry registry"
[[ ${DOCKER_REGISTRY:-} == 1 ]] && report dist "docker-registry (distribution 2.8)"

mkdir -p "$(dirname "$OUT")"
{
    for k in "${!M[@]}"; do printf '%s\t%s\n' "$k" "${M[$k]}"; done
} | jq -R -s 'split("\n") | map(select(length > 0) | split("\t") | {(.[0]): .[1]}) | add' >"$OUT"
log "results in $OUT"
