# tests/e2e/lib.sh — harness for ferry end-to-end tests (source it, bash only).
#
# Starts real services on loopback only, all state in a private temp dir that
# is removed (after unmounting leftovers) by an EXIT trap:
#
#   e2e_init                 create $E2E_TMP, install the EXIT/INT/TERM trap
#   start_containerd         private containerd: $CONTAINERD_SOCK, overlayfs
#                            snapshotter, no CRI; logs in $E2E_TMP/containerd.log
#   start_registry           Debian docker-registry (distribution 2.8) on
#                            127.0.0.1:<free port>; sets $REGISTRY (host:port)
#   push_oci DIR TAG REPO:REF     skopeo copy oci:DIR:TAG -> docker://$REGISTRY/REPO:REF
#   pull_oci REPO:REF DIR TAG     skopeo copy docker://$REGISTRY/REPO:REF -> oci:DIR:TAG
#   ctr_ ARGS...             ctr -a $CONTAINERD_SOCK -n $CTR_NAMESPACE ARGS
#   ctr_remote ARGS...       same with Debian's ctr-remote (stargz-snapshotter)
#   need_root / need_cmd CMD... / skip REASON   print "SKIP: reason" and exit 0
#   pass NAME / fail NAME [MSG] / e2e_summary    "N passed, M failed"; non-zero if M>0
#   e2e_defer CMD            run CMD (eval'd) at cleanup, LIFO
#   find_ferry               set $FERRY (env, else target/release, else target/debug)
#
# Env knobs:
#   E2E_TMPDIR    parent of the temp dir (default /tmp)
#   E2E_KEEP=1    keep $E2E_TMP after exit (services are still stopped)
#   E2E_VERBOSE=1 show service logs on failure/exit
#   E2E_SKIP_RC   exit code used by skip (default 0)

# shellcheck shell=bash
set -euo pipefail

E2E_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
FERRY_ROOT=$(cd "$E2E_DIR/../.." && pwd)
CTR_NAMESPACE=${CTR_NAMESPACE:-ferry-e2e}
E2E_PASSED=0
E2E_FAILED=0
E2E_DEFERRED=()
E2E_PIDS=()
E2E_TMP=""

# Never let loopback traffic go through a proxy.
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY ALL_PROXY all_proxy || true

e2e_log() { printf '[e2e %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
e2e_die() { e2e_log "ERROR: $*"; exit 1; }

skip() {
    echo "SKIP: $*"
    exit "${E2E_SKIP_RC:-0}"
}
need_root() { [[ $(id -u) == 0 ]] || skip "needs root${1:+ ($1)}"; }
need_cmd() {
    local c
    for c in "$@"; do
        command -v "$c" >/dev/null 2>&1 || skip "missing command: $c"
    done
}

pass() { E2E_PASSED=$((E2E_PASSED + 1)); echo "PASS: $*"; }
fail() { E2E_FAILED=$((E2E_FAILED + 1)); echo "FAIL: $*"; }
e2e_summary() {
    echo "$E2E_PASSED passed, $E2E_FAILED failed"
    [[ $E2E_FAILED == 0 ]]
}

e2e_defer() { E2E_DEFERRED+=("$*"); }

# ------------------------------------------------------------------ lifecycle
e2e_init() {
    [[ -z $E2E_TMP ]] || return 0
    mkdir -p "${E2E_TMPDIR:-/tmp}"
    E2E_TMP=$(mktemp -d "${E2E_TMPDIR:-/tmp}/ferry-e2e.XXXXXX")
    export E2E_TMP
    trap e2e_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    e2e_log "temp dir $E2E_TMP"
}

# unmount everything mounted at or below $1, deepest first
e2e_umount_under() {
    local dir mp
    dir=$(realpath -m "$1")
    # mountinfo field 5 = mount point (octal-escaped); sort deepest first
    while read -r mp; do
        mp=$(printf '%b' "$mp")
        umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null ||
            e2e_log "warning: could not unmount $mp"
    done < <(awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo |
        awk '{ print length($0) " " $0 }' | sort -rn | cut -d' ' -f2-)
}

e2e_cleanup() {
    local rc=$?
    set +e
    local i
    for ((i = ${#E2E_DEFERRED[@]} - 1; i >= 0; i--)); do
        eval "${E2E_DEFERRED[i]}" >/dev/null 2>&1
    done
    [[ -n ${CONTAINERD_PID:-} ]] && stop_containerd
    [[ -n ${REGISTRY_PID:-} ]] && stop_registry
    for i in "${E2E_PIDS[@]}"; do
        kill "$i" 2>/dev/null
    done
    if [[ $rc != 0 && ${E2E_VERBOSE:-} == 1 && -n $E2E_TMP ]]; then
        for i in "$E2E_TMP"/*.log; do
            [[ -f $i ]] && { echo "----- $i"; tail -50 "$i"; }
        done >&2
    fi
    if [[ -n $E2E_TMP && -d $E2E_TMP ]]; then
        e2e_umount_under "$E2E_TMP"
        if [[ ${E2E_KEEP:-} == 1 ]]; then
            e2e_log "kept $E2E_TMP"
        else
            rm -rf "$E2E_TMP"
        fi
    fi
    exit "$rc"
}

# wait_for SECONDS DESC CMD... : poll CMD until it succeeds
wait_for() {
    local secs=$1
    shift 2  # $2 is a description, for readability at call sites
    local deadline=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# ------------------------------------------------------------------ containerd
start_containerd() {
    need_root "containerd"
    need_cmd containerd ctr
    e2e_init
    local d=$E2E_TMP/containerd
    mkdir -p "$d/root" "$d/state" "$d/opt"
    CONTAINERD_SOCK=$d/containerd.sock
    CONTAINERD_CONFIG=$d/config.toml
    cat >"$CONTAINERD_CONFIG" <<EOF
version = 2
root = "$d/root"
state = "$d/state"
# CRI is not needed; aufs/btrfs/zfs/devmapper only produce noise
disabled_plugins = [
  "io.containerd.grpc.v1.cri",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "$CONTAINERD_SOCK"

[ttrpc]
  address = "$d/containerd.sock.ttrpc"

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "$d/opt"
  [plugins."io.containerd.snapshotter.v1.overlayfs"]
    root_path = "$d/root/io.containerd.snapshotter.v1.overlayfs"
  [plugins."io.containerd.runtime.v1.linux"]
    shim_debug = false
EOF
    # ctr/ctr-remote pick their snapshotter from this (overlayfs is the default anyway)
    export CONTAINERD_SNAPSHOTTER=overlayfs
    export CONTAINERD_ADDRESS=$CONTAINERD_SOCK CONTAINERD_NAMESPACE=$CTR_NAMESPACE
    containerd --config "$CONTAINERD_CONFIG" >"$E2E_TMP/containerd.log" 2>&1 &
    CONTAINERD_PID=$!
    if ! wait_for 30 "containerd socket" ctr -a "$CONTAINERD_SOCK" version; then
        tail -30 "$E2E_TMP/containerd.log" >&2
        e2e_die "containerd did not come up (log: $E2E_TMP/containerd.log)"
    fi
    kill -0 "$CONTAINERD_PID" 2>/dev/null || e2e_die "containerd exited (log: $E2E_TMP/containerd.log)"
    e2e_log "containerd pid $CONTAINERD_PID on $CONTAINERD_SOCK"
}

stop_containerd() {
    [[ -n ${CONTAINERD_PID:-} ]] || return 0
    local ns t
    # kill leftover tasks so their shims exit (only ours: they live in our daemon)
    for ns in $(ctr -a "$CONTAINERD_SOCK" namespaces ls -q 2>/dev/null); do
        for t in $(ctr -a "$CONTAINERD_SOCK" -n "$ns" tasks ls -q 2>/dev/null); do
            ctr -a "$CONTAINERD_SOCK" -n "$ns" tasks kill -s SIGKILL "$t" >/dev/null 2>&1
            ctr -a "$CONTAINERD_SOCK" -n "$ns" tasks rm -f "$t" >/dev/null 2>&1
        done
    done
    kill "$CONTAINERD_PID" 2>/dev/null
    local i
    for i in $(seq 50); do
        kill -0 "$CONTAINERD_PID" 2>/dev/null || break
        sleep 0.1
    done
    kill -9 "$CONTAINERD_PID" 2>/dev/null
    wait "$CONTAINERD_PID" 2>/dev/null
    CONTAINERD_PID=""
    e2e_umount_under "$E2E_TMP/containerd"
}

ctr_() { ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" "$@"; }
ctr_remote() { ctr-remote -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" "$@"; }

# ------------------------------------------------------------------ registry
start_registry() {
    need_cmd docker-registry curl
    e2e_init
    local d=$E2E_TMP/registry port
    mkdir -p "$d/data"
    port=$(free_port)
    cat >"$d/config.yml" <<EOF
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $d/data
  delete:
    enabled: true
  cache:
    blobdescriptor: inmemory
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:$port
  secret: ferry-e2e-not-secret
  headers:
    X-Content-Type-Options: [nosniff]
EOF
    docker-registry serve "$d/config.yml" >"$E2E_TMP/registry.log" 2>&1 &
    REGISTRY_PID=$!
    REGISTRY=127.0.0.1:$port
    # Not exported: docker-registry reads REGISTRY_* variables as config overrides.
    REGISTRY_DATA_DIR=$d/data
    if ! wait_for 30 "registry" curl -fsS --noproxy '*' "http://$REGISTRY/v2/"; then
        tail -30 "$E2E_TMP/registry.log" >&2
        e2e_die "docker-registry did not come up on $REGISTRY"
    fi
    e2e_log "docker-registry pid $REGISTRY_PID on http://$REGISTRY"
}

stop_registry() {
    [[ -n ${REGISTRY_PID:-} ]] || return 0
    kill "$REGISTRY_PID" 2>/dev/null
    wait "$REGISTRY_PID" 2>/dev/null
    REGISTRY_PID=""
}

# ------------------------------------------------------------------ skopeo
skopeo_() {
    e2e_init
    local pol=$E2E_TMP/policy.json
    [[ -f $pol ]] || echo '{"default":[{"type":"insecureAcceptAnything"}]}' >"$pol"
    skopeo --policy "$pol" "$@"
}
# push_oci DIR TAG REPO:REF
push_oci() {
    skopeo_ copy -q --dest-tls-verify=false "oci:$1:$2" "docker://$REGISTRY/$3"
}
# pull_oci REPO:REF DIR TAG
pull_oci() {
    mkdir -p "$2"
    skopeo_ copy -q --src-tls-verify=false "docker://$REGISTRY/$1" "oci:$2:$3"
}
# registry_manifest REPO:REF -> prints the manifest JSON (OCI or docker v2)
registry_manifest() {
    local repo=${1%:*} ref=${1##*:}
    curl -fsS --noproxy '*' \
        -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
        -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
        "http://$REGISTRY/v2/$repo/manifests/$ref"
}

# ------------------------------------------------------------------ OCI layout helpers
# oci_manifest DIR [TAG] -> manifest JSON of TAG (or the only image) in layout DIR
oci_manifest() {
    local dir=$1 tag=${2:-} digest
    if [[ -n $tag ]]; then
        digest=$(jq -r --arg t "$tag" '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $t) | .digest' "$dir/index.json" | head -1)
    else
        digest=$(jq -r '.manifests[0].digest' "$dir/index.json")
    fi
    [[ -n $digest && $digest != null ]] || { e2e_log "no manifest for tag '$tag' in $dir"; return 1; }
    cat "$dir/blobs/sha256/${digest#sha256:}"
}
# oci_extract DIR TAG DEST [TAR_OPTION...]: apply all layers of DIR:TAG with tar -xzf
# (plus TAR_OPTIONs, e.g. --xattrs), honouring OCI whiteouts (.wh.NAME deletes NAME
# from lower layers, .wh..wh..opq empties the directory's lower content). Whiteout
# markers are not left in DEST.
oci_extract() {
    local dir=$1 tag=$2 dest=$3 l blob name base parent
    shift 3
    mkdir -p "$dest"
    for l in $(oci_manifest "$dir" "$tag" | jq -r '.layers[].digest'); do
        blob=$dir/blobs/sha256/${l#sha256:}
        # 1. apply this layer's whiteouts to what lower layers left in DEST
        while IFS= read -r name; do
            name=${name#./}
            base=${name##*/}
            parent=.
            [[ $name == */* ]] && parent=${name%/*}
            [[ $base == .wh.* ]] || continue
            if [[ $base == .wh..wh..opq ]]; then
                [[ -d $dest/$parent ]] && find "$dest/$parent" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
            else
                rm -rf "${dest:?}/$parent/${base#.wh.}"
            fi
        done < <(tar -tzf "$blob")
        # 2. extract the layer, 3. drop the markers
        tar --numeric-owner "$@" -xzf "$blob" -C "$dest"
        find "$dest" -name '.wh.*' -exec rm -rf {} +
    done
}

# ------------------------------------------------------------------ ferry
find_ferry() {
    if [[ -n ${FERRY:-} ]]; then
        :
    elif [[ -x $FERRY_ROOT/target/release/ferry ]]; then
        FERRY=$FERRY_ROOT/target/release/ferry
    else
        FERRY=$FERRY_ROOT/target/debug/ferry
    fi
    export FERRY
}

# ------------------------------------------------------------------ registries under test
# (used by registry_clients.sh / registry_badinput.sh)
#
#   make_htpasswd FILE USER PASS [USER PASS]...   bcrypt htpasswd file ($2y$/$2b$, cost 5):
#                            `htpasswd -B` (apache2-utils) if present, else python3
#                            (bcrypt module, else the stdlib crypt module)
#   start_ferry_registry NAME CONFIG    `$FERRY registry serve --config CONFIG --addr
#                            127.0.0.1:<free port> --root $E2E_TMP/NAME/data`
#   start_docker_registry NAME [HTPASSWD]   a further Debian docker-registry instance
#                            (optionally with htpasswd auth), for checking the checks
#   Both set REG_ADDR (host:port), REG_PID, REG_DATA (storage dir), REG_LOG, return
#   non-zero (after printing the log tail) if the server does not answer /v2/ within
#   30 s, and are stopped by the EXIT trap.
#   http_req METHOD URL [CURL_ARGS...]   curl --path-as-is; sets HTTP_CODE (000 on a
#                            transport error); body in $HTTP_BODY, headers in $HTTP_HDRS
#   http_header NAME         value of header NAME in the last http_req (case-insensitive)

make_htpasswd() {
    local f=$1 u p line
    shift
    : >"$f"
    while (($# >= 2)); do
        u=$1 p=$2
        shift 2
        if command -v htpasswd >/dev/null 2>&1; then
            line=$(htpasswd -nbB -C 5 "$u" "$p" | head -1)
        else
            line=$(python3 -W ignore - "$u" "$p" <<'PY'
import sys
user, pw = sys.argv[1], sys.argv[2]
try:
    import bcrypt
    h = bcrypt.hashpw(pw.encode(), bcrypt.gensalt(5)).decode()
except ImportError:
    import crypt  # stdlib up to Python 3.12; libxcrypt does bcrypt
    h = crypt.crypt(pw, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 5))
if not h or not h.startswith("$2"):
    sys.exit("no bcrypt implementation (install apache2-utils or python3-bcrypt)")
print(f"{user}:{h}")
PY
            ) || return 1
        fi
        echo "$line" >>"$f"
    done
}

# _wait_registry_up NAME: wait until http://$REG_ADDR/v2/ answers any HTTP status
_wait_registry_up() {
    local code deadline=$((SECONDS + 30))
    while :; do
        code=$(curl -s --noproxy '*' -o /dev/null -w '%{http_code}' --max-time 2 "http://$REG_ADDR/v2/" 2>/dev/null) || true
        [[ $code != 000 && -n $code ]] && break
        if ! kill -0 "$REG_PID" 2>/dev/null || ((SECONDS >= deadline)); then
            e2e_log "$1 did not come up on $REG_ADDR (log $REG_LOG):"
            tail -20 "$REG_LOG" >&2 || true
            return 1
        fi
        sleep 0.2
    done
    e2e_log "$1 pid $REG_PID on http://$REG_ADDR (data $REG_DATA)"
}

start_ferry_registry() {
    local name=$1 config=$2 port
    e2e_init
    find_ferry
    [[ -x $FERRY ]] || { e2e_log "ferry binary not found: $FERRY"; return 1; }
    port=$(free_port)
    REG_ADDR=127.0.0.1:$port
    REG_DATA=$E2E_TMP/$name/data
    REG_LOG=$E2E_TMP/$name.log
    mkdir -p "$REG_DATA"
    "$FERRY" registry serve --config "$config" --addr "$REG_ADDR" --root "$REG_DATA" >"$REG_LOG" 2>&1 &
    REG_PID=$!
    E2E_PIDS+=("$REG_PID")
    _wait_registry_up "ferry registry $name"
}

start_docker_registry() {
    local name=$1 htpasswd=${2:-} port d
    need_cmd docker-registry
    e2e_init
    port=$(free_port)
    d=$E2E_TMP/$name
    REG_ADDR=127.0.0.1:$port
    REG_DATA=$d/data
    REG_LOG=$E2E_TMP/$name.log
    mkdir -p "$REG_DATA"
    {
        cat <<YML
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $REG_DATA
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: $REG_ADDR
  secret: ferry-e2e-not-secret
YML
        if [[ -n $htpasswd ]]; then
            printf 'auth:\n  htpasswd:\n    realm: ferry-e2e\n    path: %s\n' "$htpasswd"
        fi
    } >"$d/config.yml"
    docker-registry serve "$d/config.yml" >"$REG_LOG" 2>&1 &
    REG_PID=$!
    E2E_PIDS+=("$REG_PID")
    _wait_registry_up "docker-registry $name"
}

http_req() {
    local m=$1 u=$2
    shift 2
    e2e_init
    HTTP_BODY=$E2E_TMP/http.body
    HTTP_HDRS=$E2E_TMP/http.hdrs
    : >"$HTTP_BODY"
    : >"$HTTP_HDRS"
    local how=(-X "$m")
    [[ $m == HEAD ]] && how=(--head)
    HTTP_CODE=$(curl -sS --noproxy '*' --path-as-is --max-time "${HTTP_TIMEOUT:-30}" "${how[@]}" \
        -o "$HTTP_BODY" -D "$HTTP_HDRS" -w '%{http_code}' "$@" "$u" 2>"$E2E_TMP/http.err") || true
    [[ -n $HTTP_CODE ]] || HTTP_CODE=000
}

http_header() {
    tr -d '\r' <"$HTTP_HDRS" | awk -v n="$1" 'BEGIN { n = tolower(n) }
        { i = index($0, ":"); if (i > 0 && tolower(substr($0, 1, i - 1)) == n) { v = substr($0, i + 1); sub(/^[ \t]+/, "", v); print v } }' | tail -1
}

# ------------------------------------------------------------------ proxy snapshotters
# start_containerd_with_snapshotter NAME SOCKET: start_containerd, then register the
# proxy snapshotter NAME (`[proxy_plugins.NAME] type = "snapshot" address = SOCKET`) in
# its config and restart it, so `ctr --snapshotter NAME` talks to SOCKET.
start_containerd_with_snapshotter() {
    local name=$1 sock=$2
    start_containerd
    stop_containerd || true # its `wait` returns the killed daemon's status
    printf '\n[proxy_plugins]\n  [proxy_plugins.%s]\n    type = "snapshot"\n    address = "%s"\n' \
        "$name" "$sock" >>"$CONTAINERD_CONFIG"
    containerd --config "$CONTAINERD_CONFIG" >>"$E2E_TMP/containerd.log" 2>&1 &
    CONTAINERD_PID=$!
    if ! wait_for 30 "containerd socket" ctr -a "$CONTAINERD_SOCK" version; then
        tail -30 "$E2E_TMP/containerd.log" >&2
        e2e_die "containerd did not come up with proxy snapshotter $name (log: $E2E_TMP/containerd.log)"
    fi
    e2e_log "containerd pid $CONTAINERD_PID with proxy snapshotter $name at $sock"
}

# ------------------------------------------------------------------ running ferry
# fy OUT ERR ARGS...: run $FERRY ARGS with a timeout ($FT, else $FERRY_TIMEOUT, else
# 120 s), stdout and stderr to files; sets RC (never exits on failure)
fy() {
    local o=$1 e=$2
    shift 2
    set +e
    timeout "${FT:-${FERRY_TIMEOUT:-120}}" "$FERRY" "$@" >"$o" 2>"$e"
    RC=$?
    set -e
}
# show FILE [N]: the last N (default 10) lines of FILE, indented, for failure reports
show() { sed 's/^/    | /' "$1" | tail -"${2:-10}" || true; }
