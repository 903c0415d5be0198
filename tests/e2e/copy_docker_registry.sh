#!/usr/bin/env bash
# tests/e2e/copy_docker_registry.sh — `ferry copy` against a real registry (Debian's
# docker-registry, distribution 2.8, which has no referrers API: the OCI 1.1 tag
# fallback is exercised), checked with skopeo.
#
#   bash tests/e2e/copy_docker_registry.sh
#
# 1. setup: copy of the small image (bench/make-image.sh --small), `ferry index
#    --min-layer-size 0` on it, so it has a ferry index artifact referring to it.
# 2. oci -> registry: `ferry copy oci:SRC:small REGISTRY/e2e/small:v1` over plain HTTP
#    found on its own (loopback); skopeo inspect --raw gives the same manifest digest,
#    skopeo inspect reads the config, `skopeo copy` of what ferry pushed verifies every
#    blob; the referrers fallback tag sha256-<hex> lists the index artifact.
# 3. again: nothing copied (every blob already there).
# 4. registry -> registry (another repository): blobs mounted, same digest.
# 5. registry -> oci: same manifest digest, the same blob set as the source layout,
#    every blob hashes to its name, the index artifact is a referrer again, and
#    `ferry cat` of a file reads the same bytes as from the source layout.
# 6. errors: an absent tag fails with "not found"; an unreachable registry fails
#    with a hint; neither leaves a zero exit code.
# 7. auth: a docker-registry with htpasswd (Basic) auth: without credentials the copy
#    fails and says how to log in; with --creds it succeeds (same digest); with a
#    wrong password it fails; credentials from $DOCKER_CONFIG/config.json work too.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry),
#      OUT (default tests/e2e/out; the small image is $OUT/small:small),
#      FERRY_TIMEOUT (seconds per ferry call, 120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_cmd docker-registry skopeo jq curl sha256sum cmp timeout

FT=${FERRY_TIMEOUT:-120}
find_ferry
e2e_init

small_image
require_ferry copy

manifest_digest() {
    jq -r --arg t "$2" '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $t) | .digest' "$1/index.json" | head -1
}
# referrers DIR SUBJECT: digests of ferry index artifacts referring to SUBJECT in a layout
referrers() {
    local d tag=sha256-${2#sha256:}
    d=$(manifest_digest "$1" "$tag")
    [[ -n $d ]] || return 0
    jq -r '.manifests[] | select(.artifactType == "application/vnd.ferry.index.v1") | .digest' \
        "$1/blobs/sha256/${d#sha256:}"
}
# blobs_ok DIR: every blob hashes to its name
blobs_ok() {
    local f bad=0
    for f in "$1"/blobs/sha256/*; do
        [[ $(sha256sum <"$f" | cut -d' ' -f1) == "$(basename "$f")" ]] || { echo "bad blob $f"; bad=1; }
    done
    return $bad
}
# the first regular file of the image's last layer
first_file() {
    local m layer
    m=$(manifest_digest "$1" "$2")
    layer=$(jq -r '.layers[-1].digest' "$1/blobs/sha256/${m#sha256:}")
    tar -tzf "$1/blobs/sha256/${layer#sha256:}" 2>/dev/null | grep -v '/$' | grep -v '^\./\?\.wh\.' | head -1
}

# ---------------------------------------------------------------- 1. setup
echo "# 1. setup: indexed copy of the small image"
SRC=$E2E_TMP/src
cp -a "$SMALL" "$SRC"
fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index --min-layer-size 0 "oci:$SRC:small"
if [[ $RC == 0 ]]; then pass "ferry index on the source"; else fail "ferry index: exit $RC"; show "$E2E_TMP/index.err"; fi
MD=$(manifest_digest "$SRC" small)
ART=$(referrers "$SRC" "$MD")
if [[ -n $MD && -n $ART ]]; then
    pass "source manifest $MD has index artifact $ART"
else
    fail "source has no manifest ($MD) or no index artifact ($ART)"
fi

start_registry
SK=(--tls-verify=false)

# ---------------------------------------------------------------- 2. oci -> registry
echo "# 2. oci -> registry"
fy "$E2E_TMP/c1.out" "$E2E_TMP/c1.err" copy "oci:$SRC:small" "$REGISTRY/e2e/small:v1"
if [[ $RC == 0 ]]; then pass "ferry copy oci -> $REGISTRY/e2e/small:v1"; show "$E2E_TMP/c1.out" 2; else
    fail "ferry copy oci -> registry: exit $RC"; show "$E2E_TMP/c1.err"; fi
if skopeo inspect --raw "${SK[@]}" "docker://$REGISTRY/e2e/small:v1" >"$E2E_TMP/raw.json" 2>"$E2E_TMP/sk.err"; then
    got=sha256:$(sha256sum <"$E2E_TMP/raw.json" | cut -d' ' -f1)
    if [[ $got == "$MD" ]]; then pass "skopeo sees the same manifest ($got)"; else fail "manifest digest $got != $MD"; fi
else
    fail "skopeo inspect --raw failed"; show "$E2E_TMP/sk.err"
fi
if skopeo inspect "${SK[@]}" "docker://$REGISTRY/e2e/small:v1" >"$E2E_TMP/inspect.json" 2>"$E2E_TMP/sk.err" &&
    [[ $(jq -r .Os "$E2E_TMP/inspect.json") == linux ]]; then
    pass "skopeo inspect reads the config (os linux, $(jq '.Layers | length' "$E2E_TMP/inspect.json") layers)"
else
    fail "skopeo inspect of the pushed image failed"; show "$E2E_TMP/sk.err"
fi
if skopeo copy -q "${SK[@]}" "docker://$REGISTRY/e2e/small:v1" "oci:$E2E_TMP/skopeo:v1" 2>"$E2E_TMP/sk.err" &&
    [[ $(manifest_digest "$E2E_TMP/skopeo" v1) == "$MD" ]]; then
    pass "skopeo copy of what ferry pushed verifies every blob"
else
    fail "skopeo copy of what ferry pushed failed"; show "$E2E_TMP/sk.err"
fi
tag=sha256-${MD#sha256:}
if curl -fsS -H 'Accept: application/vnd.oci.image.index.v1+json' \
    "http://$REGISTRY/v2/e2e/small/manifests/$tag" >"$E2E_TMP/refs.json" 2>"$E2E_TMP/curl.err" &&
    jq -e --arg a "$ART" '.manifests[] | select(.digest == $a and .artifactType == "application/vnd.ferry.index.v1")' \
        "$E2E_TMP/refs.json" >/dev/null; then
    pass "referrers fallback tag $tag lists the index artifact"
else
    fail "referrers fallback tag $tag missing or without $ART"; show "$E2E_TMP/refs.json"
fi

# ---------------------------------------------------------------- 3. again
echo "# 3. copy again"
fy "$E2E_TMP/c2.out" "$E2E_TMP/c2.err" copy "oci:$SRC:small" "$REGISTRY/e2e/small:v1"
if [[ $RC == 0 ]] && grep -q ': 0 blobs (0 B) copied' "$E2E_TMP/c2.out"; then
    pass "second copy copies no blob"
else
    fail "second copy: exit $RC"; show "$E2E_TMP/c2.out"; show "$E2E_TMP/c2.err"
fi

# ---------------------------------------------------------------- 4. registry -> registry
echo "# 4. registry -> registry (mount)"
fy "$E2E_TMP/c3.out" "$E2E_TMP/c3.err" copy "$REGISTRY/e2e/small:v1" "$REGISTRY/e2e/other:v2"
if [[ $RC == 0 ]] && grep -Eq '0 blobs \(0 B\) copied, 0 already there, [1-9][0-9]* mounted' "$E2E_TMP/c3.out"; then
    pass "cross-repository copy mounts every blob"
else
    fail "cross-repository copy: exit $RC"; show "$E2E_TMP/c3.out"; show "$E2E_TMP/c3.err"
fi
got=$(skopeo inspect --raw "${SK[@]}" "docker://$REGISTRY/e2e/other:v2" 2>/dev/null | sha256sum | cut -d' ' -f1)
if [[ sha256:$got == "$MD" ]]; then pass "mounted copy has the same digest"; else fail "mounted copy digest sha256:$got != $MD"; fi

# ---------------------------------------------------------------- 5. registry -> oci
echo "# 5. registry -> oci"
BACK=$E2E_TMP/back
fy "$E2E_TMP/c4.out" "$E2E_TMP/c4.err" copy --concurrency 2 --chunk-size 64K "$REGISTRY/e2e/other:v2" "oci:$BACK:v1"
if [[ $RC == 0 ]]; then pass "ferry copy registry -> oci"; else fail "ferry copy registry -> oci: exit $RC"; show "$E2E_TMP/c4.err"; fi
if [[ $(manifest_digest "$BACK" v1) == "$MD" ]]; then pass "round trip keeps the manifest digest"; else
    fail "round trip digest $(manifest_digest "$BACK" v1) != $MD"; fi
if blobs_ok "$BACK" >"$E2E_TMP/blobs.err"; then pass "every blob of the copy hashes to its name"; else
    fail "corrupt blobs"; show "$E2E_TMP/blobs.err"; fi
missing=$(comm -23 <(ls "$SRC/blobs/sha256" | sort) <(ls "$BACK/blobs/sha256" | sort) | tr '\n' ' ')
if [[ -z $missing ]]; then pass "the copy has every blob of the source"; else fail "blobs missing from the copy: $missing"; fi
if [[ $(referrers "$BACK" "$MD") == "$ART" ]]; then pass "index artifact survives the round trip"; else
    fail "index artifact after round trip: '$(referrers "$BACK" "$MD")' != $ART"; fi
f=$(first_file "$SRC" small || true)
if [[ -n $f ]]; then
    fy "$E2E_TMP/cat1" "$E2E_TMP/cat1.err" cat "oci:$SRC:small" "/${f#./}"
    rc1=$RC
    fy "$E2E_TMP/cat2" "$E2E_TMP/cat2.err" cat "oci:$BACK:v1" "/${f#./}"
    if [[ $rc1 == 0 && $RC == 0 ]] && cmp -s "$E2E_TMP/cat1" "$E2E_TMP/cat2"; then
        pass "ferry cat /${f#./} reads the same bytes from the copy"
    else
        fail "ferry cat /${f#./}: rc $rc1/$RC or different bytes"; show "$E2E_TMP/cat2.err"
    fi
fi

# ---------------------------------------------------------------- 6. errors
echo "# 6. errors"
fy "$E2E_TMP/e1.out" "$E2E_TMP/e1.err" copy "$REGISTRY/e2e/small:absent" "oci:$E2E_TMP/none:v1"
if [[ $RC != 0 ]] && grep -qi 'not found' "$E2E_TMP/e1.err"; then pass "absent tag: clear error"; else
    fail "absent tag: exit $RC"; show "$E2E_TMP/e1.err"; fi
dead=$(free_port)
fy "$E2E_TMP/e2.out" "$E2E_TMP/e2.err" copy "127.0.0.1:$dead/e2e/small:v1" "oci:$E2E_TMP/none:v1"
if [[ $RC != 0 ]] && grep -q 'hint:' "$E2E_TMP/e2.err"; then pass "unreachable registry: error with a hint"; else
    fail "unreachable registry: exit $RC"; show "$E2E_TMP/e2.err"; fi

# ---------------------------------------------------------------- 7. auth
echo "# 7. auth (htpasswd Basic)"
if make_htpasswd "$E2E_TMP/htpasswd" alice 's3cret!' 2>"$E2E_TMP/htpasswd.err" &&
    start_docker_registry authreg "$E2E_TMP/htpasswd"; then
    AREG=$REG_ADDR
    fy "$E2E_TMP/a1.out" "$E2E_TMP/a1.err" copy "oci:$SRC:small" "$AREG/e2e/small:v1"
    if [[ $RC != 0 ]] && grep -q -- '--creds' "$E2E_TMP/a1.err"; then pass "no credentials: fails and says how to log in"; else
        fail "no credentials: exit $RC"; show "$E2E_TMP/a1.err"; fi
    fy "$E2E_TMP/a2.out" "$E2E_TMP/a2.err" copy --creds 'alice:wrong' "oci:$SRC:small" "$AREG/e2e/small:v1"
    if [[ $RC != 0 ]] && grep -qi 'unauthorized' "$E2E_TMP/a2.err"; then pass "wrong password: unauthorized"; else
        fail "wrong password: exit $RC"; show "$E2E_TMP/a2.err"; fi
    fy "$E2E_TMP/a3.out" "$E2E_TMP/a3.err" copy --creds 'alice:s3cret!' "oci:$SRC:small" "$AREG/e2e/small:v1"
    got=$(skopeo inspect --raw "${SK[@]}" --creds 'alice:s3cret!' "docker://$AREG/e2e/small:v1" 2>/dev/null | sha256sum | cut -d' ' -f1)
    if [[ $RC == 0 && sha256:$got == "$MD" ]]; then pass "--creds: copy succeeds, same digest"; else
        fail "--creds: exit $RC, digest sha256:$got"; show "$E2E_TMP/a3.err"; fi
    mkdir -p "$E2E_TMP/dockercfg"
    printf '{"auths":{"%s":{"auth":"%s"}}}' "$AREG" "$(printf '%s' 'alice:s3cret!' | base64 -w0)" \
        >"$E2E_TMP/dockercfg/config.json"
    set +e
    DOCKER_CONFIG=$E2E_TMP/dockercfg timeout "$FT" "$FERRY" copy "$AREG/e2e/small:v1" "oci:$E2E_TMP/authback:v1" \
        >"$E2E_TMP/a4.out" 2>"$E2E_TMP/a4.err"
    RC=$?
    set -e
    if [[ $RC == 0 && $(manifest_digest "$E2E_TMP/authback" v1) == "$MD" ]]; then
        pass "credentials from \$DOCKER_CONFIG/config.json"
    else
        fail "docker config credentials: exit $RC"; show "$E2E_TMP/a4.err"
    fi
else
    fail "could not start a docker-registry with htpasswd auth"; show "$E2E_TMP/htpasswd.err"
fi

e2e_summary
