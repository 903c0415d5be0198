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
# Copy a layout cheaply (blobs hard-linked; copied when $2 is on another filesystem, see
# node_fs), so a benchmark can add artifacts to it.
clone_layout() {
    rm -rf "$2"; mkdir -p "$2"
    cp -al "$1/blobs" "$2/blobs" 2>/dev/null || { rm -rf "$2/blobs"; cp -a "$1/blobs" "$2/blobs"; }
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

# Node state (containerd's root, ferry's store, the registries' storage) on a journaled
# filesystem, as a node's /var/lib is. ext4 without a journal (this VM's root) makes every
# file created search the inode table past recently deleted inodes (ext4's
# recently_deleted(), only without a journal): a fifth of the daemon's CPU at a cold start
# with the store rebuilt phase after phase. When the temp dir's filesystem is such an
# ext4, a sparse journaled ext4 image under bench/out/ is mounted and used instead, and
# left mounted for the next run (umount bench/out/node-fs; losetup -D);
# BENCH_NODE_FS=0 keeps the temp dir as it is. Call before anything creates E2E_TMP.
node_fs() {
    local base=${E2E_TMPDIR:-/tmp} src fstype
    local img=$BENCH_ROOT/bench/out/node-fs.img mnt=$BENCH_ROOT/bench/out/node-fs
    [[ ${BENCH_NODE_FS:-1} == 1 ]] || return 0
    read -r src fstype < <(findmnt -n -o SOURCE,FSTYPE -T "$base")
    [[ $fstype == ext4 && ! -d /proc/fs/jbd2/$(basename "$src")-8 ]] || return 0
    if ! mountpoint -q "$mnt"; then
        mkdir -p "$mnt"
        if [[ ! -f $img ]]; then
            truncate -s 64G "$img"
            mkfs.ext4 -q -F "$img"
        fi
        # direct I/O: the backing file's pages are not cached a second time
        local dev
        dev=$(losetup --direct-io=on --find --show "$img")
        mount "$dev" "$mnt"
    fi
    # What earlier runs deleted inside goes back to the host's disk (the image is sparse;
    # without this it grew to 40 GB of dead blocks and filled the disk)
    fstrim "$mnt" 2>/dev/null || true
    export E2E_TMPDIR=$mnt
    echo "node state on a journaled ext4 ($img): $base is ext4 without a journal" >&2
}
