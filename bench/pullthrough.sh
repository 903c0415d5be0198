#!/usr/bin/env bash
# bench/pullthrough.sh — pull-through fan-out: CLIENTS clients ask a cold ferry pull-through
# cache for the same SIZE_MB blob at once. Reports how many times upstream was asked (must
# be 1) and the last client's finish time against one fetch of the same blob.
#
# Upstream is Debian's docker-registry (distribution 2.8) on 127.0.0.1 holding a random
# blob; ferry runs `registry serve` with an [upstream] section pointing at it.
#
#   bash bench/pullthrough.sh                  # 500 clients, 100 MB, unthrottled upstream
#   UPSTREAM_RATE=50 bash bench/pullthrough.sh # upstream behind a 50 MB/s link (WAN-like)
#
# Env: SIZE_MB (100), CLIENTS (500), PROCS (curl processes sharing the clients, 10),
#      UPSTREAM_RATE (MB/s through a throttling proxy; empty = direct), KEEP=1 keeps $WORK,
#      DIRECT_FANOUT=1 (default) also sends the same clients straight to docker-registry, for
#      what this machine can deliver to that many clients without any cache.
# Needs: docker-registry, curl (>= 7.66, --parallel), jq, python3, sha256sum.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

SIZE_MB=${SIZE_MB:-100}
CLIENTS=${CLIENTS:-500}
PROCS=${PROCS:-10}
UPSTREAM_RATE=${UPSTREAM_RATE:-}
REPO=bench/pullthrough

for cmd in docker-registry curl jq python3 sha256sum; do
    command -v "$cmd" >/dev/null || { echo "SKIP: $cmd not installed"; exit 0; }
done
[ -x "$FERRY" ] || ensure_ferry
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"

WORK=$(mktemp -d /tmp/ferry-pullthrough.XXXXXX)
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [ "${KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT


# ---- upstream: docker-registry with an access log (one line per request)
REG_PORT=$(free_port)
mkdir -p "$WORK/registry"
cat >"$WORK/registry.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $WORK/registry
  cache:
    blobdescriptor: inmemory
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:$REG_PORT
  secret: ferry-bench-not-secret
EOF
docker-registry serve "$WORK/registry.yml" >"$WORK/registry.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$REG_PORT/v2/"

head -c $((SIZE_MB << 20)) /dev/urandom >"$WORK/blob"
DIGEST=sha256:$(sha256sum "$WORK/blob" | cut -d' ' -f1)
LOCATION=$(curl -sf -D - -o /dev/null -X POST "http://127.0.0.1:$REG_PORT/v2/$REPO/blobs/uploads/" |
    tr -d '\r' | awk 'tolower($1) == "location:" { print $2 }')
case $LOCATION in http*) ;; *) LOCATION="http://127.0.0.1:$REG_PORT$LOCATION" ;; esac
case $LOCATION in *\?*) SEP='&' ;; *) SEP='?' ;; esac
curl -sf -X PUT -H 'Content-Type: application/octet-stream' --data-binary @"$WORK/blob" \
    "$LOCATION${SEP}digest=$DIGEST" -o /dev/null

UPSTREAM_PORT=$REG_PORT
if [ -n "$UPSTREAM_RATE" ]; then
    # A TCP proxy that paces upstream->client bytes at UPSTREAM_RATE MB/s per connection.
    UPSTREAM_PORT=$(free_port)
    python3 - "$UPSTREAM_PORT" "$REG_PORT" "$UPSTREAM_RATE" <<'PY' &
import asyncio, sys, time
listen, target, rate = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]) * (1 << 20)
async def pipe(reader, writer, paced):
    start, sent = time.monotonic(), 0
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
            if paced:
                sent += len(data)
                ahead = sent / rate - (time.monotonic() - start)
                if ahead > 0:
                    await asyncio.sleep(ahead)
    finally:
        writer.close()
async def handle(client_r, client_w):
    up_r, up_w = await asyncio.open_connection("127.0.0.1", target)
    await asyncio.gather(pipe(client_r, up_w, False), pipe(up_r, client_w, True),
                         return_exceptions=True)
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()
asyncio.run(main())
PY
    PIDS+=($!)
    wait_http "http://127.0.0.1:$UPSTREAM_PORT/v2/"
fi
upstream_blob_gets() { grep -c "\"GET /v2/$REPO/blobs/$DIGEST" "$WORK/registry.log" || true; }

start_ferry() { # NAME -> sets FERRY_URL, FERRY_PID
    local name=$1 port
    port=$(free_port)
    mkdir -p "$WORK/$name"
    cat >"$WORK/$name.toml" <<EOF
addr = "127.0.0.1:$port"

[storage]
type = "filesystem"
root = "$WORK/$name/data"

[upstream]
url = "http://127.0.0.1:$UPSTREAM_PORT"
cache_dir = "$WORK/$name/cache"
max_bytes = $((4 * SIZE_MB << 20))
EOF
    "$FERRY" registry serve --config "$WORK/$name.toml" >"$WORK/$name.log" 2>&1 &
    FERRY_PID=$!
    PIDS+=("$FERRY_PID")
    FERRY_URL="http://127.0.0.1:$port"
    wait_http "$FERRY_URL/v2/"
}
fetch_time() { # URL -> seconds for one GET (checks size)
    local out
    out=$(curl -sf -o /dev/null -w '%{size_download} %{time_total}' "$1")
    [ "${out% *}" = $((SIZE_MB << 20)) ] || { echo "short download: $out" >&2; return 1; }
    echo "${out#* }"
}

echo "blob: $SIZE_MB MB $DIGEST; upstream ${UPSTREAM_RATE:+paced at $UPSTREAM_RATE MB/s, }docker-registry 127.0.0.1:$REG_PORT"

# ---- one fetch straight from upstream, and one cold fetch through a fresh ferry
T_DIRECT=$(fetch_time "http://127.0.0.1:$UPSTREAM_PORT/v2/$REPO/blobs/$DIGEST")
start_ferry single
T_SINGLE=$(fetch_time "$FERRY_URL/v2/$REPO/blobs/$DIGEST")
T_WARM=$(fetch_time "$FERRY_URL/v2/$REPO/blobs/$DIGEST")
kill "$FERRY_PID"

fanout() { # URL TAG -> runs CLIENTS (+5 checked) clients, sets T_LAST
    local url=$1 tag=$2 per left n p cfg pid i start
    per=$(((CLIENTS + PROCS - 1) / PROCS))
    left=$CLIENTS
    rm -f "$WORK"/curl-*.cfg "$WORK"/curl-*.out "$WORK"/check-*
    for p in $(seq "$PROCS"); do
        n=$((left < per ? left : per))
        left=$((left - n))
        [ "$n" -gt 0 ] || break
        for _ in $(seq "$n"); do
            printf 'url = "%s"\noutput = "/dev/null"\n' "$url"
        done >"$WORK/curl-$tag-$p.cfg"
    done
    # Five more clients keep their bytes, so content is checked, not just sizes.
    start=$(now)
    local curls=()
    for cfg in "$WORK"/curl-"$tag"-*.cfg; do
        curl -s --no-progress-meter --parallel --parallel-immediate --parallel-max 1000 -K "$cfg" \
            -w '%{http_code} %{size_download} %{time_total}\n' >"${cfg%.cfg}.out" &
        curls+=($!)
    done
    for i in 1 2 3 4 5; do
        curl -s -o "$WORK/check-$i" "$url" &
        curls+=($!)
    done
    for pid in "${curls[@]}"; do wait "$pid" || true; done
    T_LAST=$(since "$start")
}

# ---- the fan-out: CLIENTS at once against another cold ferry
start_ferry fanout
GETS_BEFORE=$(upstream_blob_gets)
fanout "$FERRY_URL/v2/$REPO/blobs/$DIGEST" ferry
GETS=$(($(upstream_blob_gets) - GETS_BEFORE))
FETCHES=$(curl -s "$FERRY_URL/metrics" | awk '/^ferry_registry_upstream_fetches_total/ { print $2 }')

OK=$(cat "$WORK"/curl-ferry-*.out | awk -v size=$((SIZE_MB << 20)) '$1 == 200 && $2 == size' | wc -l)
P50=$(cat "$WORK"/curl-ferry-*.out | awk '{ print $3 }' | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
GOOD=0
for i in 1 2 3 4 5; do
    [ "sha256:$(sha256sum "$WORK/check-$i" | cut -d' ' -f1)" = "$DIGEST" ] && GOOD=$((GOOD + 1))
done
RSS=$(awk '/VmHWM/ { print $2 / 1024 }' "/proc/$FERRY_PID/status")
T_FERRY=$T_LAST
kill "$FERRY_PID"
T_DIRECT_FANOUT=skipped
if [ "${DIRECT_FANOUT:-1}" = 1 ]; then
    fanout "http://127.0.0.1:$UPSTREAM_PORT/v2/$REPO/blobs/$DIGEST" direct
    T_DIRECT_FANOUT="$T_LAST s ($(($(upstream_blob_gets) - GETS_BEFORE - GETS)) upstream GETs)"
fi

cat <<EOF

| measure | value |
|---|---|
| clients (curl, $PROCS processes) | $CLIENTS (+5 checked) |
| complete 200 responses of $SIZE_MB MB | $OK / $CLIENTS |
| content checked by sha256 | $GOOD / 5 |
| upstream blob GETs (docker-registry log) | $GETS |
| ferry upstream fetches (/metrics) | $FETCHES |
| one fetch straight from upstream | ${T_DIRECT} s |
| one cold fetch through ferry | ${T_SINGLE} s |
| one warm fetch through ferry (disk hit) | ${T_WARM} s |
| median client, fan-out | ${P50} s |
| last client finished, fan-out | ${T_FERRY} s |
| last client / one cold fetch through ferry | $(ratio "$T_FERRY" "$T_SINGLE")x |
| last client / one fetch from upstream | $(ratio "$T_FERRY" "$T_DIRECT")x |
| aggregate delivered by ferry | $(awk -v n="$((CLIENTS + 5))" -v s="$SIZE_MB" -v t="$T_FERRY" 'BEGIN { printf "%.0f MB/s", n * s / t }') |
| same clients straight from docker-registry (no cache) | $T_DIRECT_FANOUT |
| ferry peak RSS | ${RSS} MB |
EOF
[ "$GETS" = 1 ] && [ "$OK" = "$CLIENTS" ] && [ "$GOOD" = 5 ]
