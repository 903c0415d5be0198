#!/usr/bin/env bash
# tests/security/registry_blob_leak.sh — issue 11 #1: a push right anywhere must not read
# a blob of another repository by naming its digest.
#
# Token auth; alice may push and pull alice/**, bob bob/**. Bob pushes a secret blob.
# Alice then tries to link it into her repository without its bytes:
#  1. monolithic POST ?digest=<bob's> with an empty body, chunked (no Content-Length to
#     compare against) and with Content-Length: 0 -> refused (400)
#  2. the same with a wrong body (any bytes, chunked) -> 400 DIGEST_INVALID
#  3. POST session + PUT ?digest=<bob's> with no bytes -> 400 DIGEST_INVALID
#  4. mount ?mount=<bob's>&from=bob/secret (no pull right there) -> 202 session, no link
#  after each, GET and HEAD /v2/alice/x/blobs/<bob's> -> 404 (never bob's bytes)
#  5. what stays allowed: alice's body-less re-push of a blob alice/x already links -> 201;
#     the empty blob with its (empty) body -> 201; bob's real push of the same bytes -> 201
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need_cmd curl jq python3 sha256sum base64
find_ferry
e2e_init

make_htpasswd "$E2E_TMP/htpasswd" alice alice-pw bob bob-pw
cat >"$E2E_TMP/reg.toml" <<TOML
[auth]
htpasswd = "$E2E_TMP/htpasswd"
secret = "security-test-secret-not-for-production"
[[auth.rules]]
repository = "alice/**"
users = ["alice"]
actions = ["pull", "push"]
[[auth.rules]]
repository = "bob/**"
users = ["bob"]
actions = ["pull", "push"]
TOML
start_ferry_registry reg "$E2E_TMP/reg.toml" || { fail "start ferry registry"; e2e_summary; exit 1; }
R=http://$REG_ADDR

head -c 100000 /dev/urandom >"$E2E_TMP/secret.bin"
SECRET=$(sha_of "$E2E_TMP/secret.bin")
BOB=$(sec_token bob bob-pw "repository:bob/secret:push,pull")
ALICE=$(sec_token alice alice-pw "repository:alice/x:push,pull" "repository:bob/secret:pull")
code=$(sec_push_blob bob/secret "$E2E_TMP/secret.bin" -H "Authorization: Bearer $BOB")
[[ $code == 201 ]] && pass "setup: bob pushed his secret blob (201)" || fail "setup: bob's push -> $code"

not_readable() {  # LABEL: alice cannot read bob's blob through alice/x
    local g h
    http_req GET "$R/v2/alice/x/blobs/$SECRET" -H "Authorization: Bearer $ALICE"
    g=$HTTP_CODE
    if [[ $g == 200 ]] && cmp -s "$HTTP_BODY" "$E2E_TMP/secret.bin"; then g="200 WITH BOB'S BYTES"; fi
    http_req HEAD "$R/v2/alice/x/blobs/$SECRET" -H "Authorization: Bearer $ALICE"
    h=$HTTP_CODE
    if [[ $g == 404 && $h == 404 ]]; then
        pass "$1: bob's blob not readable through alice/x (GET/HEAD 404)"
    else
        fail "$1: GET alice/x/blobs/<bob's> -> $g, HEAD -> $h (want 404)"
    fi
}

http_req POST "$R/v2/alice/x/blobs/uploads/?digest=$SECRET" -H "Authorization: Bearer $ALICE" \
    -H 'Transfer-Encoding: chunked' -H 'Content-Type: application/octet-stream' --data-binary ''
[[ $HTTP_CODE == 400 ]] && pass "1. empty chunked monolithic push of bob's digest -> 400 $(jq -r '.errors[0].code' "$HTTP_BODY" 2>/dev/null)" ||
    fail "1. empty chunked monolithic push of bob's digest -> $HTTP_CODE (want 400 DIGEST_INVALID)"
not_readable "1 (chunked)"
http_req POST "$R/v2/alice/x/blobs/uploads/?digest=$SECRET" -H "Authorization: Bearer $ALICE" \
    -H 'Content-Length: 0' -H 'Content-Type: application/octet-stream'
[[ $HTTP_CODE == 400 ]] && pass "1. Content-Length: 0 monolithic push of bob's digest -> 400 $(jq -r '.errors[0].code' "$HTTP_BODY" 2>/dev/null)" ||
    fail "1. Content-Length: 0 monolithic push of bob's digest -> $HTTP_CODE (want 400)"
not_readable "1 (Content-Length: 0)"

echo "not bob's bytes" >"$E2E_TMP/wrong.bin"
http_req POST "$R/v2/alice/x/blobs/uploads/?digest=$SECRET" -H "Authorization: Bearer $ALICE" \
    -H 'Transfer-Encoding: chunked' -H 'Content-Type: application/octet-stream' --data-binary "@$E2E_TMP/wrong.bin"
[[ $HTTP_CODE == 400 ]] && pass "2. monolithic push of bob's digest with other bytes -> 400" ||
    fail "2. monolithic push of bob's digest with other bytes -> $HTTP_CODE (want 400)"
not_readable "2"

http_req POST "$R/v2/alice/x/blobs/uploads/" -H "Authorization: Bearer $ALICE"
loc=$(http_header location)
[[ $loc == http* ]] || loc=$R$loc
sep='?'; [[ $loc == *\?* ]] && sep='&'
http_req PUT "$loc${sep}digest=$SECRET" -H "Authorization: Bearer $ALICE" -H 'Content-Length: 0'
[[ $HTTP_CODE == 400 ]] && pass "3. session + body-less PUT ?digest=<bob's> -> 400" ||
    fail "3. session + body-less PUT ?digest=<bob's> -> $HTTP_CODE (want 400)"
not_readable "3"

http_req POST "$R/v2/alice/x/blobs/uploads/?mount=$SECRET&from=bob/secret" -H "Authorization: Bearer $ALICE"
[[ $HTTP_CODE == 202 ]] && pass "4. mount from bob/secret without pull there -> 202 (a plain session)" ||
    fail "4. mount from bob/secret -> $HTTP_CODE (want 202)"
not_readable "4"

head -c 5000 /dev/urandom >"$E2E_TMP/own.bin"
OWN=$(sha_of "$E2E_TMP/own.bin")
code=$(sec_push_blob alice/x "$E2E_TMP/own.bin" -H "Authorization: Bearer $ALICE")
http_req POST "$R/v2/alice/x/blobs/uploads/?digest=$OWN" -H "Authorization: Bearer $ALICE" -H 'Content-Length: 0'
c2=$HTTP_CODE
: >"$E2E_TMP/empty.bin"
c3=$(sec_push_blob alice/x "$E2E_TMP/empty.bin" -H "Authorization: Bearer $ALICE")
c4=$(sec_push_blob bob/secret "$E2E_TMP/secret.bin" -H "Authorization: Bearer $BOB")
if [[ $code == 201 && $c2 == 201 && $c3 == 201 && $c4 == 201 ]]; then
    pass "5. still allowed: own push 201, body-less re-push of an own linked blob 201, empty blob 201, bob's re-push 201"
else
    fail "5. own push $code, body-less re-push of own blob $c2, empty blob $c3, bob's re-push $c4 (want 201 each)"
fi
e2e_summary
