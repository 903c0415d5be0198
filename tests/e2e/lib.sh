# tests/e2e/lib.sh — harness for ferry end-to-end tests (source it, bash only).
#
# Starts real services on loopback only, all state in a private temp dir that
# is removed (after unmounting leftovers) by an EXIT trap:
#
#   e2e_init                 create $E2E_TMP, install the EXIT/INT/TERM trap
#   start_containerd         private containerd: $CONTAINERD_SOCK, overlayfs
#                            snapshotter, no CRI; logs in $E2E_TMP/containerd.log
#                            (config version 2 for containerd 1.x, 3 for 2.x)
#   per_containerd "$0" "$@" run the calling script once per containerd version
#                            (containerd_flavours: the system's 1.6 and CI's 2.x)
#   start_registry           Debian docker-registry (distribution 2.8) on
#                            127.0.0.1:<free port>; sets $REGISTRY (host:port)
#   push_oci DIR TAG REPO:REF     skopeo copy oci:DIR:TAG -> docker://$REGISTRY/REPO:REF
#   pull_oci REPO:REF DIR TAG     skopeo copy docker://$REGISTRY/REPO:REF -> oci:DIR:TAG
#   ctr_ ARGS...             ctr -a $CONTAINERD_SOCK -n $CTR_NAMESPACE ARGS
#   ctr_remote ARGS...       same with Debian's ctr-remote (stargz-snapshotter)
#   need_root / need_cmd CMD... / skip REASON   print "SKIP: reason" and exit 77
#   pass NAME / fail NAME [MSG] / e2e_summary    "N passed, M failed"; non-zero if M>0
#   e2e_defer CMD            run CMD (eval'd) at cleanup, LIFO
#   find_ferry               set $FERRY (env, else target/release, else target/debug)
#   small_image              set $SMALL to the small test image (built once, cached)
#   start_ferry_snapshotter / start_ferry_daemon CONFIG / stop_ferry_snapshotter
#                            ferry as containerd's proxy snapshotter ($SNAP_SOCK, $SNAP_ROOT)
#   mount_prologue / reference_tree / tree_sums / tree_equals_ref / same_as_ref
#                            scripts that `ferry mount` the small image and compare
#                            with the image extracted normally (see their section)
#
# Env knobs:
#   E2E_TMPDIR    parent of the temp dir (default /tmp)
#   E2E_KEEP=1    keep $E2E_TMP after exit (services are still stopped)
#   E2E_VERBOSE=1 show service logs on failure/exit
#   E2E_SKIP_RC   exit code used by skip (default 77: scripts/e2e-run counts it as a
#                 skip, not a pass)

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
    exit "${E2E_SKIP_RC:-77}"
}
need_root() { [[ $(id -u) == 0 ]] || skip "needs root${1:+ ($1)}"; }
need_cmd() {
    local c
    for c in "$@"; do
        command -v "$c" >/dev/null 2>&1 || skip "missing command: $c"
    done
}

# E2E_LABEL (set by use_containerd) prefixes every PASS/FAIL line, e.g. "[containerd 2.1.9]"
pass() { E2E_PASSED=$((E2E_PASSED + 1)); echo "PASS: ${E2E_LABEL:+[$E2E_LABEL] }$*"; }
fail() { E2E_FAILED=$((E2E_FAILED + 1)); echo "FAIL: ${E2E_LABEL:+[$E2E_LABEL] }$*"; }
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
        # bounded: umount(8) statfs()es its target, which waits forever on a FUSE
        # mount whose connection is alive but no longer served; umount2(MNT_DETACH)
        # from python does not touch it
        timeout -s KILL 10 umount "$mp" 2>/dev/null ||
            timeout -s KILL 10 python3 -c 'import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).umount2(sys.argv[1].encode(), 2) != 0)' "$mp" 2>/dev/null ||
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
        # a daemon's fd holder (`ferry daemon --fd-holder SOCK`) keeps FUSE connections
        # alive across daemon restarts; ending it aborts them so the mounts can go
        pkill -TERM -f -- "--fd-holder $E2E_TMP/" 2>/dev/null && sleep 0.5
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

# daemon_start CONFIG LOG: `ferry daemon --config CONFIG` in the background (pid in
# DAEMON, stopped at exit), logging to LOG; returns once `ferry status` answers (30 s).
daemon_start() {
    "$FERRY" --log info daemon --config "$1" >"$2" 2>&1 &
    DAEMON=$!
    E2E_PIDS+=("$DAEMON")
    wait_for 30 "daemon status" "$FERRY" status --config "$1"
}
# daemon_stop: stops the daemon daemon_start started last.
daemon_stop() {
    kill "$DAEMON" 2>/dev/null || true
    wait "$DAEMON" 2>/dev/null || true
}
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# ------------------------------------------------------------------ containerd versions
# The scripts that drive containerd with ferry run on every containerd version CI has
# (per_containerd), each run in a fresh process with its own temp dir and services:
#
#   system   containerd, ctr and containerd-shim-runc-v2 from PATH (Debian 12: 1.6)
#   2        the same from CONTAINERD2_BIN_DIR (default /opt/ferry-ci/containerd2/bin,
#            put there by scripts/containerd2.sh from Debian unstable: 2.x)
#
# E2E_CONTAINERD="system 2" (the default) lists the flavours to run; a flavour whose
# binaries are missing is a FAIL, not a skip (CI installs both).
#
#   containerd_flavours      print the flavours of E2E_CONTAINERD
#   use_containerd FLAVOUR   put FLAVOUR's binaries first in PATH; sets CONTAINERD_VERSION
#                            (e.g. 2.1.9), CONTAINERD_MAJOR (1 or 2), E2E_LABEL
#   containerd_detect        set CONTAINERD_VERSION/CONTAINERD_MAJOR from the containerd
#                            in PATH (containerd_config calls it)
#   per_containerd SCRIPT ARGS...  (right after sourcing lib.sh) unless this process is
#                            already one flavour's run: run SCRIPT once per flavour with
#                            E2E_CONTAINERD_FLAVOUR set, print its output, add up the
#                            PASS/FAIL counts and exit (77 only if every flavour skipped).
#                            In a flavour's run it calls use_containerd and returns.
CONTAINERD2_BIN_DIR=${CONTAINERD2_BIN_DIR:-/opt/ferry-ci/containerd2/bin}
E2E_SYSTEM_PATH=${E2E_SYSTEM_PATH:-$PATH}

containerd_flavours() { echo "${E2E_CONTAINERD:-system 2}"; }

containerd_detect() {
    local v
    v=$(containerd --version 2>/dev/null | awk '{ print $3 }')
    v=${v#v}
    CONTAINERD_VERSION=${v%%[~+-]*}
    CONTAINERD_MAJOR=${CONTAINERD_VERSION%%.*}
    [[ $CONTAINERD_MAJOR =~ ^[0-9]+$ ]] || CONTAINERD_MAJOR=1
}

use_containerd() {
    local f=$1 dir="" b
    case $f in
        system) ;;
        2) dir=$CONTAINERD2_BIN_DIR ;;
        *) e2e_die "unknown containerd flavour '$f' (E2E_CONTAINERD: system, 2)" ;;
    esac
    PATH=$E2E_SYSTEM_PATH
    if [[ -n $dir ]]; then
        for b in containerd ctr containerd-shim-runc-v2; do
            if [[ ! -x $dir/$b ]]; then
                fail "[containerd $f] $dir/$b missing (install it: bash scripts/containerd2.sh, as root)"
                e2e_summary || true
                exit 1
            fi
        done
        PATH=$dir:$PATH
    fi
    export PATH
    containerd_detect
    if [[ $f == 2 && $CONTAINERD_MAJOR != 2 ]]; then
        fail "[containerd $f] $dir/containerd is version '$CONTAINERD_VERSION', not 2.x"
        e2e_summary || true
        exit 1
    fi
    E2E_LABEL="containerd $CONTAINERD_VERSION"
}

per_containerd() {
    if [[ -n ${E2E_CONTAINERD_FLAVOUR:-} ]]; then
        use_containerd "$E2E_CONTAINERD_FLAVOUR"
        return 0
    fi
    local script=$1 f out rc p m passed=0 failed=0 runs=0 skips=0 reason=""
    shift
    out=$(mktemp "${E2E_TMPDIR:-/tmp}/ferry-e2e-flavour.XXXXXX")
    for f in $(containerd_flavours); do
        runs=$((runs + 1))
        echo "## $(basename "$script") with containerd flavour '$f'"
        set +e
        E2E_CONTAINERD_FLAVOUR=$f bash "$script" "$@" | tee "$out"
        rc=${PIPESTATUS[0]}
        set -e
        if [[ $rc == "${E2E_SKIP_RC:-77}" ]]; then
            skips=$((skips + 1))
            reason=$(grep '^SKIP: ' "$out" | tail -n1 | sed 's/^SKIP: //')
            continue
        fi
        read -r p m < <(sed -n 's/^\([0-9][0-9]*\) passed, \([0-9][0-9]*\) failed$/\1 \2/p' "$out" | tail -n1) || true
        p=${p:-0} m=${m:-0}
        passed=$((passed + p))
        failed=$((failed + m))
        if [[ $rc != 0 && $m == 0 ]]; then
            # ended before its summary (e2e_die): one failure for the run
            failed=$((failed + 1))
            echo "FAIL: [containerd $f] $(basename "$script") exited $rc before its summary"
        fi
    done
    rm -f "$out"
    if ((skips == runs)); then
        skip "${reason:-every containerd flavour skipped}"
    elif ((skips > 0)); then
        failed=$((failed + skips))
        echo "FAIL: $skips of $runs containerd flavours skipped ($reason) while the others ran"
    fi
    echo "$(basename "$script"), containerd flavours $(containerd_flavours | tr ' ' ','): $passed passed, $failed failed"
    echo "$passed passed, $failed failed"
    [[ $failed == 0 ]]
    exit
}

# ------------------------------------------------------------------ containerd
# containerd_config DIR [CRI]: write DIR/config.toml for a private containerd whose state
# lives under DIR (sets CONTAINERD_SOCK, CONTAINERD_CONFIG). CRI=false (the default)
# disables the CRI plugin; CRI=true keeps it, for the caller to append its CRI sections
# (config version 2: [plugins."io.containerd.grpc.v1.cri"]; 3: see containerd_config_v3).
# The containerd in PATH decides the version: 2 for containerd 1.x, 3 for 2.x
# (CONTAINERD_MAJOR, set here).
containerd_config() {
    local d=$1 cri=${2:-false} no_cri=
    mkdir -p "$d/root" "$d/state" "$d/opt"
    containerd_detect
    CONTAINERD_SOCK=$d/containerd.sock
    CONTAINERD_CONFIG=$d/config.toml
    if ((CONTAINERD_MAJOR >= 2)); then
        containerd_config_v3 "$d" "$cri"
        return
    fi
    [[ $cri == true ]] || no_cri='"io.containerd.grpc.v1.cri",'
    cat >"$CONTAINERD_CONFIG" <<EOF
version = 2
root = "$d/root"
state = "$d/state"
# aufs/btrfs/zfs/devmapper/tracing only produce noise
disabled_plugins = [
  $no_cri
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
}

# containerd_config_v3 DIR CRI: containerd_config's version 3 file (containerd 2.x). Plugin
# IDs changed: CRI is io.containerd.cri.v1.images and io.containerd.cri.v1.runtime plus
# the io.containerd.grpc.v1.cri server; runtime v1 is gone. NRI would listen on the host's
# /var/run/nri, so it is off, as are the snapshotters and differs that only add noise.
containerd_config_v3() {
    local d=$1 cri=$2 no_cri=
    [[ $cri == true ]] ||
        no_cri="'io.containerd.grpc.v1.cri', 'io.containerd.cri.v1.images', 'io.containerd.cri.v1.runtime', 'io.containerd.podsandbox.controller.v1.podsandbox',"
    cat >"$CONTAINERD_CONFIG" <<EOF
version = 3
root = '$d/root'
state = '$d/state'
disabled_plugins = [
  $no_cri
  'io.containerd.nri.v1.nri',
  'io.containerd.snapshotter.v1.btrfs',
  'io.containerd.snapshotter.v1.zfs',
  'io.containerd.snapshotter.v1.devmapper',
  'io.containerd.snapshotter.v1.blockfile',
  'io.containerd.snapshotter.v1.erofs',
  'io.containerd.differ.v1.erofs',
  'io.containerd.tracing.processor.v1.otlp',
  'io.containerd.internal.v1.tracing',
]

[grpc]
  address = '$CONTAINERD_SOCK'

[ttrpc]
  address = '$d/containerd.sock.ttrpc'

[debug]
  address = ''
  level = 'info'

[metrics]
  address = ''

[plugins]
  [plugins.'io.containerd.internal.v1.opt']
    path = '$d/opt'
  [plugins.'io.containerd.snapshotter.v1.overlayfs']
    root_path = '$d/root/io.containerd.snapshotter.v1.overlayfs'
  [plugins.'io.containerd.image-verifier.v1.bindir']
    bin_dir = '$d/image-verifier'
EOF
}

# containerd_add_proxy_snapshotter NAME SOCKET: register the proxy snapshotter NAME
# (`[proxy_plugins.NAME] type = "snapshot"`) in $CONTAINERD_CONFIG. For containerd 2.x
# (config version 3) also what its transfer service (`ctr image pull`, and CRI's pull
# unless use_local_image_pull) needs to unpack into NAME lazily: NAME among the transfer
# plugin's unpack_config (which then must name overlayfs again, the default it replaces)
# and the export enable_remote_snapshot_annotations, without which that path passes
# no image ref and layer digest labels.
containerd_add_proxy_snapshotter() {
    printf '\n[proxy_plugins]\n  [proxy_plugins.%s]\n    type = "snapshot"\n    address = "%s"\n' \
        "$1" "$2" >>"$CONTAINERD_CONFIG"
    ((${CONTAINERD_MAJOR:-1} >= 2)) || return 0
    local platform=linux/amd64
    [[ $(uname -m) == aarch64 ]] && platform=linux/arm64
    cat >>"$CONTAINERD_CONFIG" <<EOF
    [proxy_plugins.$1.exports]
      enable_remote_snapshot_annotations = 'true'

[[plugins.'io.containerd.transfer.v1.local'.unpack_config]]
  platform = '$platform'
  snapshotter = 'overlayfs'
[[plugins.'io.containerd.transfer.v1.local'.unpack_config]]
  platform = '$platform'
  snapshotter = '$1'
EOF
}

# launch_containerd [WHAT]: run containerd on $CONTAINERD_CONFIG (log $CONTAINERD_LOG,
# default $E2E_TMP/containerd.log, appended) and wait until `ctr version` answers
launch_containerd() {
    CONTAINERD_LOG=${CONTAINERD_LOG:-$E2E_TMP/containerd.log}
    containerd --config "$CONTAINERD_CONFIG" >>"$CONTAINERD_LOG" 2>&1 &
    CONTAINERD_PID=$!
    if ! wait_for 30 "containerd socket" ctr -a "$CONTAINERD_SOCK" version ||
        ! kill -0 "$CONTAINERD_PID" 2>/dev/null; then
        tail -30 "$CONTAINERD_LOG" >&2
        e2e_die "containerd${1:+ with $1} did not come up (log: $CONTAINERD_LOG)"
    fi
    e2e_log "containerd pid $CONTAINERD_PID on $CONTAINERD_SOCK${1:+ with $1}"
}

# start_containerd [NAME SOCKET]: a private containerd (overlayfs, no CRI) under
# $E2E_TMP/containerd; with NAME and SOCKET also the proxy snapshotter NAME at SOCKET
start_containerd() {
    need_root "containerd"
    need_cmd containerd ctr
    e2e_init
    containerd_config "$E2E_TMP/containerd"
    [[ -z ${1:-} ]] || containerd_add_proxy_snapshotter "$1" "$2"
    # ctr/ctr-remote pick their snapshotter from this (overlayfs is the default anyway)
    export CONTAINERD_SNAPSHOTTER=overlayfs
    export CONTAINERD_ADDRESS=$CONTAINERD_SOCK CONTAINERD_NAMESPACE=$CTR_NAMESPACE
    launch_containerd "${1:+proxy snapshotter $1 at ${2:-}}"
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

# small_image: set $SMALL to the small test image's OCI layout ($OUT/small; OUT defaults
# to tests/e2e/out), building it with `bench/make-image.sh --small` when absent (cached
# across runs). Sets OUT if unset.
small_image() {
    e2e_init
    OUT=$(realpath -m "${OUT:-$FERRY_ROOT/tests/e2e/out}")
    SMALL=$OUT/small
    [[ -f $SMALL/index.json ]] && return 0
    SMALL_OUT=$SMALL "$FERRY_ROOT/bench/make-image.sh" --small >"$E2E_TMP/make-image.log" 2>&1 ||
        { tail -20 "$E2E_TMP/make-image.log"; e2e_die "bench/make-image.sh --small failed"; }
}

# indexed_small DIR: a copy of $SMALL (small_image first) at DIR with every layer
# indexed in 64 KiB spans (`ferry index --min-layer-size 0 --span 65536`), so a small
# read fetches little; dies on failure
indexed_small() {
    cp -a "$SMALL" "$1"
    fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index --min-layer-size 0 --span 65536 "oci:$1:small"
    [[ $RC == 0 ]] || { show "$E2E_TMP/index.err"; e2e_die "ferry index of $1 failed (exit $RC)"; }
}
# publish_indexed_small REPO:TAG: IMG=$E2E_TMP/img (indexed_small), a fresh ferry
# registry `reg` (REG_ADDR…) and IMG copied to it as IMAGE=$REG_ADDR/REPO:TAG; dies on
# failure
publish_indexed_small() {
    IMG=$E2E_TMP/img
    indexed_small "$IMG"
    : >"$E2E_TMP/reg.toml"
    start_ferry_registry reg "$E2E_TMP/reg.toml" || e2e_die "ferry registry did not start"
    IMAGE=$REG_ADDR/$1
    fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy "oci:$IMG:small" "$IMAGE"
    [[ $RC == 0 ]] || { show "$E2E_TMP/cp.err"; e2e_die "ferry copy to $IMAGE failed"; }
}

# ------------------------------------------------------------------ lazy mounts of the small image
# (used by hosts_toml.sh / credential_provider.sh)
#
#   mount_prologue [CMD...]  what a script that `ferry mount`s the small image needs first:
#                            root, /dev/fuse and python3 curl jq tar gzip md5sum timeout
#                            mountpoint plus CMDs (else skip); FT (FERRY_TIMEOUT, default
#                            120); $FERRY with `mount` (else a FAIL and the summary);
#                            $E2E_TMP; $SMALL
#   reference_tree LAYOUT    REF=$E2E_TMP/ref: LAYOUT's image `small` extracted normally
#                            (oci_extract); REF_SUMS=$E2E_TMP/ref.sums: its tree_sums
#   tree_sums DIR            md5sum of every regular file under DIR (paths ./…, sorted)
#   tree_equals_ref DIR OUT  tree_sums of DIR into OUT (errors in OUT.err) equal REF_SUMS;
#                            bounded at 300 s, so a hung FUSE mount cannot hang the script
#   same_as_ref DIR PATH     DIR/PATH has the bytes of $REF/PATH

mount_prologue() {
    need_root "FUSE mounts"
    need_cmd python3 curl jq tar gzip md5sum timeout mountpoint "$@"
    [[ -e /dev/fuse ]] || skip "no /dev/fuse"
    FT=${FERRY_TIMEOUT:-120}
    find_ferry
    e2e_init
    small_image
    require_ferry mount
}

reference_tree() {
    REF=$E2E_TMP/ref
    REF_SUMS=$E2E_TMP/ref.sums
    oci_extract "$1" small "$REF"
    tree_sums "$REF" >"$REF_SUMS"
    e2e_log "reference: $(wc -l <"$REF_SUMS") files"
}

tree_sums() { (cd "$1" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 md5sum); }

tree_equals_ref() {
    timeout 300 bash -c "$(declare -f tree_sums); tree_sums \"\$1\"" _ "$1" >"$2" 2>"$2.err" &&
        cmp -s "$REF_SUMS" "$2"
}

same_as_ref() { cmp -s "$REF/$2" "$1/$2"; }

# ------------------------------------------------------------------ registries under test
# (used by registry_clients.sh / registry_badinput.sh)
#
#   make_htpasswd FILE USER PASS [USER PASS]...   bcrypt htpasswd file ($2y$/$2b$, cost 5):
#                            `htpasswd -B` (apache2-utils) if present, else python3
#                            (bcrypt module, else the stdlib crypt module)
#   start_ferry_registry NAME CONFIG [ADDR]    `$FERRY registry serve --config CONFIG
#                            --addr ADDR --root $E2E_TMP/NAME/data` (ADDR default
#                            127.0.0.1:<free port>; pass the old one to restart NAME)
#   start_docker_registry NAME [HTPASSWD]   a further Debian docker-registry instance
#                            (optionally with htpasswd auth), for checking the checks;
#                            REG_ACCESSLOG_OFF=false turns its access log on (REG_LOG)
#   Both set REG_ADDR (host:port), REG_PID, REG_DATA (storage dir), REG_LOG, return
#   non-zero (after printing the log tail) if the server does not answer /v2/ within
#   30 s, and are stopped by the EXIT trap.
#   http_req METHOD URL [CURL_ARGS...]   curl --path-as-is; sets HTTP_CODE (000 on a
#                            transport error); body in $HTTP_BODY, headers in $HTTP_HDRS
#   http_header NAME         value of header NAME in the last http_req (case-insensitive)
#   token_auth_toml FILE TTL RULE...   a registry config with token auth (see below)
#   netns_fleet PREFIX COUNT a bridge and COUNT network namespaces (see below)

# netns_fleet PREFIX COUNT: a bridge with HOST_IP=10.NET.0.1/24 on the host and COUNT
# network namespaces wired to it, node i at $(node_ip i) in namespace $(ns i) (names
# PREFIX<random>…, NET random, so two scripts' fleets do not collide); torn down (its
# processes killed) at cleanup. Then: node_ip I, ns I, in_ns I CMD... (CMD in node I's
# network namespace).
netns_fleet() {
    local prefix=$1 i
    FLEET_SIZE=$2
    NET=$((100 + RANDOM % 100))
    TAG=$prefix$((RANDOM % 10000))
    BR=${TAG}br
    HOST_IP=10.$NET.0.1
    e2e_defer _netns_fleet_down
    ip link add "$BR" type bridge || e2e_die "cannot create a bridge"
    ip addr add "$HOST_IP/24" dev "$BR"
    ip link set "$BR" up
    for ((i = 1; i <= FLEET_SIZE; i++)); do
        ip netns add "$(ns "$i")"
        ip link add "${TAG}h$i" type veth peer name "${TAG}p$i"
        ip link set "${TAG}p$i" netns "$(ns "$i")"
        ip link set "${TAG}h$i" master "$BR" up
        ip -n "$(ns "$i")" link set lo up
        ip -n "$(ns "$i")" addr add "$(node_ip "$i")/24" dev "${TAG}p$i"
        ip -n "$(ns "$i")" link set "${TAG}p$i" up
    done
    e2e_log "bridge $BR $HOST_IP/24, $FLEET_SIZE namespaces"
}
node_ip() { echo "10.$NET.0.$((10 + $1))"; }
ns() { echo "${TAG}n$1"; }
in_ns() {
    local i=$1
    shift
    nsenter --net="/run/netns/$(ns "$i")" -- "$@"
}
_netns_fleet_down() {
    local i
    for ((i = 1; i <= FLEET_SIZE; i++)); do
        ip netns pids "$(ns "$i")" 2>/dev/null | xargs -r kill -9 2>/dev/null
        ip netns del "$(ns "$i")" 2>/dev/null
        ip link del "${TAG}h$i" 2>/dev/null
    done
    ip link del "$BR" 2>/dev/null
    true
}

# token_auth_toml FILE TTL RULE...: a ferry registry config with token auth over the
# users of $E2E_TMP/htpasswd (make_htpasswd first), tokens signed with a secret in
# $E2E_TMP/token.secret, lasting TTL ("" for the default); each RULE is
# "REPOSITORY USERS ACTIONS", USERS and ACTIONS comma-separated: "private/** robot pull"
token_auth_toml() {
    local file=$1 ttl=$2 rule repo users actions
    shift 2
    {
        printf '[auth]\nhtpasswd = "%s"\nmode = "token"\nsecret_file = "%s"\n' \
            "$E2E_TMP/htpasswd" "$E2E_TMP/token.secret"
        [[ -z $ttl ]] || printf 'token_ttl = "%s"\n' "$ttl"
        for rule in "$@"; do
            read -r repo users actions <<<"$rule"
            printf '[[auth.rules]]\nrepository = "%s"\nusers = [%s]\nactions = [%s]\n' \
                "$repo" "$(_toml_strings "$users")" "$(_toml_strings "$actions")"
        done
    } >"$file"
}
# _toml_strings a,b,c -> "a", "b", "c"
_toml_strings() {
    local item items out=()
    IFS=, read -ra items <<<"$1"
    for item in "${items[@]}"; do out+=("\"$item\""); done
    local joined
    printf -v joined '%s, ' "${out[@]}"
    printf '%s' "${joined%, }"
}

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
    local name=$1 config=$2
    e2e_init
    find_ferry
    [[ -x $FERRY ]] || { e2e_log "ferry binary not found: $FERRY"; return 1; }
    REG_ADDR=${3:-127.0.0.1:$(free_port)}
    REG_DATA=$E2E_TMP/$name/data
    REG_LOG=$E2E_TMP/$name.log
    mkdir -p "$REG_DATA"
    "$FERRY" registry serve --config "$config" --addr "$REG_ADDR" --root "$REG_DATA" >>"$REG_LOG" 2>&1 &
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
    disabled: ${REG_ACCESSLOG_OFF:-true}
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
# start_containerd_with_snapshotter NAME SOCKET: start_containerd with the proxy
# snapshotter NAME (`[proxy_plugins.NAME] type = "snapshot" address = SOCKET`) in its
# config, so `ctr --snapshotter NAME` talks to SOCKET.
start_containerd_with_snapshotter() { start_containerd "$1" "$2"; }

# ferry as containerd's snapshotter, standalone (`ferry snapshotter`) or inside the node
# daemon (`ferry daemon --config`), at SNAP_SOCK with its root at SNAP_ROOT (defaults
# under $E2E_TMP; set them before the first start to change them), log SNAP_LOG
# (appended), pid SNAP_PID; a start after kill -9 is fine (the stale socket is replaced).
# A start waits until the log gains a new "serving on" line (the socket file of a killed
# one may still exist, so the file alone proves nothing) and dies after 30 s. Stopped
# (SIGTERM) at exit. SNAP_LOG_LEVEL sets --log (default: snapshotter/daemon debug).
snap_paths() {
    e2e_init
    SNAP_ROOT=${SNAP_ROOT:-$E2E_TMP/ferry-snapshotter}
    SNAP_SOCK=${SNAP_SOCK:-$E2E_TMP/run/ferry-snapshotter.sock}
    SNAP_LOG=${SNAP_LOG:-$E2E_TMP/ferry-snapshotter.log}
    SNAP_PID=${SNAP_PID:-}
    mkdir -p "$(dirname "$SNAP_SOCK")"
    if [[ -z ${SNAP_DEFERRED:-} ]]; then
        SNAP_DEFERRED=1
        e2e_defer stop_ferry_snapshotter
    fi
}
snap_serving_count() {
    local n=0
    [[ -f $SNAP_LOG ]] && n=$(grep -c ': serving on ' "$SNAP_LOG" || true)
    echo "${n:-0}"
}
_snap_serving_more_than() { (($(snap_serving_count) > $1)); }
# _snap_start WHAT ARGS...: run $FERRY ARGS in the background and wait for it to serve
_snap_start() {
    local what=$1 before
    shift
    find_ferry
    snap_paths
    before=$(snap_serving_count)
    "$FERRY" --log "${SNAP_LOG_LEVEL:-ferry_snapshotter=debug,ferry_daemon=debug,info}" "$@" >>"$SNAP_LOG" 2>&1 &
    SNAP_PID=$!
    if ! wait_for 30 "$what serving" _snap_serving_more_than "$before"; then
        tail -20 "$SNAP_LOG" >&2
        e2e_die "$what did not come up (log $SNAP_LOG)"
    fi
    e2e_log "$what pid $SNAP_PID on $SNAP_SOCK"
}
# start_ferry_snapshotter: `ferry snapshotter --socket $SNAP_SOCK --root $SNAP_ROOT` with
# its own store and control socket under $E2E_TMP (never the node's /run/ferry ones)
start_ferry_snapshotter() {
    snap_paths
    _snap_start "ferry snapshotter" snapshotter --socket "$SNAP_SOCK" --root "$SNAP_ROOT" \
        --store "$E2E_TMP/snapshotter-store" --control-socket "$(dirname "$SNAP_SOCK")/daemon.sock"
}
# start_ferry_daemon CONFIG: `ferry daemon --config CONFIG`; CONFIG's [snapshotter] must
# name $SNAP_SOCK and $SNAP_ROOT (write it after snap_paths)
start_ferry_daemon() {
    _snap_start "ferry daemon" daemon --config "$1"
}
# lazy_snapshotter_daemon [EXTRA_TOML]: snap_paths, then `ferry daemon` serving the
# snapshotter at $SNAP_SOCK/$SNAP_ROOT with store $E2E_TMP/store, control socket
# CTL_SOCK=$E2E_TMP/run/daemon.sock and warm-up, readahead and nearby-file fetches off
# (what a start fetches is what it read), config in DAEMON_CONFIG=$E2E_TMP/daemon.toml;
# EXTRA_TOML (whole sections, e.g. [fetch]; a [fetch] of its own gets those added) goes
# first.
# Started with start_ferry_daemon.
lazy_snapshotter_daemon() {
    snap_paths
    CTL_SOCK=$E2E_TMP/run/daemon.sock
    DAEMON_CONFIG=$E2E_TMP/daemon.toml
    local extra=${1:-}
    if [[ $extra == *"[fetch]"* ]]; then
        extra=${extra/"[fetch]"/$'[fetch]\nreadahead = "0"\nwhole_file = "0"\nnearby = "0"'}
    else
        extra=$'[fetch]\nreadahead = "0"\nwhole_file = "0"\nnearby = "0"\n'"$extra"
    fi
    cat >"$DAEMON_CONFIG" <<EOF
[store]
path = "$E2E_TMP/store"
$extra
[warm]
prefetch = false
background_fill = false

[control]
socket = "$CTL_SOCK"

[snapshotter]
enabled = true
socket = "$SNAP_SOCK"
root = "$SNAP_ROOT"
EOF
    start_ferry_daemon "$DAEMON_CONFIG"
}
stop_ferry_snapshotter() {
    [[ -n ${SNAP_PID:-} ]] || return 0
    kill "$SNAP_PID" 2>/dev/null || true
    wait "$SNAP_PID" 2>/dev/null || true
    SNAP_PID=""
}

# ------------------------------------------------------------------ running ferry
# require_ferry [SUBCOMMAND]: end the script with a FAIL unless $FERRY exists (and runs
# `SUBCOMMAND --help`); logs which binary runs
require_ferry() {
    if [[ ! -x $FERRY ]] || { [[ -n ${1:-} ]] && ! "$FERRY" "$1" --help >/dev/null 2>&1; }; then
        fail "ferry binary${1:+ with \`$1\`} not found: $FERRY (set FERRY= or cargo build --release -p ferry)"
        e2e_summary || exit 1
    fi
    e2e_log "ferry: $FERRY"
}
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
