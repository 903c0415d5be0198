#!/usr/bin/env bash
# tests/security/registry_held.sh — the attacks of issue 11 that held on main, kept so
# they keep holding: forged and expired JWTs, scope escalation, path tricks in names,
# request smuggling, oversized bodies, out-of-order chunks, kill -9 during an upload.
#
# Token auth with an inline secret (so this test can sign tokens like the server does);
# alice may push/pull alice/**, nobody else anything. Bob's blob sits in bob/secret.
#  1. JWTs: alg none, HS256 with the wrong key, a valid signature with exp in the past,
#     nbf in the future, another audience, another issuer, a tampered payload, garbage ->
#     401 each; a correctly signed fresh token -> 200 (the forger is right otherwise)
#  2. scope escalation: alice's pull-only token used to push -> 401; alice's token for
#     alice/x used on bob/secret -> 401/403; a token request for bob/secret:pull,push grants
#     alice nothing (empty access), and with it bob's blob -> 401
#  3. names: .., %2e%2e, a/../bob/secret, a//b, uppercase, %2f -> 400 NAME_INVALID or 404;
#     bob's blob never served through them
#  4. smuggling: Content-Length + Transfer-Encoding, two Content-Lengths, an obfuscated
#     Transfer-Encoding -> one answer (an error, or the connection closed), never a second
#     one, and the request hidden in the body is never executed (no tag "smuggled")
#  5. oversized bodies: a 5 MiB manifest -> 413; a PATCH declaring more than max_blob_bytes
#     -> 413 before the body is sent
#  6. out-of-order chunks: a PATCH starting past the end -> 416 with the current Range
#  7. kill -9 during an upload (half a chunked upload sent, and again mid-body of a
#     monolithic PUT): after restart no partial blob is visible, the chunked session
#     continues or is unknown (never corrupt), and the blob pushed again verifies
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need_cmd curl jq python3 sha256sum base64
find_ferry
e2e_init
SECRET=security-test-secret-not-for-production
make_htpasswd "$E2E_TMP/htpasswd" alice alice-pw bob bob-pw
cat >"$E2E_TMP/reg.toml" <<TOML
[auth]
htpasswd = "$E2E_TMP/htpasswd"
secret = "$SECRET"
[[auth.rules]]
repository = "alice/**"
users = ["alice"]
actions = ["pull", "push"]
[[auth.rules]]
repository = "bob/**"
users = ["bob"]
actions = ["pull", "push"]
[limits]
max_blob_bytes = 8388608
TOML
REG_ADDR=127.0.0.1:$(free_port)
start_ferry_registry reg "$E2E_TMP/reg.toml" "$REG_ADDR" || { fail "start ferry registry"; e2e_summary; exit 1; }
ADDR=$REG_ADDR
R=http://$ADDR
head -c 50000 /dev/urandom >"$E2E_TMP/secret.bin"
BOBS=$(sha_of "$E2E_TMP/secret.bin")
code=$(sec_push_blob bob/secret "$E2E_TMP/secret.bin" -u bob:bob-pw)
[[ $code == 201 ]] || fail "setup: bob's push -> $code"

# ---------------------------------------------------------------- 1. JWTs
python3 - "$SECRET" "bob" >"$E2E_TMP/jwts" <<'PY'
import base64, hashlib, hmac, json, sys, time
secret, who = sys.argv[1].encode(), sys.argv[2]
b64 = lambda b: base64.urlsafe_b64encode(b).rstrip(b"=").decode()
now = int(time.time())
def claims(**kw):
    c = {"iss": "ferry-registry", "sub": who, "aud": "ferry-registry", "exp": now + 300,
         "nbf": now - 10, "iat": now - 10, "jti": "x",
         "access": [{"type": "repository", "name": "bob/secret", "actions": ["pull"]}]}
    c.update(kw)
    return c
def sign(c, key=secret, alg="HS256"):
    h = b64(json.dumps({"alg": alg, "typ": "JWT"}).encode())
    p = b64(json.dumps(c).encode())
    if alg == "none":
        return f"{h}.{p}."
    s = hmac.new(key, f"{h}.{p}".encode(), hashlib.sha256).digest()
    return f"{h}.{p}.{b64(s)}"
good = sign(claims())
h, p, s = good.split(".")
tampered = h + "." + b64(json.dumps(claims(access=[{"type": "repository", "name": "bob/secret", "actions": ["pull", "push"]}])).encode()) + "." + s
print("alg-none", sign(claims(), alg="none"))
print("wrong-key", sign(claims(), key=b"not-the-secret"))
print("expired", sign(claims(exp=now - 3600, nbf=now - 7200, iat=now - 7200)))
print("not-yet-valid", sign(claims(nbf=now + 3600, exp=now + 7200)))
print("other-audience", sign(claims(aud="another-registry")))
print("other-issuer", sign(claims(iss="mallory")))
print("tampered", tampered)
print("garbage", "eyJhbGciOi.garbage.x")
print("good", good)
PY
bad=()
while read -r name tok; do
    http_req GET "$R/v2/bob/secret/blobs/$BOBS" -H "Authorization: Bearer $tok"
    if [[ $name == good ]]; then
        [[ $HTTP_CODE == 200 ]] && pass "1. a correctly signed token reads the blob (200): the forgeries differ only in what they break" ||
            fail "1. correctly signed token -> $HTTP_CODE (want 200)"
    elif [[ $HTTP_CODE != 401 ]]; then
        bad+=("$name:$HTTP_CODE")
    fi
done <"$E2E_TMP/jwts"
[[ ${#bad[@]} == 0 ]] && pass "1. forged/expired/foreign tokens (alg none, wrong key, expired, nbf ahead, audience, issuer, tampered, garbage) -> 401" ||
    fail "1. tokens accepted or odd: ${bad[*]}"

# ---------------------------------------------------------------- 2. scope escalation
PULL=$(sec_token alice alice-pw "repository:alice/x:pull")
http_req POST "$R/v2/alice/x/blobs/uploads/" -H "Authorization: Bearer $PULL"
c1=$HTTP_CODE
ALICE=$(sec_token alice alice-pw "repository:alice/x:pull,push")
http_req GET "$R/v2/bob/secret/blobs/$BOBS" -H "Authorization: Bearer $ALICE"
c2=$HTTP_CODE
ESC=$(curl -sS --noproxy '*' -u alice:alice-pw "$R/token?service=ferry-registry&scope=repository:bob/secret:pull,push")
granted=$(jq -r '.token' <<<"$ESC" | cut -d. -f2 | tr '_-' '/+' | base64 -d 2>/dev/null | jq -c '[.access[]?.actions[]?]' 2>/dev/null || echo '?')
http_req GET "$R/v2/bob/secret/blobs/$BOBS" -H "Authorization: Bearer $(jq -r .token <<<"$ESC")"
c3=$HTTP_CODE
[[ $c1 == 401 && $c2 =~ ^40[13]$ && $granted == '[]' && $c3 =~ ^40[13]$ ]] &&
    pass "2. pull token pushes -> $c1; alice/x token on bob/secret -> $c2; asking for bob/secret grants $granted, using it -> $c3" ||
    fail "2. pull token push -> $c1 (401), cross-repo token -> $c2 (401/403), grant $granted ([]), its use -> $c3 (401/403)"

# ---------------------------------------------------------------- 3. names
bad=()
for n in ".." "%2e%2e" "alice/../bob/secret" "alice/%2e%2e/bob/secret" "alice//x" "Alice/x" "alice%2fx" "alice/x/../../bob/secret"; do
    http_req GET "$R/v2/$n/blobs/$BOBS" -u alice:alice-pw
    [[ $HTTP_CODE == 404 || ($HTTP_CODE == 400 && $(jq -r '.errors[0].code' "$HTTP_BODY" 2>/dev/null) == NAME_INVALID) ]] || bad+=("$n:$HTTP_CODE")
done
[[ ${#bad[@]} == 0 ]] && pass "3. path tricks in names -> 400 NAME_INVALID or 404, bob's blob never served" || fail "3. names: ${bad[*]}"

# ---------------------------------------------------------------- 4. smuggling
AUTHB=$(basic alice alice-pw)
python3 - "${ADDR%:*}" "${ADDR##*:}" "$AUTHB" >"$E2E_TMP/smuggle.out" <<'PY'
import socket, sys
host, port, auth = sys.argv[1], int(sys.argv[2]), sys.argv[3]
inner = (f"PUT /v2/alice/x/manifests/smuggled HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth}\r\n"
         "Content-Type: application/vnd.oci.image.manifest.v1+json\r\nContent-Length: 2\r\n\r\n{}")
cases = {
    "cl+te": f"POST /v2/ HTTP/1.1\r\nHost: {host}\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{inner}",
    "cl+cl": f"POST /v2/ HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nContent-Length: {len(inner)}\r\n\r\n{inner}",
    "te-obfuscated": f"POST /v2/ HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: xchunked\r\nContent-Length: {len(inner)}\r\n\r\n{inner}",
}
for name, raw in cases.items():
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(raw.encode())
    data = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            data += b
    except socket.timeout:
        pass
    statuses = [l.split(b" ")[1].decode() for l in data.split(b"\r\n") if l.startswith(b"HTTP/1.1 ")]
    print(name, ",".join(statuses) or "closed")
PY
sed 's/^/    | /' "$E2E_TMP/smuggle.out"
http_req GET "$R/v2/alice/x/manifests/smuggled" -u alice:alice-pw
smug=$HTTP_CODE
ok=1
while read -r name st; do
    [[ $st == closed || $st =~ ^4[0-9][0-9]$ ]] || ok=0
done <"$E2E_TMP/smuggle.out"
[[ $ok == 1 && $smug == 404 ]] && pass "4. smuggling (CL+TE, CL+CL, obfuscated TE): refused, the hidden request never ran (tag 404)" ||
    fail "4. smuggling answers: $(tr '\n' ' ' <"$E2E_TMP/smuggle.out"), hidden tag -> $smug"

# ---------------------------------------------------------------- 5. oversized
python3 -c 'import json; print(json.dumps({"schemaVersion": 2, "pad": "x" * (5 << 20)}))' >"$E2E_TMP/huge.json"
http_req PUT "$R/v2/alice/x/manifests/huge" -u alice:alice-pw -H 'Content-Type: application/vnd.oci.image.manifest.v1+json' --data-binary "@$E2E_TMP/huge.json"
c1=$HTTP_CODE
http_req POST "$R/v2/alice/x/blobs/uploads/" -u alice:alice-pw
LOC=$(http_header location); [[ $LOC == http* ]] || LOC=$R$LOC
t0=$SECONDS
http_req PATCH "$LOC" -u alice:alice-pw -H "Content-Length: $((1 << 30))" -H 'Content-Type: application/octet-stream' --data-binary @/dev/null
c2=$HTTP_CODE
[[ $c1 == 413 && $c2 == 413 ]] && pass "5. 5 MiB manifest -> 413; PATCH declaring 1 GiB (> max_blob_bytes) -> 413 without the body" ||
    fail "5. 5 MiB manifest -> $c1, PATCH declaring 1 GiB -> $c2 (want 413, 413)"

# ---------------------------------------------------------------- 6. out of order
http_req POST "$R/v2/alice/x/blobs/uploads/" -u alice:alice-pw
LOC=$(http_header location); [[ $LOC == http* ]] || LOC=$R$LOC
head -c 1000 /dev/urandom >"$E2E_TMP/chunk"
http_req PATCH "$LOC" -u alice:alice-pw -H 'Content-Range: 0-999' -H 'Content-Type: application/octet-stream' --data-binary "@$E2E_TMP/chunk"
LOC2=$(http_header location); [[ $LOC2 == http* ]] || LOC2=$R$LOC2
http_req PATCH "$LOC2" -u alice:alice-pw -H 'Content-Range: 5000-5999' -H 'Content-Type: application/octet-stream' --data-binary "@$E2E_TMP/chunk"
[[ $HTTP_CODE == 416 && $(http_header range) == 0-999 ]] && pass "6. chunk past the end -> 416, Range 0-999" ||
    fail "6. out-of-order chunk -> $HTTP_CODE Range '$(http_header range)' (want 416, 0-999)"

# ---------------------------------------------------------------- 7. kill -9 mid-upload
head -c $((6 << 20)) /dev/urandom >"$E2E_TMP/big.bin"
BIG=$(sha_of "$E2E_TMP/big.bin")
head -c $((3 << 20)) "$E2E_TMP/big.bin" >"$E2E_TMP/big.first"
tail -c +$(((3 << 20) + 1)) "$E2E_TMP/big.bin" >"$E2E_TMP/big.rest"
http_req POST "$R/v2/alice/x/blobs/uploads/" -u alice:alice-pw
LOC=$(http_header location); [[ $LOC == http* ]] || LOC=$R$LOC
http_req PATCH "$LOC" -u alice:alice-pw -H 'Content-Type: application/octet-stream' --data-binary "@$E2E_TMP/big.first"
LOC=$(http_header location); [[ $LOC == http* ]] || LOC=$R$LOC
# a monolithic PUT cut by the kill mid-body: 2 MiB of a declared 6 MiB sent
python3 - "${ADDR%:*}" "${ADDR##*:}" "$(basic alice alice-pw)" "$BIG" >/dev/null 2>&1 <<'PY' &
import socket, sys, time
host, port, auth, d = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
s = socket.create_connection((host, port))
s.sendall((f"POST /v2/alice/y/blobs/uploads/?digest={d} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth}\r\n"
           f"Content-Type: application/octet-stream\r\nContent-Length: {6 << 20}\r\n\r\n").encode())
s.sendall(open(sys.argv[0] if False else "/dev/urandom", "rb").read(2 << 20))
time.sleep(30)
PY
MONO=$!
sleep 1.5
kill -9 "$REG_PID"
wait "$REG_PID" 2>/dev/null || true
kill "$MONO" 2>/dev/null || true
"$FERRY" registry serve --config "$E2E_TMP/reg.toml" --addr "$ADDR" --root "$REG_DATA" >>"$REG_LOG" 2>&1 &
REG_PID=$!
E2E_PIDS+=("$REG_PID")
_wait_registry_up "ferry registry (after kill -9)" || fail "7. restart after kill -9"
http_req HEAD "$R/v2/alice/y/blobs/$BIG" -u alice:alice-pw
h1=$HTTP_CODE
http_req HEAD "$R/v2/alice/x/blobs/$BIG" -u alice:alice-pw
h2=$HTTP_CODE
http_req PATCH "$LOC" -u alice:alice-pw -H 'Content-Type: application/octet-stream' --data-binary "@$E2E_TMP/big.rest"
pc=$HTTP_CODE
fin=none
if [[ $pc == 202 ]]; then
    LOC=$(http_header location); [[ $LOC == http* ]] || LOC=$R$LOC
    sep='?'; [[ $LOC == *\?* ]] && sep='&'
    http_req PUT "$LOC${sep}digest=$BIG" -u alice:alice-pw -H 'Content-Length: 0'
    fin=$HTTP_CODE
fi
http_req GET "$R/v2/alice/x/blobs/$BIG" -u alice:alice-pw
if [[ $h1 == 404 && $h2 == 404 && ($pc == 202 && $fin == 201 || $pc == 404) ]] &&
    { [[ $HTTP_CODE == 404 ]] || cmp -s "$HTTP_BODY" "$E2E_TMP/big.bin"; }; then
    pass "7. kill -9 mid-upload: nothing partial visible (HEAD $h1/$h2), the session resumed (PATCH $pc, PUT $fin), the blob reads whole"
else
    fail "7. after kill -9: HEAD y $h1, x $h2 (want 404), resumed PATCH $pc PUT $fin, GET $HTTP_CODE"
fi
code=$(sec_push_blob alice/y "$E2E_TMP/big.bin" -u alice:alice-pw)
http_req GET "$R/v2/alice/y/blobs/$BIG" -u alice:alice-pw
[[ $code == 201 ]] && cmp -s "$HTTP_BODY" "$E2E_TMP/big.bin" && pass "7. pushed again after the crash: 201 and verified bytes" ||
    fail "7. push after the crash -> $code, GET $HTTP_CODE"
e2e_summary
