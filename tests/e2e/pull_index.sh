#!/usr/bin/env bash
# tests/e2e/pull_index.sh — `ferry pull` of a multi-platform image into a real containerd
# with `ferry snapshotter` (needs root): the image record's target is the index, as with
# `ctr image pull`, the index carries containerd's GC child labels, and the streamed
# download-and-unpack stays within its memory budget.
#
#   bash tests/e2e/pull_index.sh
#
# 1. A multi-platform layout built from the small image (bench/make-image.sh --small):
#    an OCI index listing another platform FIRST and this machine's second, pushed with
#    `skopeo copy --all` to a private docker-registry under two tags.
# 2. `ferry pull` (tiny pieces and buffer: --chunk-size 64K --max-buffer 256K) succeeds;
#    the reported peak buffer is within 256 KiB; `ctr image ls` shows the index digest
#    and media type; the index content has `containerd.io/gc.ref.content.m.0/1` naming
#    both manifests in index order; `ctr run --snapshotter ferry` prints the output.
# 3. A synchronous containerd GC (deleting a lease with --sync) keeps the index, this
#    platform's manifest and config, and the layers' snapshots.
# 4. `ctr image pull` of the other tag records the same target digest, media type and
#    platforms as ferry's record.
# 5. After `ctr image rm --sync` of both records, GC removes the index and manifest
#    (so step 3 passed because of the references, not because GC did nothing).
# 5b. `ferry inspect`, `ferry index` and `ferry mount` with --platform use the other
#    platform's manifest (and one the index lacks is refused, naming what it has).
# 6. With one byte of the largest layer flipped in the registry's storage, `ferry pull`
#    fails naming that layer, and leaves no image record, lease or staging file.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), E2E_KEEP=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "private containerd"
need_cmd containerd ctr runc docker-registry skopeo jq curl timeout sha256sum
find_ferry
e2e_init

small_image
if [[ ! -x $FERRY ]] || ! "$FERRY" pull --help 2>/dev/null | grep -- --max-buffer >/dev/null; then
    fail "no ferry binary with pull --max-buffer: $FERRY (cargo build --release -p ferry)"
    e2e_summary || exit 1
fi

case $(uname -m) in
x86_64) HOST_ARCH=amd64 OTHER_ARCH=arm64 ;;
aarch64) HOST_ARCH=arm64 OTHER_ARCH=amd64 ;;
*) skip "no OCI architecture name for $(uname -m)" ;;
esac

# ---------------------------------------------------------------- 1. the layout
MULTI=$E2E_TMP/multi
cp -r "$SMALL" "$MULTI"
blob() { cat "$MULTI/blobs/sha256/${1#sha256:}"; }
# put_blob FILE -> prints sha256:<hex> after storing FILE as a blob
put_blob() {
    local hex
    hex=$(sha256sum "$1" | cut -d' ' -f1)
    cp "$1" "$MULTI/blobs/sha256/$hex"
    echo "sha256:$hex"
}
HOST_MANIFEST=$(jq -r '.manifests[0].digest' "$SMALL/index.json")
HOST_MANIFEST_SIZE=$(jq -r '.manifests[0].size' "$SMALL/index.json")
HOST_CONFIG=$(blob "$HOST_MANIFEST" | jq -r .config.digest)
blob "$HOST_CONFIG" | jq -c --arg a "$OTHER_ARCH" '.architecture = $a' >"$E2E_TMP/other-config.json"
OTHER_CONFIG=$(put_blob "$E2E_TMP/other-config.json")
blob "$HOST_MANIFEST" | jq -c --arg d "$OTHER_CONFIG" --argjson s "$(stat -c %s "$E2E_TMP/other-config.json")" \
    '.config.digest = $d | .config.size = $s' >"$E2E_TMP/other-manifest.json"
OTHER_MANIFEST=$(put_blob "$E2E_TMP/other-manifest.json")
OTHER_MANIFEST_SIZE=$(stat -c %s "$E2E_TMP/other-manifest.json")
jq -n -c --arg od "$OTHER_MANIFEST" --argjson os "$OTHER_MANIFEST_SIZE" --arg oa "$OTHER_ARCH" \
    --arg hd "$HOST_MANIFEST" --argjson hs "$HOST_MANIFEST_SIZE" --arg ha "$HOST_ARCH" \
    '{schemaVersion: 2, mediaType: "application/vnd.oci.image.index.v1+json", manifests: [
        {mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $od, size: $os,
         platform: {os: "linux", architecture: $oa}},
        {mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $hd, size: $hs,
         platform: {os: "linux", architecture: $ha}}]}' >"$E2E_TMP/index.json"
INDEX=$(put_blob "$E2E_TMP/index.json")
INDEX_SIZE=$(stat -c %s "$E2E_TMP/index.json")
jq -n --arg d "$INDEX" --argjson s "$INDEX_SIZE" \
    '{schemaVersion: 2, manifests: [{mediaType: "application/vnd.oci.image.index.v1+json",
      digest: $d, size: $s, annotations: {"org.opencontainers.image.ref.name": "multi"}}]}' \
    >"$MULTI/index.json"
e2e_log "index $INDEX: $OTHER_ARCH $OTHER_MANIFEST, $HOST_ARCH $HOST_MANIFEST"

start_ferry_snapshotter

start_registry
start_containerd_with_snapshotter ferry "$SNAP_SOCK"
for tag in v1 ctr; do
    skopeo_ copy -q --all --dest-tls-verify=false "oci:$MULTI:multi" "docker://$REGISTRY/app/multi:$tag" ||
        e2e_die "skopeo copy --all failed"
done
REF=$REGISTRY/app/multi:v1
CTR_REF=$REGISTRY/app/multi:ctr
SERVED=$(curl -fsS --noproxy '*' -o /dev/null -D - -H 'Accept: application/vnd.oci.image.index.v1+json' \
    "http://$REGISTRY/v2/app/multi/manifests/v1" | tr -d '\r' | awk -F': ' 'tolower($1) == "docker-content-digest" {print $2}')
if [[ $SERVED == "$INDEX" ]]; then
    pass "registry serves the index unchanged ($INDEX)"
else
    fail "registry serves $SERVED for the tag, not the index $INDEX"
fi

# image_field NAME COLUMN: a column of `ctr image ls` for image NAME (3 = digest, 2 = type)
image_field() { ctr_ image ls | awk -v r="$1" -v c="$2" '$1 == r {print $c}'; }
# content_labels DIGEST: the labels column of `ctr content ls` for DIGEST
content_labels() { ctr_ content ls | awk -v d="$1" '$1 == d {print $NF}'; }
has_content() { ctr_ content ls -q | grep -xF "$1" >/dev/null; }

# ---------------------------------------------------------------- 2. ferry pull
# A platform the index does not have is refused before anything is written, and the
# error names the platforms it has (ferry-oci's one chooser; never "the first manifest").
set +e
MISSING_OUT=$(timeout 120 "$FERRY" pull --address "$CONTAINERD_SOCK" --namespace "$CTR_NAMESPACE" \
    --snapshotter ferry --snapshotter-root "$SNAP_ROOT" --plain-http --platform linux/s390x "$REF" 2>&1)
MISSING_RC=$?
set -e
if [[ $MISSING_RC != 0 && $MISSING_OUT == *"no manifest for linux/s390x in the index; it has linux/$OTHER_ARCH"*"linux/$HOST_ARCH"* ]]; then
    pass "ferry pull --platform linux/s390x is refused, naming the index's platforms"
else
    fail "ferry pull --platform linux/s390x: exit $MISSING_RC"; sed 's/^/    | /' <<<"$MISSING_OUT" | tail -6
fi
set +e
PULL_OUT=$(timeout 300 "$FERRY" pull --address "$CONTAINERD_SOCK" --namespace "$CTR_NAMESPACE" \
    --snapshotter ferry --snapshotter-root "$SNAP_ROOT" --plain-http \
    --chunk-size 64K --max-buffer 256K --concurrency 4 --unpack-concurrency 2 "$REF" 2>&1)
PULL_RC=$?
set -e
LAYERS=$(blob "$HOST_MANIFEST" | jq '.layers | length')
if [[ $PULL_RC == 0 && $PULL_OUT == *"$LAYERS layers (0 lazy, $LAYERS unpacked, 0 already present)"* ]]; then
    pass "ferry pull of the multi-platform image: $(tail -1 <<<"$PULL_OUT")"
else
    fail "ferry pull: exit $PULL_RC"; sed 's/^/    | /' <<<"$PULL_OUT" | tail -12
fi
# "at most 192.00 KiB buffered" -> bytes
PEAK=$(grep -o 'at most [0-9.]* [KMG]*i*B buffered' <<<"$PULL_OUT" | awk '
    { v = $3; u = $4; m = 1
      if (u == "KiB") m = 1024; else if (u == "MiB") m = 1048576; else if (u == "GiB") m = 1073741824
      printf "%d\n", v * m }')
if [[ -n $PEAK ]] && ((PEAK > 0 && PEAK <= 262144)); then
    pass "streamed with at most $PEAK bytes buffered (--max-buffer 256K, 64 KiB pieces)"
else
    fail "peak buffer '$PEAK' not within 256 KiB"
fi
if [[ $PULL_OUT == *"index $INDEX"* ]]; then
    pass "ferry pull reports the index as the record's target"
else
    fail "ferry pull did not report the index"; sed 's/^/    | /' <<<"$PULL_OUT" | tail -5
fi
FERRY_DIGEST=$(image_field "$REF" 3)
FERRY_TYPE=$(image_field "$REF" 2)
if [[ $FERRY_DIGEST == "$INDEX" && $FERRY_TYPE == application/vnd.oci.image.index.v1+json ]]; then
    pass "ctr image ls: $REF -> index $INDEX ($FERRY_TYPE)"
else
    fail "ctr image ls: $REF -> '$FERRY_DIGEST' '$FERRY_TYPE', want the index $INDEX"
fi
LABELS=$(content_labels "$INDEX")
if [[ $LABELS == *"containerd.io/gc.ref.content.m.0=$OTHER_MANIFEST"* &&
    $LABELS == *"containerd.io/gc.ref.content.m.1=$HOST_MANIFEST"* ]]; then
    pass "index content labels name both manifests in index order (m.0 $OTHER_ARCH, m.1 $HOST_ARCH)"
else
    fail "index content labels: '$LABELS'"
fi
if [[ $(content_labels "$HOST_MANIFEST") == *"containerd.io/gc.ref.content.config=$HOST_CONFIG"* ]] &&
    ! has_content "$OTHER_MANIFEST"; then
    pass "this platform's manifest (with its config label) is stored; the other platform's is not fetched"
else
    fail "manifest labels '$(content_labels "$HOST_MANIFEST")'; other manifest present: $(has_content "$OTHER_MANIFEST" && echo yes || echo no)"
fi
run_small() {
    set +e
    OUT=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm --snapshotter ferry "$REF" "$1" 2>&1)
    RC=$?
    set -e
}
run_small "multi-$$-1"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "ctr run --snapshotter ferry on the index-targeted record: '$OUT'"
else
    fail "ctr run --snapshotter ferry: exit $RC: $OUT"
fi

# ---------------------------------------------------------------- 3. GC keeps it
gc_now() {
    local lease
    lease=$(ctr_ leases create | awk '{print $1}')
    ctr_ leases rm --sync "$lease" >/dev/null
}
gc_now
SNAPS=$(ctr_ snapshots --snapshotter ferry ls | awk '$NF == "Committed"' | wc -l)
if has_content "$INDEX" && has_content "$HOST_MANIFEST" && has_content "$HOST_CONFIG" && ((SNAPS == LAYERS)); then
    pass "after a synchronous GC: index, manifest, config and $SNAPS committed layers kept"
else
    fail "GC collected something: index $(has_content "$INDEX" && echo kept || echo gone), manifest $(has_content "$HOST_MANIFEST" && echo kept || echo gone), config $(has_content "$HOST_CONFIG" && echo kept || echo gone), $SNAPS committed snapshots"
fi
run_small "multi-$$-2"
if [[ $RC == 0 && $OUT == "ready small" ]]; then
    pass "ctr run after GC: '$OUT'"
else
    fail "ctr run after GC: exit $RC: $OUT"
fi

# ---------------------------------------------------------------- 4. same as ctr pull
ctr_ image pull --plain-http "$CTR_REF" >"$E2E_TMP/ctr-pull.log" 2>&1 ||
    { tail -5 "$E2E_TMP/ctr-pull.log"; e2e_die "ctr image pull failed"; }
CTR_LINE=$(ctr_ image ls | awk -v r="$CTR_REF" '$1 == r {print $2, $3, $(NF-1)}')
FERRY_LINE=$(ctr_ image ls | awk -v r="$REF" '$1 == r {print $2, $3, $(NF-1)}')
if [[ -n $CTR_LINE && $CTR_LINE == "$FERRY_LINE" ]]; then
    pass "ctr image pull and ferry pull record the same type, digest and platforms: $CTR_LINE"
else
    fail "ctr image ls differs: ctr '$CTR_LINE' ferry '$FERRY_LINE'"
fi

# ---------------------------------------------------------------- 5. GC does collect
ctr_ image rm --sync "$REF" "$CTR_REF" >/dev/null
gc_now
if ! has_content "$INDEX" && ! has_content "$HOST_MANIFEST"; then
    pass "with both records removed, GC collects the index and manifest (the references are what kept them)"
else
    fail "GC kept unreferenced content: index $(has_content "$INDEX" && echo kept || echo gone), manifest $(has_content "$HOST_MANIFEST" && echo kept || echo gone)"
fi

# ---------------------------------------------------------------- 5b. --platform elsewhere
# `ferry inspect`, `ferry index` and `ferry mount` take --platform too, chosen by the same
# chooser: the other platform's manifest is the one they read, index and serve.
inspect_manifest() { "$FERRY" inspect --json "$@" "oci:$MULTI:multi" | jq -r .manifest; }
if [[ $(inspect_manifest) == "$HOST_MANIFEST" && $(inspect_manifest --platform "linux/$OTHER_ARCH") == "$OTHER_MANIFEST" ]]; then
    pass "ferry inspect: this platform's manifest by default, --platform linux/$OTHER_ARCH the other's"
else
    fail "ferry inspect --platform: $(inspect_manifest --platform "linux/$OTHER_ARCH" 2>&1 | tail -1)"
fi
set +e
MISSING_OUT=$("$FERRY" index --platform linux/s390x "oci:$MULTI:multi" 2>&1)
MISSING_RC=$?
set -e
if [[ $MISSING_RC != 0 && $MISSING_OUT == *"linux/$OTHER_ARCH"* && $MISSING_OUT == *"linux/$HOST_ARCH"* ]]; then
    pass "ferry index --platform linux/s390x is refused, naming the index's platforms"
else
    fail "ferry index --platform linux/s390x: exit $MISSING_RC"; sed 's/^/    | /' <<<"$MISSING_OUT" | tail -4
fi
fy "$E2E_TMP/pindex.out" "$E2E_TMP/pindex.err" index --min-layer-size 0 --platform "linux/$OTHER_ARCH" "oci:$MULTI:multi"
# the index artifact's subject is the other platform's manifest: only it lists indexed layers
indexed_layers() {
    "$FERRY" inspect --json "$@" "oci:$MULTI:multi" | jq '[.layers[] | select(.format | test("index"))] | length'
}
if [[ $RC == 0 ]] && (($(indexed_layers --platform "linux/$OTHER_ARCH") > 0)) && (($(indexed_layers) == 0)); then
    pass "ferry index --platform linux/$OTHER_ARCH indexes that platform's manifest, not this machine's"
else
    fail "ferry index --platform: exit $RC, indexed layers other $(indexed_layers --platform "linux/$OTHER_ARCH") host $(indexed_layers)"
    show "$E2E_TMP/pindex.err"
fi
PMNT=$E2E_TMP/platform-mnt
mkdir -p "$PMNT"
fy "$E2E_TMP/pmount.out" "$E2E_TMP/pmount.err" mount --socket "$(dirname "$SNAP_SOCK")/daemon.sock" \
    --platform "linux/$OTHER_ARCH" "$REF" "$PMNT"
PMNT_SOURCE=$(awk -v m="$PMNT" '$5 == m { for (i = 7; i <= NF; i++) if ($i == "-") { print $(i + 2); break } }' /proc/self/mountinfo)
if [[ $RC == 0 && $PMNT_SOURCE == "ferry:$OTHER_MANIFEST" && -n $(ls "$PMNT") ]]; then
    pass "ferry mount --platform linux/$OTHER_ARCH serves that platform's manifest ($PMNT_SOURCE)"
else
    fail "ferry mount --platform: exit $RC, mount source '${PMNT_SOURCE:-none}'"; show "$E2E_TMP/pmount.err"
fi
timeout 60 "$FERRY" umount --socket "$(dirname "$SNAP_SOCK")/daemon.sock" "$PMNT" >/dev/null 2>&1 || true

# ---------------------------------------------------------------- 6. a corrupt layer
# Flip one byte in the middle of the largest layer in the registry's own storage: the
# streamed pull must fail naming that layer and leave nothing behind.
BIG=$(blob "$HOST_MANIFEST" | jq -r '.layers | max_by(.size) | .digest')
BIG_HEX=${BIG#sha256:}
BIG_FILE=$REGISTRY_DATA_DIR/docker/registry/v2/blobs/sha256/${BIG_HEX:0:2}/$BIG_HEX/data
if [[ -f $BIG_FILE ]]; then
    AT=$(($(stat -c %s "$BIG_FILE") / 2))
    BYTE=$(od -An -tu1 -j "$AT" -N1 "$BIG_FILE" | tr -d ' ')
    printf '%b' "\\0$(printf '%03o' $(((BYTE + 1) % 256)))" | dd of="$BIG_FILE" bs=1 seek="$AT" conv=notrunc status=none
    set +e
    PULL_OUT=$(timeout 300 "$FERRY" pull --address "$CONTAINERD_SOCK" --namespace "$CTR_NAMESPACE" \
        --snapshotter ferry --snapshotter-root "$SNAP_ROOT" --plain-http --chunk-size 64K "$REF" 2>&1)
    PULL_RC=$?
    set -e
    if [[ $PULL_RC != 0 && $PULL_OUT == *"$BIG"* ]]; then
        pass "corrupt layer refused: $(grep -m1 -o "layer $BIG.*" <<<"$PULL_OUT" | cut -c1-150)"
    else
        fail "corrupt layer: exit $PULL_RC"; sed 's/^/    | /' <<<"$PULL_OUT" | tail -5
    fi
    if ! ctr_ image ls -q | grep -xF "$REF" >/dev/null; then
        pass "no image record after the failed pull"
    else
        fail "the failed pull left an image record"
    fi
else
    fail "no registry blob file at $BIG_FILE"
fi
if [[ -z $(ctr_ leases ls -q 2>/dev/null | grep ferry-pull || true) && -z $(find "$SNAP_ROOT/staging" -mindepth 1) ]]; then
    pass "no ferry-pull lease and no staging leftovers"
else
    fail "leftovers: leases $(ctr_ leases ls -q | tr '\n' ' ') staging $(find "$SNAP_ROOT/staging" -mindepth 1 | head -3 | tr '\n' ' ')"
fi
e2e_summary
