#!/usr/bin/env bash
# tests/e2e/estargz_ctr_remote.sh — ferry reads eStargz produced by Debian's ctr-remote.
#
#   bash tests/e2e/estargz_ctr_remote.sh
#
# 1. build the small test image (bench/make-image.sh --small, cached)
# 2. push it to a private docker-registry on 127.0.0.1 (skopeo)
# 3. pull it into a private containerd with ctr-remote, convert it to eStargz
#    with `ctr-remote image optimize --no-optimize --oci`, push the result with
#    `ctr image push --plain-http`
# 4. copy the eStargz image back into an OCI layout ($OUT/esgz, tag esgz) with
#    skopeo and check every layer carries containerd.io/snapshot/stargz/toc.digest
# 5. for a few paths compare `$FERRY cat oci:$OUT/esgz:esgz PATH | sha256sum`
#    with the file extracted by tar -xzf from the ORIGINAL small image layers;
#    a whited-out path must fail; `ferry cat --stats` must report
#    compressed_bytes_read=N on stderr with 0 < N < total compressed size.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry),
#      OUT (default tests/e2e/out), FERRY_TIMEOUT (seconds per ferry call, 120),
#      E2E_KEEP=1 / E2E_VERBOSE=1 (see lib.sh).
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "private containerd"
need_cmd containerd ctr ctr-remote docker-registry skopeo jq curl tar sha256sum python3 dpkg apt-get

OUT=$(realpath -m "${OUT:-$FERRY_ROOT/tests/e2e/out}")
SMALL=$OUT/small
ESGZ=$OUT/esgz
find_ferry
e2e_init
mkdir -p "$OUT"

# run STEP-NAME CMD...: run a setup step; on failure record FAIL, show its log and stop
step() {
    local name=$1
    shift
    STEP_N=$((${STEP_N:-0} + 1))
    local log=$E2E_TMP/step-$STEP_N.log
    if "$@" >"$log" 2>&1; then
        pass "$name"
    else
        fail "$name (exit $?)"
        sed 's/^/    | /' "$log" | tail -30 || true
        e2e_summary || true
        exit 1
    fi
}

# ---------------------------------------------------------------- setup
step "build small image" env SMALL_OUT="$SMALL" "$FERRY_ROOT/bench/make-image.sh" --small
start_containerd
start_registry

SRC=$REGISTRY/small:latest
DST=$REGISTRY/small:esgz
step "skopeo push oci:$SMALL:small -> $SRC" push_oci "$SMALL" small small:latest
step "ctr-remote image pull --plain-http $SRC" ctr_remote image pull --plain-http "$SRC"
step "ctr-remote image optimize --no-optimize --oci" \
    ctr_remote image optimize --no-optimize --oci "$SRC" "$DST"
step "ctr image push --plain-http $DST" ctr_ image push --plain-http "$DST"
rm -rf "$ESGZ"
step "skopeo copy docker://$DST -> oci:$ESGZ:esgz" pull_oci small:esgz "$ESGZ" esgz

# ---------------------------------------------------------------- eStargz checks
manifest=$(oci_manifest "$ESGZ" esgz)
nlayers=$(jq '.layers | length' <<<"$manifest")
ntoc=$(jq '[.layers[] | select(.annotations["containerd.io/snapshot/stargz/toc.digest"] // "" | startswith("sha256:"))] | length' <<<"$manifest")
norig=$(oci_manifest "$SMALL" small | jq '.layers | length')
if [[ $nlayers == "$norig" && $ntoc == "$nlayers" && $nlayers -gt 0 ]]; then
    pass "all $nlayers eStargz layers carry containerd.io/snapshot/stargz/toc.digest"
else
    fail "toc.digest annotations: $ntoc of $nlayers layers (original image has $norig)"
fi
bad_mt=$(jq -r '[.layers[].mediaType | select(. != "application/vnd.oci.image.layer.v1.tar+gzip")] | length' <<<"$manifest")
if [[ $bad_mt == 0 ]]; then
    pass "eStargz layers are application/vnd.oci.image.layer.v1.tar+gzip"
else
    fail "unexpected layer media types: $(jq -c '[.layers[].mediaType]' <<<"$manifest")"
fi
# the converted blobs must still be plain gzip tar streams containing the
# stargz TOC entry (stargz.index.json)
toc_ok=1
for d in $(jq -r '.layers[].digest' <<<"$manifest"); do
    tar -tzf "$ESGZ/blobs/sha256/${d#sha256:}" 2>/dev/null | grep -x 'stargz.index.json' >/dev/null || toc_ok=0
done
if [[ $toc_ok == 1 ]]; then
    pass "every eStargz blob is a valid tar.gz ending with stargz.index.json"
else
    fail "some eStargz blob is not a tar.gz with stargz.index.json"
fi
esgz_total=$(jq '[.layers[].size] | add' <<<"$manifest")

# ---------------------------------------------------------------- reference tree
REF=$E2E_TMP/reference
oci_extract "$SMALL" small "$REF"

# ---------------------------------------------------------------- ferry cat
IMAGE=oci:$ESGZ:esgz
PATHS=(/etc/motd /app/hello.txt /bin/busybox /data/sub/dir/numbers.txt /data/overwritten.txt)
FT=${FERRY_TIMEOUT:-120}

if [[ ! -x $FERRY ]]; then
    fail "ferry binary not found or not executable: $FERRY (set FERRY= or cargo build)"
else
    e2e_log "ferry: $FERRY, image $IMAGE"
    for p in "${PATHS[@]}"; do
        want=$(sha256sum <"$REF$p" | cut -d' ' -f1)
        set +e
        timeout "$FT" "$FERRY" cat "$IMAGE" "$p" >"$E2E_TMP/cat.out" 2>"$E2E_TMP/cat.err"
        rc=$?
        set -e
        got=$(sha256sum <"$E2E_TMP/cat.out" | cut -d' ' -f1)
        if [[ $rc == 0 && $got == "$want" ]]; then
            pass "ferry cat $p ($(stat -c %s "$E2E_TMP/cat.out") bytes, sha256 $got)"
        else
            fail "ferry cat $p: exit $rc, sha256 $got, want $want ($(stat -c %s "$REF$p") bytes)"
            sed 's/^/    | /' "$E2E_TMP/cat.err" | tail -10
        fi
    done

    # a file deleted by an upper-layer whiteout must not be readable
    p=/tmp/remove-me.txt
    [[ ! -e $REF$p ]] || e2e_die "reference tree still has whited-out $p (oci_extract bug)"
    set +e
    timeout "$FT" "$FERRY" cat "$IMAGE" "$p" >"$E2E_TMP/cat.out" 2>"$E2E_TMP/cat.err"
    rc=$?
    set -e
    if [[ $rc != 0 && $rc != 124 ]]; then
        pass "ferry cat $p (whited out in layer 2) fails (exit $rc)"
    else
        fail "ferry cat $p (whited out in layer 2): exit $rc, printed $(stat -c %s "$E2E_TMP/cat.out") bytes"
    fi

    # --stats: compressed_bytes_read=N on stderr, stdout unchanged, lazy (< whole image)
    p=/etc/motd
    want=$(sha256sum <"$REF$p" | cut -d' ' -f1)
    set +e
    timeout "$FT" "$FERRY" cat --stats "$IMAGE" "$p" >"$E2E_TMP/cat.out" 2>"$E2E_TMP/cat.err"
    rc=$?
    set -e
    got=$(sha256sum <"$E2E_TMP/cat.out" | cut -d' ' -f1)
    n=$(sed -n 's/.*compressed_bytes_read=\([0-9][0-9]*\).*/\1/p' "$E2E_TMP/cat.err" | tail -1)
    if [[ $rc == 0 && $got == "$want" && -n $n ]] && ((n > 0 && n < esgz_total)); then
        pass "ferry cat --stats $p: compressed_bytes_read=$n of $esgz_total compressed bytes"
    else
        fail "ferry cat --stats $p: exit $rc, sha256 ok=$([[ $got == "$want" ]] && echo yes || echo no), compressed_bytes_read='${n}' (image has $esgz_total compressed bytes)"
        sed 's/^/    | /' "$E2E_TMP/cat.err" | tail -10
    fi
fi

e2e_summary
