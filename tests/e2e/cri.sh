#!/usr/bin/env bash
# tests/e2e/cri.sh — the Kubernetes path: containerd's CRI plugin driven over its gRPC
# API the way the kubelet drives it (tests/cri/cri_client.py), first with containerd's
# own overlayfs snapshotter, then with ferry as the CRI snapshotter.
#
#   bash tests/e2e/cri.sh     (E2E_CONTAINERD=system or =2: one containerd version only)
#
# Runs once with the system's containerd (Debian 12: 1.6, config version 2) and once with
# containerd 2.x (config version 3; lib.sh per_containerd).
#
# Setup: a ferry registry on loopback holding the small image (bench/make-image.sh
# --small) indexed by `ferry index` and pushed with its index by `ferry copy`, and a
# pause image (the small image's busybox running `sleep`) for the pod sandbox — no
# image comes from the internet. For each variant a private containerd (that version)
# is started with the CRI plugin enabled, plain HTTP to the local registry through a
# `config_path` hosts.toml, CNI pointed at empty dirs (host-network pods need none).
#
# First the client's own unit tests (tests/cri/test_cri_client.py, no containerd).
# Per variant (overlayfs, then ferry):
#   Version answers runtime.v1; PullImage returns an image ref and ImageStatus knows it;
#   RunPodSandbox (host network); CreateContainer + StartContainer of a command that
#   prints the image's files (motd, app file, sha256 of a 1 MiB data file, /tmp after
#   the whiteout); ContainerStatus reaches EXITED with code 0; the CRI log file holds the
#   expected lines (compared with the image extracted on the host); StopContainer,
#   RemoveContainer, StopPodSandbox, RemovePodSandbox succeed and nothing is left.
# The ferry variant registers ferry's snapshotter as [proxy_plugins.ferry] with
# `snapshotter = "ferry"` and `disable_snapshot_annotations = false` (so CRI passes the
# image ref and layer digests; on containerd 2.x also `use_local_image_pull = true`, see
# cri_config_v3). It runs `ferry daemon --config` when the binary has it (then every
# layer of the indexed image must be a FUSE mount, no layer blob may reach containerd's
# content store, and removing the images must release the mounts: checked PASS/FAILs),
# else the standalone `ferry snapshotter` (ordinary unpack; the FUSE count is only
# logged). With the daemon, also a private repository (token auth, only `robot` may
# pull) through the daemon's CRI image-service proxy ([cri], in front of this
# containerd) with the credentials in PullImage, as the kubelet sends a pull secret:
# refused without or with wrong credentials; with them, its layers are FUSE mounts, no
# layer blob is in containerd's content store, a file reads right lazily, and the
# password is neither in the store nor in the daemon's log.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), E2E_KEEP=1,
#      E2E_VERBOSE=1 (print service logs on failure), CRI_TIMEOUT (seconds per RPC, 120),
#      FERRY_CRI_BACKEND=daemon|snapshotter (default: daemon if `ferry daemon --config` exists).
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# once with the system containerd (1.6), once with containerd 2.x (lib.sh, containerd_flavours)
per_containerd "$0" "$@"

need_root "containerd with CRI, runc"
need_cmd containerd ctr runc containerd-shim-runc-v2 protoc jq curl sha256sum timeout
# Debian's python (python3-grpcio, python3-protobuf), not whatever python3 is first in PATH
PY=/usr/bin/python3
[[ -x $PY ]] || skip "missing /usr/bin/python3"
$PY -c 'import grpc, google.protobuf' 2>/dev/null || skip "missing python3-grpcio / python3-protobuf"
find_ferry
e2e_init
T_START=$SECONDS

small_image
require_ferry snapshotter

CRI_CLIENT=$FERRY_ROOT/tests/cri/cri_client.py

# cri CMD ARGS...: one CRI call (to $CRI_SOCK if set, else containerd's socket); response
# JSON in $CRI_OUT, stderr in $CRI_ERR, exit in RC
cri() {
    CRI_OUT=$E2E_TMP/cri.out
    CRI_ERR=$E2E_TMP/cri.err
    set +e
    timeout $((${CRI_TIMEOUT:-120} + 10)) "$PY" "$CRI_CLIENT" --socket "${CRI_SOCK:-$CONTAINERD_SOCK}" \
        --timeout "${CRI_TIMEOUT:-120}" "$@" >"$CRI_OUT" 2>"$CRI_ERR"
    RC=$?
    set -e
}
# cri_ok NAME CMD ARGS...: pass/fail on the call's exit status; returns it
cri_ok() {
    local name=$1
    shift
    cri "$@"
    if [[ $RC == 0 ]]; then
        pass "$name"
    else
        fail "$name: exit $RC: $(tail -1 "$CRI_ERR")"
        return 1
    fi
}
jout() { jq -r "$1" "$CRI_OUT"; }

# ---------------------------------------------------------------- the client itself
if "$PY" -m unittest -q "$FERRY_ROOT/tests/cri/test_cri_client.py" >"$E2E_TMP/client-unit.log" 2>&1; then
    pass "CRI client: cri.proto wire numbers and RPC paths against an in-process gRPC server"
else
    fail "CRI client unit tests (tests/cri/test_cri_client.py)"
    show "$E2E_TMP/client-unit.log" 20
fi

# ---------------------------------------------------------------- images
echo "# setup: registry with the indexed small image and a pause image"
IMG=$E2E_TMP/img
indexed_small "$IMG"
APP_LAYER_DIGESTS=$(oci_manifest "$IMG" small | jq -r '.layers[].digest')
APP_LAYERS=$(wc -w <<<"$APP_LAYER_DIGESTS")
REF_TREE=$E2E_TMP/small-tree
oci_extract "$SMALL" small "$REF_TREE"
PAUSE_ROOT=$E2E_TMP/pause-root
mkdir -p "$PAUSE_ROOT/bin"
cp -a "$REF_TREE/bin/busybox" "$PAUSE_ROOT/bin/busybox"
python3 "$FERRY_ROOT/bench/oci-layout.py" write --out "$E2E_TMP/pause" --tag pause \
    --cmd '["/bin/busybox","sleep","2147483647"]' --env PATH=/bin "$PAUSE_ROOT" >"$E2E_TMP/pause.log" 2>&1 ||
    { show "$E2E_TMP/pause.log"; e2e_die "writing the pause image failed"; }

# Token auth: e2e/** is public (anonymous pull), private/** only for `robot` (and the
# pusher): the private checks pull it through ferry's CRI proxy with robot's password.
ROBOT_PW="robot-pw-$RANDOM$RANDOM-only-in-memory"
printf 'robot:%s' "$ROBOT_PW" >"$E2E_TMP/robot.auth"
printf 'robot:not-%s' "$ROBOT_PW" >"$E2E_TMP/wrong.auth"
make_htpasswd "$E2E_TMP/htpasswd" pusher pushpw robot "$ROBOT_PW" || e2e_die "no htpasswd"
token_auth_toml "$E2E_TMP/reg.toml" "" "** pusher *" "e2e/** anonymous,* pull" "private/** robot pull"
start_ferry_registry reg "$E2E_TMP/reg.toml" || e2e_die "ferry registry did not start"
REGISTRY=$REG_ADDR
APP_IMAGE=$REGISTRY/e2e/small:v1
PAUSE_IMAGE=$REGISTRY/e2e/pause:v1
PRIVATE_IMAGE=$REGISTRY/private/small:v1
mkdir -p "$E2E_TMP/docker-pusher"
printf '{"auths":{"%s":{"auth":"%s"}}}\n' "$REGISTRY" "$(printf pusher:pushpw | base64 -w0)" \
    >"$E2E_TMP/docker-pusher/config.json"
pushing() { DOCKER_CONFIG=$E2E_TMP/docker-pusher "$FERRY" copy "$@" >>"$E2E_TMP/copy.log" 2>&1; }
if ! pushing "oci:$IMG:small" "$APP_IMAGE" || ! pushing "oci:$IMG:small" "$PRIVATE_IMAGE" ||
    ! pushing "oci:$E2E_TMP/pause:pause" "$PAUSE_IMAGE"; then
    show "$E2E_TMP/copy.log"
    e2e_die "ferry copy to the registry failed"
fi
e2e_log "images $APP_IMAGE and $PAUSE_IMAGE"

# What the container prints, computed from the image extracted on the host.
NUM_SUM=$(sha256sum <"$REF_TREE/data/sub/dir/numbers.txt" | cut -d' ' -f1)
CTR_SCRIPT='cat /etc/motd; cat /app/hello.txt; cat /data/overwritten.txt;
sha256sum /data/sub/dir/numbers.txt; echo "tmp: $(ls -A /tmp | tr "\n" " ")"; echo done'
EXPECTED=$E2E_TMP/expected.txt
{
    cat "$REF_TREE/etc/motd" "$REF_TREE/app/hello.txt" "$REF_TREE/data/overwritten.txt"
    echo "$NUM_SUM  /data/sub/dir/numbers.txt"
    echo "tmp: $(ls -A "$REF_TREE/tmp" | tr '\n' ' ')"
    echo "done"
} >"$EXPECTED"

# ---------------------------------------------------------------- containerd with CRI
# start_cri_containerd DIR SNAPSHOTTER [PROXY_SOCKET]: containerd with the CRI plugin,
# state under DIR; SNAPSHOTTER is CRI's snapshotter; a PROXY_SOCKET registers
# [proxy_plugins.SNAPSHOTTER] and turns snapshot annotations on for it
start_cri_containerd() {
    local d=$1 snap=$2 proxy=${3:-} annotations=true
    mkdir -p "$d/cni/bin" "$d/cni/conf" "$d/certs.d/$REGISTRY"
    [[ -n $proxy ]] && annotations=false
    cat >"$d/certs.d/$REGISTRY/hosts.toml" <<EOF
server = "http://$REGISTRY"

[host."http://$REGISTRY"]
  capabilities = ["pull", "resolve"]
EOF
    # lib.sh's base config (state under DIR) with the CRI plugin left on, plus its section
    containerd_config "$d" true
    if ((CONTAINERD_MAJOR >= 2)); then
        cri_config_v3 "$d" "$snap" "$annotations"
    else
        cri_config_v2 "$d" "$snap" "$annotations"
    fi
    [[ -z $proxy ]] || containerd_add_proxy_snapshotter "$snap" "$proxy"
    CONTAINERD_LOG=$d/containerd.log
    launch_containerd "CRI, snapshotter $snap"
    if ! wait_for 30 "containerd CRI" "$PY" "$CRI_CLIENT" --socket "$CONTAINERD_SOCK" --timeout 2 version; then
        tail -30 "$CONTAINERD_LOG" >&2
        e2e_die "containerd with CRI did not come up (log: $CONTAINERD_LOG)"
    fi
    e2e_log "containerd pid $CONTAINERD_PID with CRI, snapshotter $snap"
}

# cri_config_v3 DIR SNAPSHOTTER ANNOTATIONS: the CRI sections of a version 3 config
# (containerd 2.x): images (snapshotter, annotations, pause image, registry) and runtime
# are plugins of their own. 2.1+ pulls through the transfer service unless
# use_local_image_pull is set; that path passes CRI's snapshot labels only with the
# snapshotter's `enable_remote_snapshot_annotations` export and unpacks only for
# snapshotters in the transfer plugin's unpack_config, so a proxy snapshotter uses the
# local pull, as containerd 1.x did (containerd would fall back to it by itself on
# disable_snapshot_annotations = false, with a warning).
cri_config_v3() {
    local d=$1 snap=$2 annotations=$3 local_pull=false
    [[ $annotations == false ]] && local_pull=true
    cat >>"$CONTAINERD_CONFIG" <<EOF
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = '$snap'
    disable_snapshot_annotations = $annotations
    use_local_image_pull = $local_pull
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '$PAUSE_IMAGE'
    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = '$d/certs.d'
  [plugins.'io.containerd.cri.v1.runtime']
    enable_selinux = false
    disable_apparmor = true
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['$d/cni/bin']
      conf_dir = '$d/cni/conf'
  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
    stream_server_port = '0'
EOF
}

# cri_config_v2 DIR SNAPSHOTTER ANNOTATIONS: the same for a version 2 config (1.x)
cri_config_v2() {
    local d=$1 snap=$2 annotations=$3
    cat >>"$CONTAINERD_CONFIG" <<EOF
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "$PAUSE_IMAGE"
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    enable_selinux = false
    disable_apparmor = true
    # never ask for a lower oom_score_adj than containerd's own (the pause container
    # wants -998, which an unprivileged-for-OOM environment such as a CI sandbox refuses)
    restrict_oom_score_adj = true
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "$snap"
      disable_snapshot_annotations = $annotations
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "$d/cni/bin"
      conf_dir = "$d/cni/conf"
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = "$d/certs.d"
EOF
}

# ---------------------------------------------------------------- one variant
# cri_variant NAME SNAPSHOTTER [PROXY_SOCKET]
cri_variant() {
    local v=$1 snap=$2 proxy=${3:-} d=$E2E_TMP/cri-$1 pod ctr logdir t0 state code
    echo "# $v: CRI with snapshotter $snap"
    start_cri_containerd "$d" "$snap" "$proxy"

    if cri_ok "$v: Version" version; then
        if [[ $(jout .runtime_api_version) == v1* ]]; then
            pass "$v: runtime $(jout .runtime_name) $(jout .runtime_version), API $(jout .runtime_api_version)"
        else
            fail "$v: runtime API version '$(jout .runtime_api_version)', want v1"
        fi
    fi

    t0=$SECONDS
    if cri_ok "$v: PullImage $APP_IMAGE" pull "$APP_IMAGE"; then
        local ref
        ref=$(jout .image_ref)
        cri image-status "$APP_IMAGE"
        if [[ $RC == 0 && $ref == sha256:* && $(jout .image.id) == "$ref" ]]; then
            pass "$v: ImageStatus knows $ref ($((SECONDS - t0)) s incl. the pull, $(jout .image.size) bytes)"
        else
            fail "$v: ImageStatus: exit $RC, id $(jout .image.id 2>/dev/null), pulled $ref"
        fi
    fi

    logdir=$d/pod-logs
    mkdir -p "$logdir"
    t0=$SECONDS
    if ! cri_ok "$v: RunPodSandbox (host network, pause image from the local registry)" \
        run-pod --name "pod-$v" --log-dir "$logdir" --pod-config "$d/pod.json"; then
        show "$CRI_ERR"
        tail -20 "$CONTAINERD_LOG" | show /dev/stdin
        stop_cri_containerd "$d"
        return
    fi
    pod=$(jout .pod_sandbox_id)
    e2e_log "$v: pod $pod ($((SECONDS - t0)) s)"

    if cri_ok "$v: CreateContainer" create --pod "$pod" --pod-config "$d/pod.json" --name "app-$v" \
        --image "$APP_IMAGE" --log-path app.log -- /bin/sh -c "$CTR_SCRIPT"; then
        ctr=$(jout .container_id)
        t0=$SECONDS
        if cri_ok "$v: StartContainer" start "$ctr"; then
            state="" code=""
            for _ in $(seq 150); do
                cri status "$ctr"
                state=$(jout .status.state 2>/dev/null || true)
                [[ $state == CONTAINER_EXITED ]] && break
                sleep 0.2
            done
            code=$(jout '.status.exit_code // 0' 2>/dev/null || true)
            if [[ $state == CONTAINER_EXITED && $code == 0 ]]; then
                pass "$v: ContainerStatus EXITED, exit code 0 ($((SECONDS - t0)) s after start)"
            else
                fail "$v: ContainerStatus state '$state', exit code '$code': $(jout '.status.reason + " " + .status.message' 2>/dev/null)"
            fi
            # CRI log format: "<RFC3339Nano> <stdout|stderr> <F|P> <text>"
            local logfile=$logdir/app.log
            if [[ -f $logfile ]]; then
                awk '$2 == "stdout" { sub(/^[^ ]+ [^ ]+ [^ ]+ /, ""); print }' "$logfile" >"$d/got.txt"
                if cmp -s "$EXPECTED" "$d/got.txt"; then
                    pass "$v: the container's CRI log holds the image's content ($(wc -l <"$d/got.txt") lines, numbers.txt sha256 ${NUM_SUM:0:12}…)"
                else
                    fail "$v: container log differs from the extracted image (- want, + got)"
                    diff "$EXPECTED" "$d/got.txt" | grep '^[<>]' | sed 's/^</-/; s/^>/+/' | show /dev/stdin 20 || true
                    show "$logfile"
                fi
            else
                fail "$v: no container log at $logfile"
            fi
        fi
        if [[ -n $proxy ]]; then
            # did the snapshotter mount layers lazily or unpack them?
            local fuse blobs=0 l
            fuse=$(fuse_mounts)
            if [[ ${FERRY_BACKEND:-} == daemon ]]; then
                # the daemon mounts indexed layers lazily: the small image is indexed (the
                # pause image is not: unpacked)
                if ((fuse == APP_LAYERS)); then
                    pass "$v: layers mounted lazily ($fuse FUSE mounts under the daemon's root, one per layer)"
                else
                    fail "$v: $fuse FUSE mounts for the indexed image's $APP_LAYERS layers: not mounted lazily"
                fi
                local content
                content=$(ctr -a "$CONTAINERD_SOCK" -n k8s.io content ls -q || true)
                for l in $APP_LAYER_DIGESTS; do
                    grep -xF "$l" <<<"$content" >/dev/null && blobs=$((blobs + 1))
                done
                # (the manifest and config are there: the listing itself worked)
                if ((blobs == 0)) && [[ $content == *sha256:* ]]; then
                    pass "$v: no layer blob of the image in containerd's content store (nothing downloaded or unpacked)"
                else
                    fail "$v: $blobs of $APP_LAYERS layer blobs in containerd's content store: downloaded, not lazy"
                fi
            else
                e2e_log "$v: FUSE mounts while the container existed: $fuse (standalone snapshotter: layers are unpacked)"
            fi
        fi
        cri_ok "$v: StopContainer" stop "$ctr" || true
        cri_ok "$v: RemoveContainer" rm "$ctr" || true
    else
        show "$CRI_ERR"
    fi
    cri_ok "$v: StopPodSandbox" stop-pod "$pod" || true
    cri_ok "$v: RemovePodSandbox" rm-pod "$pod" || true
    local left
    left=$(ctr -a "$CONTAINERD_SOCK" -n k8s.io containers ls -q 2>/dev/null | wc -l)
    if [[ $left == 0 ]]; then
        pass "$v: no containers left in namespace k8s.io"
    else
        fail "$v: $left containers left in namespace k8s.io"
    fi
    if [[ -n $proxy && ${FERRY_BACKEND:-} == daemon ]]; then
        # removing the images lets containerd's collector remove the snapshots (containerd
        # 2.x sends its List and Remove without a namespace), which releases the mounts
        # shellcheck disable=SC2046 # image names have no spaces
        timeout 60 ctr -a "$CONTAINERD_SOCK" -n k8s.io image rm --sync \
            $(ctr -a "$CONTAINERD_SOCK" -n k8s.io image ls -q) >/dev/null 2>&1 || true
        if wait_for 20 "lazy layers released" fuse_mounts_are 0; then
            pass "$v: images removed: containerd's collector removed the snapshots, no FUSE mount left"
        else
            fail "$v: $(fuse_mounts) FUSE mounts left after the images were removed"
        fi
    fi
    if [[ -n $proxy && ${FERRY_BACKEND:-} == daemon ]]; then
        cri_private "$v"
    fi
    stop_cri_containerd "$d"
}

# cri_private V: the private repository, pulled as the kubelet pulls it with an image pull
# secret, through ferry's CRI image-service proxy ([cri], in front of this containerd):
# containerd gets the call unchanged, ferry keeps the credentials in memory for the
# lazy layers' reads. From the attacker's side: no credentials, or wrong ones, get
# nothing; the password is nowhere in the store or the daemon's log.
cri_private() {
    local v=$1 fuse f sum blobs=0 l content
    echo "# $v: private repository through ferry's CRI proxy"
    cri pull "$PRIVATE_IMAGE"
    if [[ $RC != 0 ]]; then
        pass "$v: PullImage of $PRIVATE_IMAGE without credentials is refused"
    else
        fail "$v: PullImage of $PRIVATE_IMAGE without credentials succeeded"
    fi
    CRI_SOCK=$CRI_PROXY_SOCK cri pull "$PRIVATE_IMAGE" --auth-file "$E2E_TMP/wrong.auth"
    if [[ $RC != 0 ]] && fuse_mounts_are 0; then
        pass "$v: through the proxy with a wrong password: refused, nothing mounted"
    else
        fail "$v: through the proxy with a wrong password: exit $RC, $(fuse_mounts) FUSE mounts"
    fi
    if CRI_SOCK=$CRI_PROXY_SOCK cri_ok "$v: PullImage of $PRIVATE_IMAGE through ferry's CRI proxy with the pull secret" \
        pull "$PRIVATE_IMAGE" --auth-file "$E2E_TMP/robot.auth"; then
        fuse=$(fuse_mounts)
        if ((fuse == APP_LAYERS)); then
            pass "$v: the private image's layers are mounted lazily ($fuse FUSE mounts)"
        else
            fail "$v: $fuse FUSE mounts for the private image's $APP_LAYERS layers: not lazy"
            tail -20 "$SNAP_LOG" | show /dev/stdin
        fi
        content=$(ctr -a "$CONTAINERD_SOCK" -n k8s.io content ls -q || true)
        for l in $APP_LAYER_DIGESTS; do
            grep -xF "$l" <<<"$content" >/dev/null && blobs=$((blobs + 1))
        done
        if ((blobs == 0)); then
            pass "$v: no layer blob of the private image in containerd's content store"
        else
            fail "$v: $blobs layer blobs of the private image in containerd's content store"
        fi
        # a lazy read through the daemon's FUSE mount, with the kept credentials (the
        # daemon has no others)
        f=$(find "$SNAP_ROOT" -path '*/fs/data/sub/dir/numbers.txt' 2>/dev/null | head -1 || true)
        sum=""
        [[ -n $f ]] && sum=$(timeout 60 sha256sum <"$f" | cut -d' ' -f1)
        if [[ -n $f && $sum == "$NUM_SUM" ]]; then
            pass "$v: a file of the private image reads lazily and right (sha256 ${sum:0:12}…)"
        else
            fail "$v: reading numbers.txt of the private image: '${f:-not found}' sha256 '$sum'"
        fi
    fi
    if grep -rlF "$ROBOT_PW" "$E2E_TMP/store" "$SNAP_LOG" >/dev/null 2>&1; then
        fail "$v: the pull secret's password was found in the store or the daemon's log"
    else
        pass "$v: the pull secret's password is neither in the store nor in the daemon's log"
    fi
    # the proxy's counters as an operator sees them (`ferry status`)
    local st
    st=$(timeout 20 "$FERRY" status --json --socket "$E2E_TMP/run/daemon.sock" 2>/dev/null || true)
    if [[ $(jq -r '(.cri.credentials_kept >= 1) and (.cri.repositories_with_credentials >= 1) and (.cri.forwarded >= 2) and (.daemon.cri_socket != null)' <<<"$st" 2>/dev/null) == true ]]; then
        pass "$v: ferry status shows the CRI proxy: $(jq -c '.cri | {forwarded, credentials_kept, repositories_with_credentials, runtime_unreachable}' <<<"$st")"
    else
        fail "$v: ferry status lacks the CRI proxy's counters: $(jq -c '.cri' <<<"$st" 2>/dev/null || echo "$st" | head -c 300)"
    fi
    # shellcheck disable=SC2046 # image names have no spaces
    timeout 60 ctr -a "$CONTAINERD_SOCK" -n k8s.io image rm --sync \
        $(ctr -a "$CONTAINERD_SOCK" -n k8s.io image ls -q) >/dev/null 2>&1 || true
    wait_for 20 "lazy layers released" fuse_mounts_are 0 || true
}

# fuse_mounts: FUSE mounts under the temp dir (the daemon's lazy layers)
fuse_mounts() {
    awk -v r="$E2E_TMP/" 'index($5, r) == 1 {
        for (i = 7; i <= NF; i++) if ($i == "-") { if ($(i + 1) ~ /^fuse/) n++; break }
    } END { print n + 0 }' /proc/self/mountinfo
}
fuse_mounts_are() { [[ $(fuse_mounts) == "$1" ]]; }

stop_cri_containerd() {
    stop_containerd || true
    e2e_umount_under "$1"
}

# ---------------------------------------------------------------- variants
t_variant=$SECONDS
cri_variant overlayfs overlayfs
e2e_log "overlayfs variant: $((SECONDS - t_variant)) s"

snap_paths # SNAP_ROOT, SNAP_SOCK, SNAP_LOG (lib.sh)
# The node daemon (store + lazy layers + snapshotter) when this build has it, else the
# standalone snapshotter (ordinary unpack through ferry).
FERRY_BACKEND=${FERRY_CRI_BACKEND:-auto}
if [[ $FERRY_BACKEND == auto ]]; then
    FERRY_BACKEND=snapshotter
    "$FERRY" daemon --help 2>/dev/null | grep -- '--config' >/dev/null && FERRY_BACKEND=daemon
fi
CRI_PROXY_SOCK=$E2E_TMP/run/cri.sock
if [[ $FERRY_BACKEND == daemon ]]; then
    cat >"$E2E_TMP/daemon.toml" <<EOF
[store]
path = "$E2E_TMP/store"

[control]
socket = "$E2E_TMP/run/daemon.sock"

[snapshotter]
enabled = true
socket = "$SNAP_SOCK"
root = "$SNAP_ROOT"

[cri]
enabled = true
socket = "$CRI_PROXY_SOCK"
runtime_socket = "$E2E_TMP/cri-ferry/containerd.sock"
EOF
    start_ferry_daemon "$E2E_TMP/daemon.toml"
else
    start_ferry_snapshotter
fi
t_variant=$SECONDS
cri_variant ferry ferry "$SNAP_SOCK"
e2e_log "ferry variant ($FERRY_BACKEND): $((SECONDS - t_variant)) s"
if grep -q 'cri.image-ref\|cri.layer-digest\|snapshot/cri' "$SNAP_LOG"; then
    e2e_log "ferry snapshotter saw CRI's snapshot annotations (image ref / layer digests)"
fi
stop_ferry_snapshotter
e2e_umount_under "$SNAP_ROOT"

e2e_log "total $((SECONDS - T_START)) s"
e2e_summary
