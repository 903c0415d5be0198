#!/usr/bin/env bash
# tests/security/registry_gc_link_cache.sh — issue 11 #6: `ferry registry gc` in its own
# process and the serving process's in-memory link cache must not disagree into a tag
# that points at an image nobody can pull.
#
# The server (memory_cache ttl 60 s, so the cache certainly still holds the link) serves
# a repository with a pushed but unreferenced config and layer; both are read through the
# server (cached as linked). `ferry registry gc --grace 0s` (another process) deletes them.
#  1. a manifest PUT referencing them is refused (MANIFEST_BLOB_UNKNOWN), not 201
#  2. the tag does not exist afterwards (404), so nothing points at missing blobs
#  3. after pushing the blobs again the same manifest is accepted and pulls whole
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need_cmd curl jq python3 sha256sum
find_ferry
e2e_init
cat >"$E2E_TMP/reg.toml" <<'TOML'
[memory_cache]
ttl = "60s"
TOML
start_ferry_registry reg "$E2E_TMP/reg.toml" || { fail "start ferry registry"; e2e_summary; exit 1; }
R=http://$REG_ADDR
echo '{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}' >"$E2E_TMP/config.json"
head -c 4096 /dev/urandom >"$E2E_TMP/layer.bin"
CFG=$(sha_of "$E2E_TMP/config.json")
LAY=$(sha_of "$E2E_TMP/layer.bin")
c1=$(sec_push_blob gc/app "$E2E_TMP/config.json")
c2=$(sec_push_blob gc/app "$E2E_TMP/layer.bin")
http_req HEAD "$R/v2/gc/app/blobs/$CFG"; h1=$HTTP_CODE
http_req HEAD "$R/v2/gc/app/blobs/$LAY"; h2=$HTTP_CODE
[[ $c1$c2$h1$h2 == 201201200200 ]] && pass "setup: config and layer pushed and read (links cached)" || fail "setup: $c1 $c2 $h1 $h2"
if "$FERRY" registry gc --root "$REG_DATA" --grace 0s >"$E2E_TMP/gc.log" 2>&1; then
    pass "ferry registry gc --grace 0s ran ($(tail -1 "$E2E_TMP/gc.log"))"
else
    fail "ferry registry gc: $(tail -3 "$E2E_TMP/gc.log")"
fi
jq -cn --arg c "$CFG" --argjson cs "$(stat -c %s "$E2E_TMP/config.json")" --arg l "$LAY" --argjson ls 4096 '{
  schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
  config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $c, size: $cs},
  layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar", digest: $l, size: $ls}]}' >"$E2E_TMP/manifest.json"
MT=application/vnd.oci.image.manifest.v1+json
http_req PUT "$R/v2/gc/app/manifests/v1" -H "Content-Type: $MT" --data-binary "@$E2E_TMP/manifest.json"
code=$HTTP_CODE err=$(jq -r '.errors[0].code' "$HTTP_BODY" 2>/dev/null || true)
[[ $code =~ ^40[04]$ && $err == MANIFEST_BLOB_UNKNOWN ]] && pass "1. manifest referencing collected blobs -> $code $err" ||
    fail "1. manifest referencing collected blobs -> $code $err (want 400/404 MANIFEST_BLOB_UNKNOWN)"
http_req GET "$R/v2/gc/app/manifests/v1" -H "Accept: $MT"
if [[ $HTTP_CODE == 404 ]]; then
    pass "2. no tag points at the missing blobs (404)"
else
    http_req GET "$R/v2/gc/app/blobs/$LAY"
    fail "2. tag v1 exists; its layer GET -> $HTTP_CODE"
fi
c1=$(sec_push_blob gc/app "$E2E_TMP/config.json")
c2=$(sec_push_blob gc/app "$E2E_TMP/layer.bin")
http_req PUT "$R/v2/gc/app/manifests/v1" -H "Content-Type: $MT" --data-binary "@$E2E_TMP/manifest.json"
m=$HTTP_CODE
http_req GET "$R/v2/gc/app/blobs/$LAY"
if [[ $c1$c2$m == 201201201 && $HTTP_CODE == 200 ]] && cmp -s "$HTTP_BODY" "$E2E_TMP/layer.bin"; then
    pass "3. pushed again: manifest 201, layer pulls whole"
else
    fail "3. re-push $c1 $c2, manifest $m, layer GET $HTTP_CODE"
fi
e2e_summary
