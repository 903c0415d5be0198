#!/usr/bin/env bash
# Registry LPM: ferry's registry versus Debian's docker-registry (distribution 2.8) on the
# same machine, same image, same request mix, htpasswd (bcrypt) auth on for both.
#
# Both registries get the same synthetic 5-layer image (pushed with skopeo). Then, one
# registry at a time, a node-start mix (manifest GET by tag, config GET, one 4 KiB ranged
# GET per layer) is driven at $CONNECTIONS connections by
#   1. `ferry bench registry` (token/Basic flow as the registry's challenge asks), and
#   2. wrk with bench/wrk/registry.lua (same mix; Authorization header prepared here:
#      a bearer token for ferry, Basic for docker-registry, as their challenges ask),
# and it prints LPM (layer requests per minute), p99, the ratios ferry / docker-registry,
# and each server's resident memory (VmRSS now, VmHWM peak) after its runs.
#
# Usage: bash bench/registry.sh
# Env: DURATION (s, default 30)  WARMUP (s, default 5)  CONNECTIONS (default 256)
#      RANGE (bytes per layer GET, default 4096)  WRK_THREADS (default: CPUs)
#      OUT (JSON results, default bench/out/registry-results.json)
#      SKIP_BUILD=1 (use $FERRY as is)
source "$(dirname "$0")/lib.sh"

DURATION=${DURATION:-30}
WARMUP=${WARMUP:-5}
CONNECTIONS=${CONNECTIONS:-256}
RANGE=${RANGE:-4096}
WRK_THREADS=${WRK_THREADS:-$(nproc)}
OUT=${OUT:-$BENCH_ROOT/bench/out/registry-results.json}
REPO=bench/app
IMAGE_TAG=v1
USER_NAME=bench
USER_PASS=bench-$RANDOM$RANDOM

for c in wrk docker-registry skopeo htpasswd jq curl python3; do
    command -v "$c" >/dev/null || { echo "registry.sh: missing $c (apt-get install wrk docker-registry skopeo apache2-utils jq curl)" >&2; exit 1; }
done
loopback_only

log() { printf '[registry.sh %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
load_now() { cut -d' ' -f1-3 /proc/loadavg; }

work=$(mktemp -d /tmp/ferry-bench-registry.XXXXXX)
pids=()
cleanup() {
    local rc=$? p
    set +e  # a killed server's `wait` status must not abort the cleanup
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# 256 (up to 10,000) connections per side need descriptors.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

log "building release ferry"
[[ ${SKIP_BUILD:-} == 1 ]] || ensure_ferry

# ---------------------------------------------------------------- image
# A synthetic 5-layer image (incompressible data, so sizes are what they say): layers of
# 2 MiB, 1 MiB, 512 KiB, 128 KiB and 8 KiB, like a base, runtime, deps, app and config.
log "writing the synthetic 5-layer image"
python3 - "$work/image" "$IMAGE_TAG" <<'EOF'
import gzip, hashlib, io, json, os, random, sys, tarfile
out, tag = sys.argv[1], sys.argv[2]
os.makedirs(f"{out}/blobs/sha256", exist_ok=True)
def put(data):
    d = hashlib.sha256(data).hexdigest()
    with open(f"{out}/blobs/sha256/{d}", "wb") as f:
        f.write(data)
    return f"sha256:{d}", len(data)
rng = random.Random(7)
layers, diff_ids = [], []
for i, size in enumerate([2 << 20, 1 << 20, 512 << 10, 128 << 10, 8 << 10]):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
        data = rng.randbytes(size)
        info = tarfile.TarInfo(f"layer{i}/data.bin"); info.size = size; info.mtime = 0
        t.addfile(info, io.BytesIO(data))
    tar = raw.getvalue()
    diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
    d, n = put(gzip.compress(tar, 6, mtime=0))
    layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": n})
config = json.dumps({"architecture": "amd64", "os": "linux",
                     "config": {"Cmd": ["/bin/true"]},
                     "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
cd, cn = put(config)
manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
                       "layers": layers}).encode()
md, mn = put(manifest)
json.dump({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
           "digest": md, "size": mn, "annotations": {"org.opencontainers.image.ref.name": tag}}]},
          open(f"{out}/index.json", "w"))
open(f"{out}/oci-layout", "w").write('{"imageLayoutVersion": "1.0.0"}')
EOF
manifest=$(manifest_of "$work/image" "$IMAGE_TAG")
CONFIG_DIGEST=$(jq -r .config.digest "$manifest")
LAYER_DIGESTS=$(jq -r '[.layers[].digest] | join(" ")' "$manifest")
LAYERS=$(jq '.layers | length' "$manifest")

htpasswd -Bbn "$USER_NAME" "$USER_PASS" >"$work/htpasswd" 2>/dev/null

# ---------------------------------------------------------------- registries
FERRY_PORT=$(free_port)
mkdir -p "$work/ferry-data"
cat >"$work/ferry.toml" <<EOF
addr = "127.0.0.1:$FERRY_PORT"

[storage]
type = "filesystem"
root = "$work/ferry-data"

[auth]
htpasswd = "$work/htpasswd"
token_ttl = "1h"

[limits]
# The load tester is one client opening every connection.
max_connections_per_client = $((CONNECTIONS + 64))
EOF
log "starting ferry registry on 127.0.0.1:$FERRY_PORT"
"$FERRY" registry serve --config "$work/ferry.toml" >"$work/ferry.log" 2>&1 &
FERRY_PID=$!
pids+=("$FERRY_PID")
wait_http "http://127.0.0.1:$FERRY_PORT/v2/" || { tail -20 "$work/ferry.log" >&2; exit 1; }

DIST_PORT=$(free_port)
mkdir -p "$work/dist-data"
cat >"$work/dist.yml" <<EOF
version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $work/dist-data
  cache:
    blobdescriptor: inmemory
  maintenance:
    uploadpurging:
      enabled: false
auth:
  htpasswd:
    realm: bench
    path: $work/htpasswd
http:
  addr: 127.0.0.1:$DIST_PORT
  secret: ferry-bench-not-secret
EOF
log "starting docker-registry on 127.0.0.1:$DIST_PORT"
docker-registry serve "$work/dist.yml" >"$work/dist.log" 2>&1 &
DIST_PID=$!
pids+=("$DIST_PID")
wait_http "http://127.0.0.1:$DIST_PORT/v2/" || { tail -20 "$work/dist.log" >&2; exit 1; }

echo '{"default":[{"type":"insecureAcceptAnything"}]}' >"$work/policy.json"
for port in "$FERRY_PORT" "$DIST_PORT"; do
    log "pushing $REPO:$IMAGE_TAG to 127.0.0.1:$port"
    skopeo --policy "$work/policy.json" copy -q --dest-tls-verify=false \
        --dest-creds "$USER_NAME:$USER_PASS" \
        "oci:$work/image:$IMAGE_TAG" "docker://127.0.0.1:$port/$REPO:$IMAGE_TAG"
done

# The Authorization value a node would end up sending to the registry on 127.0.0.1:$1.
auth_header_for() {
    local port=$1 challenge realm service
    challenge=$(curl -s -o /dev/null -D - --noproxy '*' "http://127.0.0.1:$port/v2/" |
        tr -d '\r' | sed -n 's/^[Ww][Ww][Ww]-[Aa]uthenticate: //p')
    case $challenge in
    Bearer*)
        realm=$(sed -n 's/.*realm="\([^"]*\)".*/\1/p' <<<"$challenge")
        service=$(sed -n 's/.*service="\([^"]*\)".*/\1/p' <<<"$challenge")
        printf 'Bearer %s' "$(curl -fsS --noproxy '*' -u "$USER_NAME:$USER_PASS" -G "$realm" \
            --data-urlencode "service=$service" --data-urlencode "scope=repository:$REPO:pull" |
            jq -r '.token // .access_token')"
        ;;
    Basic*) printf 'Basic %s' "$(printf '%s:%s' "$USER_NAME" "$USER_PASS" | base64 -w0)" ;;
    *) echo "registry.sh: unexpected challenge from 127.0.0.1:$port: '$challenge'" >&2; return 1 ;;
    esac
}

# ---------------------------------------------------------------- measurements
declare -A R
measure() { # NAME PORT PID
    local name=$1 port=$2 pid=$3 j w mem
    log "$name: ferry bench registry, $CONNECTIONS connections, ${DURATION}s after ${WARMUP}s warmup (load $(load_now))"
    R[$name.load_ferry]=$(load_now)
    j=$(FERRY_BENCH_CREDS="$USER_NAME:$USER_PASS" "$FERRY" bench registry --json \
        --connections "$CONNECTIONS" --duration "${DURATION}s" --warmup "${WARMUP}s" \
        --range "$RANGE" "127.0.0.1:$port/$REPO:$IMAGE_TAG")
    echo "$j" >"$work/$name-ferry.json"
    mem=$(mem_of "$pid")
    R[$name.mem_after_ferry]=$mem

    log "$name: wrk -t$WRK_THREADS -c$CONNECTIONS, ${WARMUP}s warmup then ${DURATION}s (load $(load_now))"
    export WRK_REPO=$REPO WRK_TAG=$IMAGE_TAG WRK_CONFIG=$CONFIG_DIGEST WRK_LAYERS=$LAYER_DIGESTS WRK_RANGE=$RANGE
    WRK_AUTH=$(auth_header_for "$port")
    export WRK_AUTH
    wrk -t"$WRK_THREADS" -c"$CONNECTIONS" -d"${WARMUP}s" -s bench/wrk/registry.lua \
        "http://127.0.0.1:$port" >/dev/null
    R[$name.load_wrk]=$(load_now)
    w=$(wrk -t"$WRK_THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --timeout 10s -s bench/wrk/registry.lua \
        "http://127.0.0.1:$port")
    echo "$w" >"$work/$name-wrk.txt"
    sed -n 's/^WRKJSON //p' <<<"$w" >"$work/$name-wrk.json"
    R[$name.mem_after_wrk]=$(mem_of "$pid")
}

measure ferry "$FERRY_PORT" "$FERRY_PID"
measure docker-registry "$DIST_PORT" "$DIST_PID"

# ---------------------------------------------------------------- report
wrk_lpm() { jq --argjson l "$LAYERS" '.requests / .seconds * 60 * $l / ($l + 2)' "$work/$1-wrk.json"; }
f_lpm=$(jq .lpm "$work/ferry-ferry.json"); d_lpm=$(jq .lpm "$work/docker-registry-ferry.json")
f_wlpm=$(wrk_lpm ferry); d_wlpm=$(wrk_lpm docker-registry)
row() { # NAME
    local n=$1
    printf '%-16s %14.0f %9.2f %7s %14.0f %9.2f %7s %10s %10s\n' "$n" \
        "$(jq .lpm "$work/$n-ferry.json")" "$(jq .overall.p99_ms "$work/$n-ferry.json")" \
        "$(jq .errors_total "$work/$n-ferry.json")" \
        "$(wrk_lpm "$n")" "$(jq '.latency_us.p99 / 1000' "$work/$n-wrk.json")" \
        "$(jq '.errors | add' "$work/$n-wrk.json")" \
        "$(cut -d' ' -f1 <<<"${R[$n.mem_after_wrk]}")" "$(cut -d' ' -f2 <<<"${R[$n.mem_after_wrk]}")"
}
echo
echo "Registry LPM, $CONNECTIONS connections, ${DURATION}s (+${WARMUP}s warmup), $LAYERS layers, ${RANGE}-byte layer GETs, auth on; $(nproc) CPUs"
printf '%-16s %14s %9s %7s %14s %9s %7s %10s %10s\n' registry "LPM (ferry)" "p99 ms" errors "LPM (wrk)" "p99 ms" errors "RSS KiB" "HWM KiB"
row ferry
row docker-registry
printf 'ratio ferry/docker-registry: %s (ferry bench registry), %s (wrk)\n' \
    "$(ratio "$f_lpm" "$d_lpm")" "$(ratio "$f_wlpm" "$d_wlpm")"
printf 'load average at start of each run: ferry %s / %s, docker-registry %s / %s\n' \
    "${R[ferry.load_ferry]}" "${R[ferry.load_wrk]}" "${R[docker-registry.load_ferry]}" "${R[docker-registry.load_wrk]}"
echo
echo "ferry bench registry against ferry:"
jq -r '.kinds[] | "  \(.kind): \(.requests) req, \(.requests_per_s | floor)/s, p50 \(.p50_ms) ms, p99 \(.p99_ms) ms, max \(.max_ms) ms, errors \(.errors)"' "$work/ferry-ferry.json"
echo "ferry bench registry against docker-registry:"
jq -r '.kinds[] | "  \(.kind): \(.requests) req, \(.requests_per_s | floor)/s, p50 \(.p50_ms) ms, p99 \(.p99_ms) ms, max \(.max_ms) ms, errors \(.errors)"' "$work/docker-registry-ferry.json"

mkdir -p "$(dirname "$OUT")"
jq -n --slurpfile ff "$work/ferry-ferry.json" --slurpfile fw "$work/ferry-wrk.json" \
    --slurpfile df "$work/docker-registry-ferry.json" --slurpfile dw "$work/docker-registry-wrk.json" \
    --arg fmem "${R[ferry.mem_after_wrk]}" --arg dmem "${R[docker-registry.mem_after_wrk]}" \
    --arg fload "${R[ferry.load_ferry]}" --arg dload "${R[docker-registry.load_ferry]}" \
    --argjson layers "$LAYERS" \
    '{layers: $layers,
      ferry: {tester: $ff[0], wrk: $fw[0], rss_hwm_kib: $fmem, load: $fload},
      docker_registry: {tester: $df[0], wrk: $dw[0], rss_hwm_kib: $dmem, load: $dload}}' >"$OUT"
log "results in $OUT"
