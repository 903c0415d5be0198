#!/usr/bin/env bash
# bench/pull-requests.sh — what `ferry pull` of the bench image costs in registry
# requests and wall time, with the registry LATENCIES ms away (`ferry bench proxy`).
#
# Debian's docker-registry runs with its access log on, so every request the pull
# causes (ferry pull's own and the daemon's, at each layer's Prepare) is counted and
# classified by kind. Each round is a cold node: a fresh daemon (empty store, nothing
# cached) and a fresh containerd; no container is started. Requests counted are those
# the registry received between the pull's start and its end (the daemon's background
# trace lookup included when it lands inside that window).
#
#   bench/pull-requests.sh [RUNS]      RUNS rounds per latency (default 3)
#
# Env: IMG, TAG (bench/make-image.sh), LATENCIES (default "0 25"), OUT (default
# bench/out/pull-requests), FERRY. Needs root, containerd, docker-registry.
# Output: $OUT/raw.tsv (one row per round), $OUT/requests-*.log (the access log lines
# of each round), a summary on stdout.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/lib.sh
source "$HERE/lib.sh"
# shellcheck source=bench/lib-containerd.sh
source "$HERE/lib-containerd.sh"

RUNS=${1:-3}
LATENCIES=${LATENCIES:-0 25}
for l in $LATENCIES; do [[ $l =~ ^[0-9]+$ ]] || e2e_die "latency $l is not whole milliseconds"; done
bench_prepare pull-requests
need_cmd docker-registry

# docker-registry as tests/e2e/lib.sh starts it, but with the access log on
port=$(free_port)
REG=127.0.0.1:$port
REG_DIR=$E2E_TMP/registry
ACCESS_LOG=$E2E_TMP/registry.log
mkdir -p "$REG_DIR/data"
cat >"$REG_DIR/config.yml" <<YML
version: 0.1
log:
  level: warn
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: $REG_DIR/data
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: $REG
  secret: ferry-bench-not-secret
YML
docker-registry serve "$REG_DIR/config.yml" >"$ACCESS_LOG" 2>&1 &
E2E_PIDS+=("$!")
wait_http "http://$REG/v2/" || e2e_die "docker-registry did not start (log $ACCESS_LOG)"

LAYOUT=$E2E_TMP/layout
clone_layout "$IMG" "$LAYOUT"
"$FERRY" index "oci:$LAYOUT:$TAG" >"$OUT/index.txt"
"$FERRY" copy --plain-http "oci:$LAYOUT:$TAG" "$REG/bench/app:v1" >"$OUT/copy.txt" 2>&1 ||
    { tail -5 "$OUT/copy.txt" >&2; e2e_die "ferry copy"; }
e2e_log "image $REG/bench/app:v1: $(tail -1 "$OUT/index.txt")"

access_lines() { grep -c '"\(GET\|HEAD\|POST\|PUT\|PATCH\) /v2/' "$ACCESS_LOG" || true; }
# kind of one access-log request line
classify() {
    awk '{
        m = $0; sub(/^.*"(GET|HEAD|POST|PUT|PATCH) /, "", m); sub(/ HTTP.*$/, "", m)
        match($0, /"(GET|HEAD|POST|PUT|PATCH) /); meth = substr($0, RSTART + 1, RLENGTH - 2)
        if (m ~ /\/referrers\//) k = "referrers"
        else if (m ~ /\/manifests\/sha256-/) k = "manifest(tag-fallback)"
        else if (m ~ /\/manifests\//) k = "manifest"
        else if (m ~ /\/blobs\//) k = "blob"
        else if (m ~ /\/tags\//) k = "tags"
        else k = "other"
        print meth " " k
    }' | sort | uniq -c | awk '{ printf "%s %s=%s ", $2, $3, $1 }'
}

RAW=$OUT/raw.tsv
printf 'latency_ms\tround\tpull_s\trequests\tkinds\n' >"$RAW"
for l in $LATENCIES; do
    host=$REG
    if ((l > 0)); then
        start_proxy "$REG" "$l"
        host=$PROXY_ADDR
    fi
    for round in $(seq "$RUNS"); do
        rm -rf "$E2E_TMP/store"
        start_daemon "$E2E_TMP/store"
        fresh_containerd "$E2E_TMP/ferry/run/snapshotter.sock"
        before=$(access_lines)
        T0=$(now)
        ferry_pull_ctr "$host/bench/app:v1"
        pull_s=$(since "$T0")
        after=$(access_lines)
        grep '"\(GET\|HEAD\|POST\|PUT\|PATCH\) /v2/' "$ACCESS_LOG" | sed -n "$((before + 1)),${after}p" \
            >"$OUT/requests-${l}ms-$round.log"
        kinds=$(classify <"$OUT/requests-${l}ms-$round.log")
        printf '%s\t%s\t%s\t%s\t%s\n' "$l" "$round" "$pull_s" "$((after - before))" "$kinds" >>"$RAW"
        e2e_log "${l}ms round $round: ferry pull ${pull_s}s, $((after - before)) requests: $kinds ($(tail -1 "$E2E_TMP/pull.log"))"
        stop_daemon
    done
    stop_proxy
done
stop_containerd >/dev/null 2>&1 || true

echo "latency_ms  median_pull_s  median_requests"
for l in $LATENCIES; do
    s=$(awk -F'\t' -v l="$l" 'NR > 1 && $1 == l { print $3 }' "$RAW" | median)
    r=$(awk -F'\t' -v l="$l" 'NR > 1 && $1 == l { print $4 }' "$RAW" | median)
    printf '%-11s %-14s %s\n' "$l" "$s" "$r"
done
