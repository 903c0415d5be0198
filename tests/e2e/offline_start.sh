#!/usr/bin/env bash
# tests/e2e/offline_start.sh — issue 17: an image baked into a seed store starts through
# containerd with its registry stopped (needs root), once with the system's containerd
# (1.6) and once with containerd 2.x (lib.sh per_containerd).
#
#   bash tests/e2e/offline_start.sh          (E2E_CONTAINERD=system or =2: one version only)
#
# 1. Bake: the small image, indexed in 64 KiB spans, on a `ferry registry serve`;
#    `ferry prewarm --full --no-daemon` into a store of its own records the image with
#    its metadata (manifest, config, ferry index artifact and index blobs); `ferry store
#    export` writes format 2 with those blobs under metadata/. The export is made
#    read-only (chmod -R a-w) and its checksum taken.
# 2. The registry process is stopped (its port refuses connections).
# 3. A fresh `ferry daemon` with `[store] seed` = the export, an empty live store and the
#    snapshotter on, and a private containerd with ferry as a proxy snapshotter.
# 4. `ferry pull IMAGE:TAG` resolves the tag from the seed's record (a warning says the
#    registry could not be reached and that tags are mutable), mounts every layer lazily
#    and prints the no-registry-traffic line; `ctr run --snapshotter ferry` prints the
#    image's default output ("ready small").
# 5. `ferry pull IMAGE@DIGEST` is answered from the seed with no registry attempt (no
#    warning), and runs too.
# 6. The live store holds no chunk (every byte came from the seed), the daemon served
#    from the seed (`ferry status`), and the seed directory is unchanged.
#
# Env: FERRY, FERRY_TIMEOUT (120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
per_containerd "$0" "$@"

need_root "private containerd, FUSE mounts"
need_cmd containerd ctr runc jq curl timeout sha256sum
[[ -e /dev/fuse ]] || skip "no /dev/fuse"
FT=${FERRY_TIMEOUT:-120}
find_ferry
e2e_init
small_image
require_ferry pull
require_ferry prewarm

# seed_sum DIR: every path with type, mode, size and mtime, then every file's sha256
seed_sum() {
    (cd "$1" && find . -printf '%p %y %m %s %T@\n' | LC_ALL=C sort &&
        find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
}
run() {
    set +e
    OUT=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run "$@" 2>&1)
    RC=$?
    set -e
}
fpull() {
    set +e
    PULL_OUT=$(timeout 120 "$FERRY" pull --config "$DAEMON_CONFIG" --address "$CONTAINERD_SOCK" \
        --namespace "$CTR_NAMESPACE" --snapshotter ferry --snapshotter-root "$SNAP_ROOT" \
        --plain-http "$@" 2>&1)
    PULL_RC=$?
    set -e
}
showv() { sed 's/^/    | /' <<<"$1" | tail -"${2:-12}"; }

# ---------------------------------------------------------------- 1. bake
echo "# 1. bake: prewarm --full, export"
publish_indexed_small offline/small:v1 # IMG, REG_ADDR, REG_PID, IMAGE
LAYERS=$(jq '.layers | length' <(oci_manifest "$IMG" small))
BAKE=$E2E_TMP/bake
cat >"$E2E_TMP/bake.toml" <<TOML
[store]
path = "$BAKE"
[control]
socket = "$E2E_TMP/run-bake/daemon.sock"
TOML
fy "$E2E_TMP/pw.out" "$E2E_TMP/pw.err" prewarm --config "$E2E_TMP/bake.toml" --no-daemon --full --json "$IMAGE"
RECORD=$(cat "$BAKE"/images/*.json 2>/dev/null || echo '{}')
ROLES=$(jq -r '[.metadata[]?.role] | unique | join(",")' <<<"$RECORD")
if [[ $RC == 0 && $ROLES == *config* && $ROLES == *manifest* && $ROLES == *ferry-index-artifact* && $ROLES == *ferry-layer-index* ]]; then
    pass "prewarm --full recorded the image with its metadata ($ROLES; $(jq '.metadata | length' <<<"$RECORD") blobs)"
else
    fail "prewarm --full: exit $RC, metadata roles '$ROLES'"
    show "$E2E_TMP/pw.err"
fi
SEED=$E2E_TMP/seed
fy "$E2E_TMP/ex.out" "$E2E_TMP/ex.err" store --store "$BAKE" export --json "$SEED"
M=$SEED/ferry-store.json
N_META=$(jq '.metadata | length' "$M" 2>/dev/null || echo 0)
if [[ $RC == 0 && $(jq .format "$M") == 2 ]] && ((N_META > 0)) &&
    [[ $N_META == $(find "$SEED/metadata" -type f | wc -l) ]] &&
    [[ $(jq '.images[0].metadata | length' "$M") == "$(jq '.metadata | length' <<<"$RECORD")" ]]; then
    pass "export (format 2) carries the $N_META metadata blobs and the record listing them"
else
    fail "ferry store export: exit $RC, format $(jq .format "$M" 2>/dev/null), $N_META metadata blobs"
    show "$E2E_TMP/ex.err"
fi
chmod -R a-w "$SEED"
seed_sum "$SEED" >"$E2E_TMP/seed.before"
DIGEST=$(jq -r .manifest_digest <<<"$RECORD")

# ---------------------------------------------------------------- 2. stop the registry
echo "# 2. the registry stopped"
kill "$REG_PID" 2>/dev/null || true
wait "$REG_PID" 2>/dev/null || true
if ! curl -s --noproxy '*' --max-time 2 -o /dev/null "http://$REG_ADDR/v2/"; then
    pass "registry process stopped: http://$REG_ADDR/v2/ does not answer"
else
    fail "the registry at $REG_ADDR still answers"
fi

# ---------------------------------------------------------------- 3. daemon + containerd
echo "# 3. a fresh daemon over the seed, an empty live store, containerd"
snap_paths
DAEMON_CONFIG=$E2E_TMP/daemon.toml
LIVE=$E2E_TMP/live
cat >"$DAEMON_CONFIG" <<EOF
[store]
path = "$LIVE"
seed = "$SEED"

[control]
socket = "$E2E_TMP/run/daemon.sock"

[snapshotter]
enabled = true
socket = "$SNAP_SOCK"
root = "$SNAP_ROOT"
EOF
start_ferry_daemon "$DAEMON_CONFIG"
start_containerd_with_snapshotter ferry "$SNAP_SOCK"

# ---------------------------------------------------------------- 4. pull by tag, run
echo "# 4. ferry pull by tag, registry down; ctr run"
t0=$SECONDS
fpull "$IMAGE"
if [[ $PULL_RC == 0 && $PULL_OUT == *"from the node's seed store: manifest, config, indexes and layers local, no registry traffic"* &&
    $PULL_OUT == *"$LAYERS layers ($LAYERS lazy, 0 unpacked, 0 already present), 0 B downloaded"* ]]; then
    pass "ferry pull $IMAGE with the registry down: no-registry-traffic line, $LAYERS lazy layers ($((SECONDS - t0))s)"
else
    fail "ferry pull $IMAGE with the registry down: exit $PULL_RC"
    showv "$PULL_OUT"
    show "$SNAP_LOG" 20
fi
if [[ $PULL_OUT == *"registry could not be reached"*"tags are mutable"* ]]; then
    pass "the tag's resolution from the seed's record is called out (registry unreachable, tags mutable)"
else
    fail "no warning that the tag was resolved from the store's record"
    showv "$PULL_OUT"
fi
if ((SECONDS - t0 <= 30)); then
    pass "the fallback was quick ($((SECONDS - t0))s)"
else
    fail "ferry pull took $((SECONDS - t0))s to fall back"
fi
run --rm --snapshotter ferry "$IMAGE" "offline-$$"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "ctr run --snapshotter ferry with the registry stopped: '$OUT'"
else
    fail "ctr run --snapshotter ferry with the registry stopped: exit $RC"
    showv "$OUT"
    show "$SNAP_LOG" 20
fi

# ---------------------------------------------------------------- 5. pull by digest, run
echo "# 5. ferry pull by digest: no registry attempt"
BY_DIGEST=${IMAGE%:*}@$DIGEST
fpull "$BY_DIGEST"
if [[ $PULL_RC == 0 && $PULL_OUT == *"no registry traffic"* && $PULL_OUT != *"could not be reached"* ]]; then
    pass "ferry pull $BY_DIGEST: from the seed, no registry attempt"
else
    fail "ferry pull $BY_DIGEST: exit $PULL_RC"
    showv "$PULL_OUT"
fi
run --rm --snapshotter ferry "$BY_DIGEST" "offline-digest-$$"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "ctr run --snapshotter ferry of the digest reference: '$OUT'"
else
    fail "ctr run of $BY_DIGEST: exit $RC"
    showv "$OUT"
fi

# ---------------------------------------------------------------- 6. where bytes came from
echo "# 6. the seed served, the live store fetched nothing, the seed is unchanged"
CHUNKS=$(find "$LIVE/chunks" -type f 2>/dev/null | wc -l)
fy "$E2E_TMP/st.out" "$E2E_TMP/st.err" status --config "$DAEMON_CONFIG" --json
HITS=$(jq '.store.seed.hits // 0' "$E2E_TMP/st.out" 2>/dev/null || echo 0)
if [[ $CHUNKS == 0 ]] && ((HITS > 0)); then
    pass "the live store holds no chunk; the seed served $HITS reads"
else
    fail "live store chunks $CHUNKS, seed hits $HITS"
    show "$E2E_TMP/st.err"
fi
if diff -q <(seed_sum "$SEED") "$E2E_TMP/seed.before" >/dev/null; then
    pass "the seed directory is unchanged"
else
    fail "the seed directory changed"
fi
e2e_summary
