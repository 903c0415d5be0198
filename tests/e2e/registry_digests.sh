#!/usr/bin/env bash
# tests/e2e/registry_digests.sh — sha512 content and tag parameters against the real
# `ferry registry serve` process, over HTTP with curl (the unit tests of
# crates/registry/src/server/suite_tests.rs cover the whole matrix in process):
#  1. a blob pushed under its sha512 digest (monolithic POST ?digest=) reads back whole and
#     by Range, with Docker-Content-Digest sha512:…; a wrong sha512 is 400 DIGEST_INVALID
#  2. a manifest whose config and layer are sha512 blobs, PUT by its sha512 digest with
#     ?tag=v1&tag=latest: 201, OCI-Tag lists both, both tags resolve to the sha512 digest
#     and list; the manifest's bytes come back as pushed
#  3. after a restart of the registry (same data dir) all of it is still served: the
#     on-disk layout keeps sha512 content
#
# Env: FERRY, E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_cmd jq curl sha512sum head
find_ferry
e2e_init

: >"$E2E_TMP/reg.toml"
start_ferry_registry reg "$E2E_TMP/reg.toml" || { fail "start ferry registry"; e2e_summary || exit 1; }
R=http://$REG_ADDR
REPO=digests/app

sha512_of() { echo "sha512:$(sha512sum "$1" | cut -d' ' -f1)"; }
# code FILE_OUT CURL_ARGS...: the HTTP status of one request (headers in FILE_OUT.h)
code() {
    local out=$1
    shift
    curl -sS --max-time 20 -o "$out" -D "$out.h" -w '%{http_code}' "$@" || echo 000
}
header() { grep -i "^$2:" "$1.h" | cut -d' ' -f2- | tr -d '\r' | paste -sd, -; }

# 1. blobs by sha512
head -c 300000 /dev/urandom >"$E2E_TMP/layer"
echo '{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}' >"$E2E_TMP/config"
LAYER=$(sha512_of "$E2E_TMP/layer")
CONFIG=$(sha512_of "$E2E_TMP/config")
ok=1
for f in layer config; do
    d=$(sha512_of "$E2E_TMP/$f")
    c=$(code "$E2E_TMP/post-$f" -X POST -H 'Content-Type: application/octet-stream' \
        --data-binary "@$E2E_TMP/$f" "$R/v2/$REPO/blobs/uploads/?digest=$d")
    [[ $c == 201 ]] || { ok=0; show "$E2E_TMP/post-$f"; }
done
c=$(code "$E2E_TMP/got" "$R/v2/$REPO/blobs/$LAYER")
if ((ok)) && [[ $c == 200 && $(sha512_of "$E2E_TMP/got") == "$LAYER" && $(header "$E2E_TMP/got" docker-content-digest) == "$LAYER" ]]; then
    pass "1. blobs pushed by sha512 digest; the layer reads back whole with Docker-Content-Digest $(cut -c1-20 <<<"$LAYER")…"
else
    fail "1. sha512 blob push/read: status $c, digest header '$(header "$E2E_TMP/got" docker-content-digest)'"
fi
c=$(code "$E2E_TMP/range" -H 'Range: bytes=1000-1999' "$R/v2/$REPO/blobs/$LAYER")
if [[ $c == 206 ]] && cmp -s "$E2E_TMP/range" <(tail -c +1001 "$E2E_TMP/layer" | head -c 1000); then
    pass "1. Range of a sha512 blob: 206 with the right 1000 bytes"
else
    fail "1. Range of a sha512 blob: status $c"
fi
WRONG="sha512:$(printf '%0128d' 0)"
c=$(code "$E2E_TMP/wrong" -X POST -H 'Content-Type: application/octet-stream' \
    --data-binary "@$E2E_TMP/layer" "$R/v2/$REPO/blobs/uploads/?digest=$WRONG")
if [[ $c == 400 ]] && jq -e '.errors[0].code == "DIGEST_INVALID"' "$E2E_TMP/wrong" >/dev/null; then
    pass "1. a blob whose bytes do not match its sha512 digest: 400 DIGEST_INVALID"
else
    fail "1. wrong sha512 digest: status $c $(head -c 200 "$E2E_TMP/wrong")"
fi

# 2. a manifest by sha512 digest with tag parameters
jq -cn --arg c "$CONFIG" --argjson cs "$(stat -c %s "$E2E_TMP/config")" \
    --arg l "$LAYER" --argjson ls "$(stat -c %s "$E2E_TMP/layer")" '{
    schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
    config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $c, size: $cs},
    layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar+gzip", digest: $l, size: $ls}]}' \
    | tr -d '\n' >"$E2E_TMP/manifest"
M=$(sha512_of "$E2E_TMP/manifest")
c=$(code "$E2E_TMP/put" -X PUT -H 'Content-Type: application/vnd.oci.image.manifest.v1+json' \
    --data-binary "@$E2E_TMP/manifest" "$R/v2/$REPO/manifests/$M?tag=v1&tag=latest")
tags=$(header "$E2E_TMP/put" oci-tag)
if [[ $c == 201 && $(header "$E2E_TMP/put" docker-content-digest) == "$M" && $tags == *v1* && $tags == *latest* ]]; then
    pass "2. manifest PUT by sha512 digest with ?tag=v1&tag=latest: 201, OCI-Tag: $tags"
else
    fail "2. manifest PUT with tag parameters: status $c, OCI-Tag '$tags': $(head -c 300 "$E2E_TMP/put")"
fi

# check_served WHAT: both tags resolve to the sha512 manifest, list, and serve its bytes
check_served() {
    local what=$1 t c bad=""
    for t in v1 latest "$M"; do
        c=$(code "$E2E_TMP/m-$t" -H 'Accept: application/vnd.oci.image.manifest.v1+json' "$R/v2/$REPO/manifests/$t")
        if [[ $c != 200 || $(header "$E2E_TMP/m-$t" docker-content-digest) != "$M" ]] ||
            ! cmp -s "$E2E_TMP/m-$t" "$E2E_TMP/manifest"; then
            bad+=" $t:$c"
        fi
    done
    c=$(code "$E2E_TMP/tags" "$R/v2/$REPO/tags/list")
    if [[ -z $bad && $c == 200 ]] && jq -e '.tags | sort == ["latest", "v1"]' "$E2E_TMP/tags" >/dev/null; then
        pass "$what: v1, latest and the sha512 digest serve the pushed manifest; tags/list has both"
    else
        fail "$what: manifests$bad, tags/list $c $(head -c 200 "$E2E_TMP/tags")"
    fi
}
check_served "2. after the push"

# 3. a restart keeps sha512 content
kill "$REG_PID" 2>/dev/null || true
wait "$REG_PID" 2>/dev/null || true
"$FERRY" registry serve --config "$E2E_TMP/reg.toml" --addr "$REG_ADDR" --root "$REG_DATA" >>"$REG_LOG" 2>&1 &
REG_PID=$!
E2E_PIDS+=("$REG_PID")
_wait_registry_up "ferry registry (restarted)"
check_served "3. after a restart"
c=$(code "$E2E_TMP/got2" "$R/v2/$REPO/blobs/$LAYER")
if [[ $c == 200 && $(sha512_of "$E2E_TMP/got2") == "$LAYER" ]]; then
    pass "3. after a restart: the sha512 layer reads back whole"
else
    fail "3. after a restart: layer status $c"
fi

e2e_summary
