#!/usr/bin/env bash
# tests/e2e/registry_refs.sh — `ferry index`, `inspect`, `cat` and `convert` take a
# registry reference as they take an OCI layout, against ferry's registry (referrers
# API) and Debian's docker-registry (distribution 2.8: no referrers API, the OCI 1.1
# `sha256-<hex>` tag fallback).
#
#   bash tests/e2e/registry_refs.sh
#
# Setup: the small image (bench/make-image.sh --small), unindexed, pushed with skopeo to
# each registry as e2e/small:v1; the same image indexed in a layout (`ferry index
# --min-layer-size 0 --span 65536 oci:…`) as the reference for inspect; the image
# extracted normally (tar) as the reference for file bytes.
# Per registry:
# 1. `ferry index --min-layer-size 0 --span 65536 REG/e2e/small:v1`: exit 0, the tag's
#    manifest digest is unchanged, and the index artifact is listed for it — by the
#    referrers API on ferry's registry, by the tag fallback on docker-registry — with the
#    same digest as the artifact `ferry index` wrote into the layout (deterministic).
# 2. `ferry inspect --json REG/e2e/small:v1` lists exactly what it lists for the indexed
#    layout (every layer gzip+ferry-index, same entries, same manifest).
# 3. `ferry cat` of several files gives the extracted image's bytes, and the layer blobs
#    were read with Range requests only: ferry's registry counts 206 answers and no
#    whole-blob 200 beyond the index blobs (its /metrics); docker-registry's access log
#    has only 206 for the layer blobs during the reads.
# 4. `ferry convert --estargz REG/e2e/small:v1 REG/e2e/small:esgz` (registry to
#    registry): the converted image has eStargz layers (`ferry inspect`), and `ferry cat`
#    reads the same bytes from it.
# 5. A registry reference to a missing tag fails with "not found".
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), OUT,
#      FERRY_TIMEOUT (seconds per ferry call, 120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_cmd docker-registry skopeo jq curl cmp tar gzip sha256sum timeout

FT=${FERRY_TIMEOUT:-120}
find_ferry
e2e_init
small_image
require_ferry index

# The reference: the image indexed in a layout, and extracted normally.
LAY=$E2E_TMP/layout
indexed_small "$LAY"
REF=$E2E_TMP/ref
oci_extract "$LAY" small "$REF"
# a few regular files of the image, the largest first (busybox: spans of several layers'
# worth of a read), and a small one
FILES=$(cd "$REF" && find . -type f -size +0 -printf '%s %P\n' | sort -rn | awk 'NR <= 3 || NR % 97 == 0 {print $2}' | head -6)
LAYOUT_ART=$(jq -r '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] | startswith("sha256-")) | .digest' "$LAY/index.json" | head -1)
LAYOUT_ART=$(jq -r '.manifests[0].digest' "$LAY/blobs/sha256/${LAYOUT_ART#sha256:}")
fy "$E2E_TMP/inspect-layout.json" "$E2E_TMP/inspect-layout.err" inspect --json "oci:$LAY:small"
[[ $RC == 0 ]] || { show "$E2E_TMP/inspect-layout.err"; e2e_die "ferry inspect of the layout failed"; }

# metric NAME STATUS: ferry registry's blob_pull request count with that status
metric() {
    curl -fsS --noproxy '*' "http://$REG_ADDR/metrics" |
        awk -v s="$1" '$1 == "ferry_registry_requests_total{route=\"blob_pull\",status=\"" s "\"}" {print $2}' |
        awk '{n += $1} END {print n + 0}'
}
manifest_sha() {
    skopeo_ inspect --raw --tls-verify=false "docker://$1" 2>/dev/null | sha256sum | cut -d' ' -f1
}

# run_registry KIND: the checks on the registry at $REG_ADDR (KIND ferry|docker)
run_registry() {
    local kind=$1 E2E_LABEL=$1 image=$REG_ADDR/e2e/small:v1 md after art f ok
    echo "# $kind registry at $REG_ADDR"
    skopeo_ copy -q --dest-tls-verify=false "oci:$SMALL:small" "docker://$image" 2>"$E2E_TMP/$kind-push.err" ||
        { show "$E2E_TMP/$kind-push.err"; fail "skopeo push to $image"; return; }
    md=sha256:$(manifest_sha "$image")

    # 1. index
    fy "$E2E_TMP/$kind-index.out" "$E2E_TMP/$kind-index.err" index --min-layer-size 0 --span 65536 "$image"
    if [[ $RC == 0 ]] && grep -q 'pushed to' "$E2E_TMP/$kind-index.out"; then
        pass "ferry index $image pushed an index artifact"
    else
        fail "ferry index $image: exit $RC"; show "$E2E_TMP/$kind-index.err"; show "$E2E_TMP/$kind-index.out"
    fi
    after=sha256:$(manifest_sha "$image")
    if [[ $after == "$md" ]]; then pass "the image's manifest digest is unchanged ($md)"; else
        fail "manifest digest changed: $md -> $after"; fi
    if [[ $kind == ferry ]]; then
        curl -fsS --noproxy '*' "http://$REG_ADDR/v2/e2e/small/referrers/$md" >"$E2E_TMP/$kind-refs.json" 2>/dev/null || true
        how="referrers API"
    else
        curl -fsS --noproxy '*' -H 'Accept: application/vnd.oci.image.index.v1+json' \
            "http://$REG_ADDR/v2/e2e/small/manifests/sha256-${md#sha256:}" >"$E2E_TMP/$kind-refs.json" 2>/dev/null || true
        how="tag fallback sha256-${md#sha256:}"
    fi
    art=$(jq -r '.manifests[]? | select(.artifactType == "application/vnd.ferry.index.v1") | .digest' "$E2E_TMP/$kind-refs.json" 2>/dev/null | head -1)
    if [[ -n $art && $art == "$LAYOUT_ART" ]]; then
        pass "the $how lists the index artifact $art, the same bytes as the layout's"
    else
        fail "the $how lists '$art' (the layout's artifact: $LAYOUT_ART)"; show "$E2E_TMP/$kind-refs.json"
    fi

    # 2. inspect
    fy "$E2E_TMP/$kind-inspect.json" "$E2E_TMP/$kind-inspect.err" inspect --json "$image"
    if [[ $RC == 0 ]] && cmp -s <(jq -S . "$E2E_TMP/inspect-layout.json") <(jq -S . "$E2E_TMP/$kind-inspect.json"); then
        pass "ferry inspect $image lists what it lists for the indexed layout ($(jq -r '[.layers[].format] | join(",")' "$E2E_TMP/$kind-inspect.json"))"
    else
        fail "ferry inspect $image: exit $RC or differs from the layout's"
        show "$E2E_TMP/$kind-inspect.err"
        diff <(jq -S . "$E2E_TMP/inspect-layout.json") <(jq -S . "$E2E_TMP/$kind-inspect.json") | show /dev/stdin 20
    fi

    # 3. cat, by Range requests
    local ok200 ok206 n200 n206 loglines nidx
    if [[ $kind == ferry ]]; then
        ok200=$(metric 200)
        ok206=$(metric 206)
    else
        loglines=$(wc -l <"$REG_LOG")
    fi
    ok=1
    for f in $FILES; do
        fy "$E2E_TMP/$kind-cat" "$E2E_TMP/$kind-cat.err" cat "$image" "/$f"
        if [[ $RC != 0 ]] || ! cmp -s "$E2E_TMP/$kind-cat" "$REF/$f"; then
            ok=0
            fail "ferry cat $image /$f: exit $RC or other bytes than the extracted image's"
            show "$E2E_TMP/$kind-cat.err"
        fi
    done
    [[ $ok == 1 ]] && pass "ferry cat $image gives the extracted image's bytes ($(echo "$FILES" | wc -w) files)"
    nidx=$(jq '[.layers[] | select(.format | test("ferry-index"))] | length' "$E2E_TMP/$kind-inspect.json")
    if [[ $kind == ferry ]]; then
        n200=$(($(metric 200) - ok200))
        n206=$(($(metric 206) - ok206))
        # each cat fetches the index blobs whole (one per indexed layer); layer bytes by Range
        if ((n206 > 0 && n200 <= nidx * $(echo "$FILES" | wc -w))); then
            pass "the reads were Range requests: $n206 answered 206; $n200 whole-blob GETs (index blobs only)"
        else
            fail "Range reads: $n206 answered 206, $n200 whole-blob GETs (at most $((nidx * $(echo "$FILES" | wc -w))) index blobs expected)"
        fi
    else
        local layers
        layers=$(jq -r '.layers[].digest' "$LAY/blobs/sha256/${md#sha256:}" | paste -sd'|')
        tail -n +"$((loglines + 1))" "$REG_LOG" | grep -E '"GET /v2/e2e/small/blobs/' | grep -E "$layers" |
            sed -E 's/.*HTTP\/[0-9.]+" ([0-9]+) .*/\1/' | sort | uniq -c >"$E2E_TMP/$kind-statuses" || true
        if grep -qw 206 "$E2E_TMP/$kind-statuses" && ! grep -vqw 206 "$E2E_TMP/$kind-statuses"; then
            pass "docker-registry answered every layer read with 206 ($(awk '{print $1}' "$E2E_TMP/$kind-statuses") requests)"
        else
            fail "docker-registry's answers to layer reads: $(tr '\n' ' ' <"$E2E_TMP/$kind-statuses")"
            tail -n +"$((loglines + 1))" "$REG_LOG" | grep blobs | show /dev/stdin 10
        fi
    fi

    # 4. convert registry -> registry
    fy "$E2E_TMP/$kind-convert.out" "$E2E_TMP/$kind-convert.err" convert --estargz "$image" "$REG_ADDR/e2e/small:esgz"
    if [[ $RC == 0 ]]; then pass "ferry convert --estargz $image $REG_ADDR/e2e/small:esgz"; else
        fail "ferry convert registry -> registry: exit $RC"; show "$E2E_TMP/$kind-convert.err"; fi
    fy "$E2E_TMP/$kind-esgz.json" "$E2E_TMP/$kind-esgz.err" inspect --json "$REG_ADDR/e2e/small:esgz"
    if [[ $RC == 0 ]] && jq -e '[.layers[].format] | all(. == "estargz")' "$E2E_TMP/$kind-esgz.json" >/dev/null; then
        pass "the converted image's layers are eStargz"
    else
        fail "inspect of the converted image: exit $RC"; show "$E2E_TMP/$kind-esgz.err"; show "$E2E_TMP/$kind-esgz.json"
    fi
    ok=1
    for f in $FILES; do
        fy "$E2E_TMP/$kind-cat" "$E2E_TMP/$kind-cat.err" cat "$REG_ADDR/e2e/small:esgz" "/$f"
        if [[ $RC != 0 ]] || ! cmp -s "$E2E_TMP/$kind-cat" "$REF/$f"; then
            ok=0
            fail "ferry cat of the converted image /$f: exit $RC or other bytes"; show "$E2E_TMP/$kind-cat.err"
        fi
    done
    [[ $ok == 1 ]] && pass "the converted image reads the extracted image's bytes"

    # 5. errors
    fy "$E2E_TMP/$kind-e1.out" "$E2E_TMP/$kind-e1.err" cat "$REG_ADDR/e2e/small:absent" /etc/passwd
    if [[ $RC != 0 ]] && grep -qi 'not found' "$E2E_TMP/$kind-e1.err"; then pass "a missing tag: not found"; else
        fail "a missing tag: exit $RC"; show "$E2E_TMP/$kind-e1.err"; fi
}

: >"$E2E_TMP/reg.toml"
if start_ferry_registry reg "$E2E_TMP/reg.toml"; then
    run_registry ferry
else
    fail "ferry registry did not start"
fi
if REG_ACCESSLOG_OFF=false start_docker_registry dreg; then
    run_registry docker
else
    fail "docker-registry did not start"
fi

e2e_summary
