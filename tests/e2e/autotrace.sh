#!/usr/bin/env bash
# tests/e2e/autotrace.sh — startup traces nobody records by hand: a first start records
# and shares one automatically, later starts elsewhere prefetch with it (needs root and
# /dev/fuse).
#
#   bash tests/e2e/autotrace.sh
#
# Setup: the small image (bench/make-image.sh --small, 2 layers, default command
# /app/start.sh), indexed in 64 KiB spans, as app:v1 in two ferry registries: `reg`
# (open) and `regauth` (htpasswd, Basic: `pusher` may push team/**, `node` may only
# pull). app:v2 is the same image with its second layer changed (one file rewritten,
# one added), indexed and copied as app:v2 to `reg`. Each "node" is a fresh `ferry
# daemon` (snapshotter, empty store, [trace] quiet = 1s, shipped warm-up otherwise, no fd
# holder) with a private containerd of its own; a node is taken down (containerd,
# daemon, its lazy mounts) before the next one starts.
#
# 1. node1 (reg): `ferry pull` app:v1 + `ctr run` → status shows its mounts recording;
#    within 30 s the log says "recorded a startup trace", the registry lists a trace
#    artifact among v1's referrers, the repository's `ferry.trace` tag points at it, and
#    the node store has a trace file (0600 in a 0700 traces/ directory).
# 2. node2 (reg, fresh): pull v1 → status: every mount's trace source is "published",
#    prefetch done and bytes_prefetched > 0 over the image; `ctr run` prints "ready
#    small"; it records nothing (no second trace among v1's referrers).
# 3. node3 (reg, fresh): pull v2 (no trace of its own) → its mounts use the trace of v1
#    ("previous-version", recorded for v1's manifest), bytes_prefetched > 0; the
#    container runs.
# 4. node4 (regauth, credentials of `node`, pull only): pull + run v1 → the trace push
#    is refused, the daemon sends it to the registry's trace endpoint: v1's referrers
#    list a trace accepted from "node".
# 5. node5 (regauth, `node`, fresh): pull v1 → source "published", bytes_prefetched > 0.
#
# Env: FERRY (default target/release/ferry), FERRY_TIMEOUT, E2E_KEEP=1, E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "private containerd, FUSE"
need_cmd containerd ctr runc jq curl timeout python3
[[ -e /dev/fuse ]] || skip "no /dev/fuse"
find_ferry
e2e_init
small_image
require_ferry pull

TRACE_TYPE=application/vnd.ferry.trace.v1+json

# ---------------------------------------------------------------- helpers
say() { sed 's/^/    | /' <<<"$1" | tail -"${2:-10}"; }
# cn ARGS...: ctr on the current node's containerd; output in OUT, exit in RC
cn() {
    set +e
    OUT=$(timeout "${CT:-120}" ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" "$@" 2>&1)
    RC=$?
    set -e
}
# fpull REF: ferry pull REF into the current node; output in PULL_OUT, exit in PULL_RC
fpull() {
    set +e
    PULL_OUT=$(timeout "${FERRY_TIMEOUT:-120}" "$FERRY" pull --address "$CONTAINERD_SOCK" \
        --namespace "$CTR_NAMESPACE" --snapshotter ferry --snapshotter-root "$SNAP_ROOT" \
        --plain-http "$1" 2>&1)
    PULL_RC=$?
    set -e
}
status_json() { fy "$1" "$E2E_TMP/status.err" status --json --socket "$CTL_SOCK"; }
# mounts_of DIGEST FILE: the status mounts of image manifest DIGEST (JSON array)
mounts_of() { jq -c --arg d "$1" '[.mounts[] | select(.manifest_digest == $d)]' "$2"; }
# referrers REG REPO DIGEST [AUTH]: trace referrers of DIGEST (JSON array)
referrers() {
    local auth=()
    [[ -n ${4:-} ]] && auth=(-u "$4")
    curl -fsS --noproxy '*' "${auth[@]}" "http://$1/v2/$2/referrers/$3" |
        jq -c '[.manifests[] | select(.artifactType == "'"$TRACE_TYPE"'")]'
}
manifest_digest() { # REG REPO TAG [AUTH]
    local auth=()
    [[ -n ${4:-} ]] && auth=(-u "$4")
    curl -fsS --noproxy '*' "${auth[@]}" -o /dev/null -w '%header{docker-content-digest}' \
        -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$1/v2/$2/manifests/$3"
}

# node_up NAME [DOCKER_CONFIG_DIR]: a fresh node (containerd + ferry daemon) under
# $E2E_TMP/NAME; sets NODE_DIR, CTL_SOCK, SNAP_*, CONTAINERD_*
node_up() {
    NODE_DIR=$E2E_TMP/$1
    mkdir -p "$NODE_DIR/run"
    SNAP_ROOT=$NODE_DIR/snapshotter SNAP_SOCK=$NODE_DIR/run/snapshotter.sock
    SNAP_LOG=$NODE_DIR/daemon.log SNAP_PID=
    CTL_SOCK=$NODE_DIR/run/daemon.sock
    snap_paths
    cat >"$NODE_DIR/daemon.toml" <<EOF
[store]
path = "$NODE_DIR/store"

[fuse]
keep_connections = false

[trace]
quiet = "1s"

[control]
socket = "$CTL_SOCK"

[snapshotter]
enabled = true
socket = "$SNAP_SOCK"
root = "$SNAP_ROOT"
EOF
    if [[ -n ${2:-} ]]; then
        DOCKER_CONFIG=$2 start_ferry_daemon "$NODE_DIR/daemon.toml"
    else
        start_ferry_daemon "$NODE_DIR/daemon.toml"
    fi
    containerd_config "$NODE_DIR/containerd"
    containerd_add_proxy_snapshotter ferry "$SNAP_SOCK"
    CONTAINERD_LOG=$NODE_DIR/containerd.log launch_containerd "node $1"
}
node_down() {
    # (these report how the processes ended, which is not a failure here)
    stop_containerd || true
    stop_ferry_snapshotter || true
    # the snapshotter's lazy layers outlive the daemon by design; this node is done
    e2e_umount_under "$NODE_DIR" || true
}
# wait_prefetched DIGEST FILE: wait (30 s) until every mount of manifest DIGEST has a
# trace and its prefetch is done; the last status in FILE
_prefetched() {
    status_json "$2" && [[ $RC == 0 ]] || return 1
    mounts_of "$1" "$2" | jq -e 'length > 0 and all(.[]; .trace != null and .stats.prefetch_done)' >/dev/null
}
wait_prefetched() { wait_for 30 "prefetch of $1" _prefetched "$1" "$2"; }
# the manifest digest of REF (one of ours)
digest_of_ref() {
    case $1 in
    "$V1") echo "$V1_DIGEST" ;; "$V2") echo "$V2_DIGEST" ;; "$A1") echo "$A1_DIGEST" ;;
    esac
}
# run_ok NAME REF: ctr run REF prints "ready small"
run_ok() {
    cn run --rm --snapshotter ferry "$2" "$1-$$"
    if [[ $RC == 0 && $OUT == *"ready small"* ]]; then
        pass "$1: ctr run --snapshotter ferry $2 prints 'ready small'"
    else
        fail "$1: ctr run: exit $RC"; say "$OUT"
    fi
}
pull_ok() {
    fpull "$2"
    [[ $PULL_RC == 0 ]] || { fail "$1: ferry pull $2: exit $PULL_RC"; say "$PULL_OUT"; return 1; }
}

# ---------------------------------------------------------------- images
IMG=$E2E_TMP/img
indexed_small "$IMG"
# v2: layer 2 with /app/hello.txt rewritten and /app/version.txt added (its config's
# diff_id and the manifest follow), tagged v2 in the same layout, then indexed
python3 "$FERRY_ROOT/bench/oci-layout.py" new-version --layout "$IMG" --tag small --new-tag v2 \
    --set app/hello.txt=$'hello from version 2 of the ferry small image\n' --set app/version.txt=$'2\n'
fy "$E2E_TMP/index2.out" "$E2E_TMP/index2.err" index --min-layer-size 0 --span 65536 "oci:$IMG:v2"
[[ $RC == 0 ]] || { show "$E2E_TMP/index2.err"; e2e_die "ferry index of v2 failed"; }

: >"$E2E_TMP/reg.toml"
start_ferry_registry reg "$E2E_TMP/reg.toml" || e2e_die "ferry registry did not start"
REG=$REG_ADDR
for tag in small:v1 v2:v2; do
    fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy --plain-http "oci:$IMG:${tag%%:*}" "$REG/team/app:${tag#*:}"
    [[ $RC == 0 ]] || { show "$E2E_TMP/cp.err"; e2e_die "ferry copy of $tag failed"; }
done
V1=$REG/team/app:v1 V2=$REG/team/app:v2
V1_DIGEST=$(manifest_digest "$REG" team/app v1)
V2_DIGEST=$(manifest_digest "$REG" team/app v2)
[[ $V1_DIGEST == sha256:* && $V2_DIGEST == sha256:* && $V1_DIGEST != "$V2_DIGEST" ]] ||
    e2e_die "manifest digests: v1 '$V1_DIGEST' v2 '$V2_DIGEST'"

make_htpasswd "$E2E_TMP/htpasswd" pusher pushpw node nodepw || e2e_die "no htpasswd"
cat >"$E2E_TMP/regauth.toml" <<EOF
[auth]
htpasswd = "$E2E_TMP/htpasswd"
mode = "basic"
[[auth.rules]]
repository = "team/**"
users = ["pusher"]
actions = ["*"]
[[auth.rules]]
repository = "team/**"
users = ["node"]
actions = ["pull"]
EOF
start_ferry_registry regauth "$E2E_TMP/regauth.toml" || e2e_die "ferry registry (auth) did not start"
REGAUTH=$REG_ADDR
# docker config dirs: the pusher's (to publish the image) and the node's (pull only)
for who in pusher:pushpw node:nodepw; do
    mkdir -p "$E2E_TMP/docker-${who%%:*}"
    printf '{"auths":{"%s":{"auth":"%s"}}}\n' "$REGAUTH" "$(printf %s "$who" | base64 -w0)" \
        >"$E2E_TMP/docker-${who%%:*}/config.json"
done
DOCKER_CONFIG=$E2E_TMP/docker-pusher fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy --plain-http "oci:$IMG:small" "$REGAUTH/team/app:v1"
[[ $RC == 0 ]] || { show "$E2E_TMP/cp.err"; e2e_die "ferry copy to the auth registry failed"; }
A1=$REGAUTH/team/app:v1
A1_DIGEST=$(manifest_digest "$REGAUTH" team/app v1 node:nodepw)

# ---------------------------------------------------------------- 1. record and publish
echo "# node1: first start of $V1, no trace anywhere"
node_up node1
if pull_ok node1 "$V1"; then
    status_json "$E2E_TMP/s1.json"
    rec=$(mounts_of "$V1_DIGEST" "$E2E_TMP/s1.json" | jq '[.[] | select(.recording)] | length')
    n=$(mounts_of "$V1_DIGEST" "$E2E_TMP/s1.json" | jq length)
    if ((n > 0 && rec == n)); then
        pass "node1: status shows all $n mounts of v1 recording"
    else
        fail "node1: $rec of $n mounts recording"; jq -c '.mounts[] | {image, recording, trace}' "$E2E_TMP/s1.json" | say "$(cat)"
    fi
    run_ok node1 "$V1"
    if wait_for 30 "trace recorded" grep -q "recorded a startup trace" "$SNAP_LOG" &&
        wait_for 30 "trace published" sh -c "[ \"\$(curl -fsS --noproxy '*' 'http://$REG/v2/team/app/referrers/$V1_DIGEST' | jq '[.manifests[] | select(.artifactType == \"$TRACE_TYPE\")] | length')\" -ge 1 ]"; then
        pass "node1: trace recorded ($(grep -o 'recorded a startup trace.*' "$SNAP_LOG" | head -1 | cut -c1-120)) and published as v1's referrer"
    else
        fail "node1: no trace published within 30 s"; show "$SNAP_LOG" 20
    fi
    tagged=$(curl -fsS --noproxy '*' -H "Accept: application/vnd.oci.image.manifest.v1+json" \
        "http://$REG/v2/team/app/manifests/ferry.trace" | jq -r '.subject.digest') || tagged=
    [[ $tagged == "$V1_DIGEST" ]] && pass "node1: the repository's ferry.trace tag refers to v1" ||
        fail "node1: ferry.trace tag subject '$tagged', want $V1_DIGEST"
    f=$(find "$NODE_DIR/store/traces" -name "*-${V1_DIGEST#sha256:}.trace.json" 2>/dev/null | head -1)
    if [[ -n $f && $(stat -c %a "$f") == 600 && $(stat -c %a "$NODE_DIR/store/traces") == 700 ]] &&
        jq -e '.version == 1 and (.reads | length) > 0' "$f" >/dev/null; then
        pass "node1: the node store keeps it ($(jq '.reads | length' "$f") reads, file 0600, dir 0700)"
    else
        fail "node1: node store trace '${f:-none}'"; ls -la "$NODE_DIR/store/traces" 2>&1 | say "$(cat)"
    fi
fi
node_down

# ---------------------------------------------------------------- 2. a fresh node uses it
# check_uses NODE REF SOURCE RECORDED_FOR: after pull, REF's mounts prefetch with a trace
# from SOURCE recorded for RECORDED_FOR, and bytes were prefetched
check_uses() {
    local st=$E2E_TMP/$1-status.json mounts srcs rf bytes digest
    digest=$(digest_of_ref "$2")
    if ! wait_prefetched "$digest" "$st"; then
        fail "$1: the mounts of $2 did not prefetch with a trace within 30 s"
        jq -c '.mounts[] | {image, layer, trace, recording, done: .stats.prefetch_done}' "$st" 2>/dev/null | say "$(cat)"
        show "$SNAP_LOG" 15
        return 0
    fi
    mounts=$(mounts_of "$digest" "$st")
    srcs=$(jq -r '[.[].trace.source] | unique | join(",")' <<<"$mounts")
    rf=$(jq -r '[.[].trace.recorded_for] | unique | join(",")' <<<"$mounts")
    bytes=$(jq '[.[].stats.bytes_prefetched] | add // 0' <<<"$mounts")
    if [[ $srcs == "$3" && $rf == "$4" ]] && ((bytes > 0)); then
        pass "$1: $(jq length <<<"$mounts") mounts of $2 prefetched $bytes bytes with the $3 trace of ${4:0:19}…"
    else
        fail "$1: trace source '$srcs' (want $3), recorded for '$rf' (want $4), $bytes bytes prefetched"
        say "$mounts"
    fi
}

echo "# node2: a fresh node, empty store, starts $V1"
node_up node2
if pull_ok node2 "$V1"; then
    check_uses node2 "$V1" published "$V1_DIGEST"
    run_ok node2 "$V1"
    sleep 2
    n=$(referrers "$REG" team/app "$V1_DIGEST" | jq length)
    [[ $n == 1 ]] && pass "node2: recorded nothing (v1 still has exactly one trace)" ||
        fail "node2: v1 has $n traces"
fi
node_down

# ---------------------------------------------------------------- 3. a new tag
echo "# node3: a fresh node starts $V2, which has no trace of its own"
node_up node3
if pull_ok node3 "$V2"; then
    check_uses node3 "$V2" previous-version "$V1_DIGEST"
    run_ok node3 "$V2"
fi
node_down

# ---------------------------------------------------------------- 4./5. pull-only nodes
echo "# node4: credentials that may only pull, first start of $A1"
node_up node4 "$E2E_TMP/docker-node"
export DOCKER_CONFIG=$E2E_TMP/docker-node
if pull_ok node4 "$A1"; then
    run_ok node4 "$A1"
    if wait_for 30 "trace accepted" sh -c "curl -fsS --noproxy '*' -u node:nodepw 'http://$REGAUTH/v2/team/app/referrers/$A1_DIGEST' | jq -e '[.manifests[] | select(.annotations[\"dev.ferry.trace.accepted-from\"] == \"node\")] | length == 1' >/dev/null"; then
        pass "node4: push refused, the registry's trace endpoint accepted the trace from 'node'"
    else
        fail "node4: no trace accepted from 'node' within 30 s"; grep -i "trace" "$SNAP_LOG" | tail -8 | say "$(cat)"
    fi
    grep -q "push refused" "$SNAP_LOG" && pass "node4: the daemon logged the refused push and the fallback" ||
        fail "node4: no 'push refused' in the daemon log"
fi
node_down

echo "# node5: a fresh pull-only node starts $A1"
node_up node5 "$E2E_TMP/docker-node"
if pull_ok node5 "$A1"; then
    check_uses node5 "$A1" published "$A1_DIGEST"
    run_ok node5 "$A1"
fi
node_down
unset DOCKER_CONFIG

e2e_summary
