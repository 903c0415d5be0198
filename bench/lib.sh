# bench/lib.sh — shared helpers for benchmark scripts (source it).
# shellcheck shell=bash
set -euo pipefail
BENCH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$BENCH_ROOT"
# FERRY from the environment names a binary already built (as in the e2e tests)
FERRY_GIVEN=${FERRY:+1}
FERRY=${FERRY:-$BENCH_ROOT/target/release/ferry}
IMG=${IMG:-$BENCH_ROOT/bench/out/image}
TAG=${TAG:-ferry-bench}

ensure_ferry() {
    if [[ -n $FERRY_GIVEN && -x $FERRY ]]; then return 0; fi
    cargo build --release --locked -q -p ferry
}
ensure_image() {
    [ -f "$IMG/index.json" ] || bash bench/make-image.sh
}
now() { date +%s.%N; }
# elapsed START -> seconds with 3 decimals
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "inf" }'; }
manifest_of() { # layout tag -> manifest path
    local d
    d=$(jq -r --arg t "$2" '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $t) | .digest' "$1/index.json")
    echo "$1/blobs/sha256/${d#sha256:}"
}
layer_blobs() { # layout tag -> layer blob paths
    jq -r '.layers[].digest' "$(manifest_of "$1" "$2")" | sed "s|sha256:|$1/blobs/sha256/|"
}
# Copy a layout cheaply (blobs hard-linked), so a benchmark can add artifacts to it.
clone_layout() {
    rm -rf "$2"; mkdir -p "$2"
    cp -al "$1/blobs" "$2/blobs"
    cp "$1/index.json" "$1/oci-layout" "$2/"
}

# ---- helpers for the registry benchmarks (loopback servers)

# Loopback only; never through a proxy.
loopback_only() {
    export NO_PROXY="127.0.0.1,localhost" no_proxy="127.0.0.1,localhost"
    unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY ALL_PROXY all_proxy || true
}
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
wait_http() { # URL: until it answers at all (401 counts), at most 30 s
    local _
    for _ in $(seq 150); do
        curl -s -o /dev/null --noproxy '*' "$1" && return 0
        sleep 0.2
    done
    echo "no answer from $1" >&2
    return 1
}
mem_of() { # PID -> "rss_kib hwm_kib"
    awk '/^VmRSS:/ { r = $2 } /^VmHWM:/ { h = $2 } END { print r + 0, h + 0 }' "/proc/$1/status"
}
