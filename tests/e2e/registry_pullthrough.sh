#!/usr/bin/env bash
# tests/e2e/registry_pullthrough.sh — `ferry registry serve` with an [upstream] section
# (pull-through cache) in front of Debian's docker-registry with htpasswd auth.
#
#   bash tests/e2e/registry_pullthrough.sh
#
# Upstream: docker-registry (distribution 2.8), htpasswd user `upuser`, access log on (one
# line per request, so upstream fetches can be counted), holding the small test image
# (tests/e2e/out/small, pushed with skopeo) as team/small:v1, a cold 32 MiB random blob
# and a further blob the front is never asked for before the outage.
# Front: ferry with [upstream] (url + upuser's credentials, manifest_ttl 1s, short
# timeouts) and its own token-mode [auth] (user `client`, a different password).
# Checks:
#  1. 10 parallel cold `skopeo copy` from the front: every copy has the source's manifest,
#     config and layer digests; upstream served each blob exactly once (access log), and
#     ferry's /metrics counts the upstream fetches.
#  2. 20 parallel curl GETs of the cold 32 MiB blob: all bytes verified, exactly one
#     upstream GET of it.
#  3. `ctr image pull --plain-http --user client:…` through the front, `ctr run` prints
#     "ready small" (as image_runs.sh / registry_clients.sh).
#  4. Upstream credentials never reach a client: headers and bodies of every kind of
#     answer (challenge, token, catalog, tags, manifests, blobs, HEAD, 404s, 405s, the
#     outage's 5xx) contain neither base64(upuser:pass) nor the password; a front whose
#     upstream password is wrong answers an error without upstream's Basic challenge.
#  5. Pushes to the front (blob upload POST, manifest PUT, skopeo push) are refused with
#     405 UNSUPPORTED.
#  6. Upstream stopped: cached content still pulls (skopeo copy; the tag's 1 s TTL has
#     expired, so the stale copy is served), an uncached blob answers 502/503 with a JSON
#     error within 20 s (no hang), and the front stays up.
# Env: FERRY (binary), OUT (tests/e2e/out), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "private containerd"
need_cmd containerd ctr runc docker-registry skopeo jq curl sha256sum base64 python3 timeout

find_ferry
e2e_init
small_image

UP_USER=upuser
UP_PASS=up-Secret-$RANDOM$RANDOM-pw
UP_B64=$(printf '%s:%s' "$UP_USER" "$UP_PASS" | base64 -w0)
CLIENT=client:client-pw-$RANDOM
REPO=team/small
make_htpasswd "$E2E_TMP/up.htpasswd" "$UP_USER" "$UP_PASS" || e2e_die "cannot write htpasswd"
make_htpasswd "$E2E_TMP/front.htpasswd" client "${CLIENT#client:}" || e2e_die "cannot write htpasswd"

SRC_DIGEST=$(jq -r '.manifests[0].digest' "$SMALL/index.json")
SRC_MANIFEST=$(oci_manifest "$SMALL" small)
SRC_CONFIG=$(jq -r .config.digest <<<"$SRC_MANIFEST")
SRC_LAYERS=$(jq -r '[.layers[].digest] | join(" ")' <<<"$SRC_MANIFEST")

POLICY=$E2E_TMP/policy.json
echo '{"default":[{"type":"insecureAcceptAnything"}]}' >"$POLICY"
show() { sed 's/^/    | /' "$1" | tail -"${2:-8}" || true; }
run() { # LOG CMD...: CMD with a 120 s timeout, output to LOG
    local log=$1
    shift
    timeout 120 "$@" >"$log" 2>&1
}
error_codes() { jq -r '[.errors[]?.code] | join(" ")' "$HTTP_BODY" 2>/dev/null || true; }
# every response the front sends is kept for the credential-leak check
RESP=$E2E_TMP/responses
mkdir -p "$RESP"
nresp=0
keep_resp() { nresp=$((nresp + 1)); cat "$HTTP_HDRS" "$HTTP_BODY" >"$RESP/$nresp-$1" 2>/dev/null || true; }

# ---------------------------------------------------------------- upstream
UP_PORT=$(free_port)
UP=127.0.0.1:$UP_PORT
mkdir -p "$E2E_TMP/upstream/data"
cat >"$E2E_TMP/upstream/config.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $E2E_TMP/upstream/data
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
auth:
  htpasswd:
    realm: upstream-realm
    path: $E2E_TMP/up.htpasswd
http:
  addr: $UP
  secret: ferry-e2e-not-secret
EOF
UP_LOG=$E2E_TMP/upstream.log
start_upstream() {
    docker-registry serve "$E2E_TMP/upstream/config.yml" >>"$UP_LOG" 2>&1 &
    UP_PID=$!
    E2E_PIDS+=("$UP_PID")
    wait_for 30 upstream curl -s -o /dev/null --noproxy '*' "http://$UP/v2/" || e2e_die "docker-registry did not start"
}
start_upstream
e2e_log "upstream docker-registry pid $UP_PID on $UP (user $UP_USER)"

if run "$E2E_TMP/push.log" skopeo --policy "$POLICY" copy --dest-tls-verify=false --dest-creds "$UP_USER:$UP_PASS" \
    "oci:$SMALL:small" "docker://$UP/$REPO:v1"; then
    pass "skopeo push of the small image to the upstream (htpasswd) as $REPO:v1"
else
    fail "skopeo push to upstream"; show "$E2E_TMP/push.log"; e2e_summary || exit 1
fi
# upload_blob FILE: monolithic upload to upstream's $REPO; prints the digest
upload_blob() {
    local d loc sep
    d=sha256:$(sha256sum <"$1" | cut -d' ' -f1)
    http_req POST "http://$UP/v2/$REPO/blobs/uploads/" -u "$UP_USER:$UP_PASS"
    [[ $HTTP_CODE == 202 ]] || return 1
    loc=$(http_header location)
    [[ $loc == http* ]] || loc=http://$UP$loc
    sep='?'
    [[ $loc == *\?* ]] && sep='&'
    http_req PUT "$loc${sep}digest=$d" -u "$UP_USER:$UP_PASS" -H 'Content-Type: application/octet-stream' --data-binary "@$1"
    [[ $HTTP_CODE == 201 ]] || return 1
    echo "$d"
}
head -c $((32 << 20)) /dev/urandom >"$E2E_TMP/big.bin"
head -c $((1 << 20)) /dev/urandom >"$E2E_TMP/never.bin"
BIG=$(upload_blob "$E2E_TMP/big.bin") && NEVER=$(upload_blob "$E2E_TMP/never.bin") ||
    { fail "blob upload to upstream ($HTTP_CODE)"; e2e_summary || exit 1; }
BIG_HEX=${BIG#sha256:}

# successful upstream GETs of blob DIGEST (the access log line has the status after the request)
upstream_gets() { grep -c "\"GET /v2/$REPO/blobs/$1 HTTP/[0-9.]*\" 20[06] " "$UP_LOG" || true; }
upstream_get_lines() { grep -c "\"GET /v2/$REPO/blobs/$1 HTTP" "$UP_LOG" || true; }
upstream_writes() { grep -c '"\(POST\|PUT\|PATCH\|DELETE\) /v2/' "$UP_LOG" || true; }
WRITES_BEFORE=$(upstream_writes)

# ---------------------------------------------------------------- front
front_config() { # FILE PASSWORD
    cat >"$1" <<EOF
[auth]
mode = "token"
htpasswd = "$E2E_TMP/front.htpasswd"
secret = "ferry-e2e-front-token-secret-not-for-production"
anonymous_pull = false

[[auth.rules]]
repository = "**"
users = ["client"]
actions = ["*"]

[upstream]
url = "http://$UP"
username = "$UP_USER"
password = "$2"
manifest_ttl = "1s"
list_ttl = "1s"
stale_limit = "1h"
connect_timeout = "2s"
request_timeout = "5s"
idle_timeout = "5s"
EOF
}
front_config "$E2E_TMP/front.toml" "$UP_PASS"
start_ferry_registry front "$E2E_TMP/front.toml" || { fail "start ferry pull-through front"; e2e_summary || exit 1; }
FRONT=$REG_ADDR
FRONT_PID=$REG_PID
FRONT_LOG=$REG_LOG

metric() { # NAME -> value summed over label sets (0 if absent)
    curl -s --noproxy '*' --max-time 5 -u "$CLIENT" "http://$FRONT/metrics" |
        awk -v n="$1" '$1 == n || index($1, n "{") == 1 { s += $2 } END { print s + 0 }'
}

# ================================================================ 1. parallel cold skopeo
t0=$SECONDS
pids=()
for i in $(seq 10); do
    timeout 120 skopeo --policy "$POLICY" copy --src-tls-verify=false --src-creds "$CLIENT" \
        "docker://$FRONT/$REPO:v1" "oci:$E2E_TMP/pull$i:v1" >"$E2E_TMP/pull$i.log" 2>&1 &
    pids+=($!)
done
bad=0
for i in "${!pids[@]}"; do wait "${pids[i]}" || { bad=$((bad + 1)); show "$E2E_TMP/pull$((i + 1)).log" 4; }; done
same=0
for i in $(seq 10); do
    d=$E2E_TMP/pull$i
    got=$(jq -r '.manifests[0].digest' "$d/index.json" 2>/dev/null) || got=""
    m=$(oci_manifest "$d" v1 2>/dev/null) || m='{}'
    ok=1
    [[ $got == "$SRC_DIGEST" && $(jq -r '.config.digest // ""' <<<"$m") == "$SRC_CONFIG" &&
        $(jq -r '[.layers[]?.digest] | join(" ")' <<<"$m") == "$SRC_LAYERS" ]] || ok=0
    for b in "$d"/blobs/sha256/*; do
        [[ -f $b && $(sha256sum <"$b" | cut -d' ' -f1) == "$(basename "$b")" ]] || ok=0
    done
    same=$((same + ok))
done
if [[ $bad == 0 && $same == 10 ]]; then
    pass "10 parallel cold skopeo copies from the front ($((SECONDS - t0))s): manifest $SRC_DIGEST, config and layers equal the source, blobs verified"
else
    fail "parallel skopeo copies: $bad failed, $same/10 with the source's digests"
fi
counts=""
ok=1
for b in $SRC_CONFIG $SRC_LAYERS; do
    n=$(upstream_gets "$b")
    counts+=" ${b:7:12}=$n"
    [[ $n == 1 ]] || ok=0
done
if [[ $ok == 1 ]]; then
    pass "upstream served each blob of the image exactly once for 10 concurrent cold pulls ($counts )"
else
    fail "upstream blob GETs for 10 concurrent cold pulls:$counts (want 1 each; all GET lines incl. 401s: $(upstream_get_lines "${SRC_LAYERS%% *}"))"
fi
fetches=$(metric ferry_registry_upstream_fetches_total)
if [[ $fetches -ge 2 ]]; then
    pass "ferry /metrics: ferry_registry_upstream_fetches_total $fetches, upstream_bytes $(metric ferry_registry_upstream_bytes_total)"
else
    fail "ferry /metrics upstream_fetches_total = '$fetches' after cold pulls"
fi

# ================================================================ 2. 20 concurrent GETs of a cold 32 MiB blob
t0=$SECONDS
pids=()
for i in $(seq 20); do
    curl -sS --noproxy '*' --max-time 60 -u "$CLIENT" -o "$E2E_TMP/big.$i" -w '%{http_code}' \
        "http://$FRONT/v2/$REPO/blobs/$BIG" >"$E2E_TMP/big.$i.code" 2>"$E2E_TMP/big.$i.err" &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || true; done
good=0
for i in $(seq 20); do
    [[ $(cat "$E2E_TMP/big.$i.code") == 200 && $(sha256sum <"$E2E_TMP/big.$i" | cut -d' ' -f1) == "$BIG_HEX" ]] && good=$((good + 1))
    rm -f "$E2E_TMP/big.$i"
done
n=$(upstream_gets "$BIG")
if [[ $good == 20 && $n == 1 ]]; then
    pass "20 concurrent GETs of a cold 32 MiB blob ($((SECONDS - t0))s): all 20 bodies hash to $BIG, exactly 1 upstream GET"
else
    fail "20 concurrent GETs of the cold blob: $good/20 correct, $n successful upstream GETs (want 1; all GET lines $(upstream_get_lines "$BIG"))"
fi

# ================================================================ 3. containerd through the front
start_containerd
REF=$FRONT/$REPO:v1
if run "$E2E_TMP/ctr-pull.log" ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" image pull --plain-http --user "$CLIENT" "$REF"; then
    pass "ctr image pull --plain-http --user client through the front"
    set +e
    out=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm "$REF" "pt-$$-1" 2>&1)
    rc=$?
    set -e
    if [[ $rc == 0 && $out == "ready small" ]]; then
        pass "ctr run through the front: '$out'"
    else
        fail "ctr run: exit $rc '$out' (want 'ready small')"
    fi
else
    fail "ctr image pull through the front"; show "$E2E_TMP/ctr-pull.log"
fi

# ================================================================ 4./5. responses, pushes refused
# token for curl (Bearer), as a client would get it
http_req GET "http://$FRONT/v2/"
keep_resp challenge
chal=$(http_header www-authenticate)
realm=$(sed -n 's/.*realm="\([^"]*\)".*/\1/p' <<<"$chal")
service=$(sed -n 's/.*service="\([^"]*\)".*/\1/p' <<<"$chal")
http_req GET "$realm" -G -u "$CLIENT" --data-urlencode "service=$service" --data-urlencode "scope=repository:$REPO:pull,push"
keep_resp token
TOK=$(jq -r '.token // .access_token // ""' "$HTTP_BODY" 2>/dev/null) || TOK=""
[[ -n $TOK ]] || fail "token from the front's realm '$realm' -> $HTTP_CODE"
A=(-H "Authorization: Bearer $TOK")
ACCEPT=(-H 'Accept: application/vnd.oci.image.manifest.v1+json' -H 'Accept: application/vnd.oci.image.index.v1+json'
    -H 'Accept: application/vnd.docker.distribution.manifest.v2+json')
for req in "GET /v2/" "GET /v2/$REPO/tags/list" "GET /v2/$REPO/manifests/v1" \
    "HEAD /v2/$REPO/manifests/v1" "GET /v2/$REPO/manifests/$SRC_DIGEST" "GET /v2/$REPO/blobs/$SRC_CONFIG" \
    "HEAD /v2/$REPO/blobs/$BIG" "GET /v2/$REPO/manifests/no-such-tag" \
    "GET /v2/$REPO/blobs/sha256:$(printf x | sha256sum | cut -d' ' -f1)" "GET /v2/$REPO/referrers/$SRC_DIGEST"; do
    http_req "${req%% *}" "http://$FRONT${req#* }" "${A[@]}" "${ACCEPT[@]}"
    keep_resp "${req%% *}-$(tr -c 'a-zA-Z0-9' _ <<<"${req#* }" | cut -c1-60)"
done
# a 206 range answer, and Basic credentials for what the repository-scoped token cannot reach
http_req GET "http://$FRONT/v2/$REPO/blobs/$BIG" -H 'Range: bytes=0-99' -u "$CLIENT"
keep_resp range
http_req GET "http://$FRONT/v2/_catalog" -u "$CLIENT"
keep_resp catalog
http_req GET "http://$FRONT/v2/nosuch/repo/manifests/v1" -u "$CLIENT" "${ACCEPT[@]}"
keep_resp other-repo

# 5. pushes are refused
http_req POST "http://$FRONT/v2/$REPO/blobs/uploads/" "${A[@]}"
keep_resp post
post="$HTTP_CODE $(error_codes)"
http_req PUT "http://$FRONT/v2/$REPO/manifests/v2" "${A[@]}" -H 'Content-Type: application/vnd.oci.image.manifest.v1+json' \
    --data-binary "$SRC_MANIFEST"
keep_resp put
put="$HTTP_CODE $(error_codes)"
if [[ $post == "405 UNSUPPORTED" && $put == "405 UNSUPPORTED" ]]; then
    pass "push to the front refused: blob upload POST -> $post, manifest PUT -> $put"
else
    fail "push to the front: POST -> '$post', PUT -> '$put' (want 405 UNSUPPORTED)"
fi
if ! run "$E2E_TMP/push-front.log" skopeo --policy "$POLICY" copy --dest-tls-verify=false --dest-creds "$CLIENT" \
    "oci:$SMALL:small" "docker://$FRONT/$REPO:pushed"; then
    pass "skopeo push to the front fails ($(grep -o -m1 -i 'unsupported[^"]*' "$E2E_TMP/push-front.log" | head -1 | cut -c1-70))"
else
    fail "skopeo push to the front succeeded"
fi
writes_now=$(upstream_writes)
if [[ $writes_now == "$WRITES_BEFORE" ]]; then
    pass "nothing was pushed on to the upstream ($writes_now write requests there, all from the setup)"
else
    fail "a push reached the upstream: $WRITES_BEFORE write requests before, $writes_now after"
fi

# a front configured with a wrong upstream password: an error, never upstream's challenge
front_config "$E2E_TMP/wrong.toml" "wrong-$UP_PASS"
if start_ferry_registry wrong "$E2E_TMP/wrong.toml"; then
    http_req GET "http://$REG_ADDR/v2/$REPO/manifests/v1" -u "$CLIENT" "${ACCEPT[@]}"
    keep_resp wrong-upstream-pw
    if [[ $HTTP_CODE != 200 && $HTTP_CODE != 000 ]] && ! grep -qi 'upstream-realm' "$HTTP_HDRS" "$HTTP_BODY"; then
        pass "front with a wrong upstream password: $HTTP_CODE $(error_codes), upstream's Basic challenge not passed on"
    else
        fail "front with a wrong upstream password: $HTTP_CODE, upstream realm in answer: $(grep -ci 'upstream-realm' "$HTTP_HDRS" "$HTTP_BODY" | tr '\n' ' ')"
    fi
    kill "$REG_PID" 2>/dev/null || true
else
    fail "start the front with a wrong upstream password"
fi

# ================================================================ 6. upstream down
kill "$UP_PID"
wait "$UP_PID" 2>/dev/null || true
curl -s -o /dev/null --max-time 2 --noproxy '*' "http://$UP/v2/" && e2e_die "upstream still answering"
sleep 1.5 # the tag's manifest_ttl (1 s) has passed: only a stale copy can answer
rm -rf "$E2E_TMP/stale"
if run "$E2E_TMP/stale.log" skopeo --policy "$POLICY" copy --src-tls-verify=false --src-creds "$CLIENT" \
    "docker://$FRONT/$REPO:v1" "oci:$E2E_TMP/stale:v1" &&
    [[ $(jq -r '.manifests[0].digest' "$E2E_TMP/stale/index.json") == "$SRC_DIGEST" ]]; then
    pass "upstream stopped: skopeo copy of the cached image by tag still works (stale manifest served, digest $SRC_DIGEST)"
else
    fail "upstream stopped: pull of cached content failed"; show "$E2E_TMP/stale.log"
fi
t0=$(date +%s.%N)
HTTP_TIMEOUT=20 http_req GET "http://$FRONT/v2/$REPO/blobs/$NEVER" "${A[@]}"
keep_resp outage-blob
took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
codes=$(error_codes)
if [[ ($HTTP_CODE == 502 || $HTTP_CODE == 503) && -n $codes ]]; then
    pass "upstream stopped: uncached blob -> $HTTP_CODE {errors: $codes} in ${took}s"
else
    fail "upstream stopped: uncached blob -> '$HTTP_CODE' errors '$codes' after ${took}s (want 502/503 with a JSON error)"; show "$HTTP_BODY" 3
fi
HTTP_TIMEOUT=20 http_req GET "http://$FRONT/v2/$REPO/manifests/never-pulled" "${A[@]}" "${ACCEPT[@]}"
keep_resp outage-manifest
if [[ ($HTTP_CODE == 502 || $HTTP_CODE == 503) && -n $(error_codes) ]]; then
    pass "upstream stopped: uncached tag -> $HTTP_CODE {errors: $(error_codes)}"
else
    fail "upstream stopped: uncached tag -> '$HTTP_CODE' '$(error_codes)' (want 502/503 with a JSON error)"
fi
http_req GET "http://$FRONT/v2/$REPO/blobs/$BIG" -u "$CLIENT"
if [[ $HTTP_CODE == 200 && $(sha256sum <"$HTTP_BODY" | cut -d' ' -f1) == "$BIG_HEX" ]]; then
    pass "upstream stopped: the cached 32 MiB blob is still served"
else
    fail "upstream stopped: cached blob -> $HTTP_CODE"
fi
: >"$HTTP_BODY"
kill -0 "$FRONT_PID" 2>/dev/null && pass "front still running" || fail "front exited (log $FRONT_LOG)"

# ================================================================ 4. leak check over everything kept
leaks=$(grep -l -F -e "$UP_B64" -e "$UP_PASS" "$RESP"/* 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ') || true
for i in $(seq 10); do
    grep -q -F -e "$UP_B64" -e "$UP_PASS" "$E2E_TMP/pull$i.log" && leaks+="skopeo-log-$i "
done
grep -q -F -e "$UP_B64" -e "$UP_PASS" "$E2E_TMP/ctr-pull.log" && leaks+="ctr-log "
if [[ -z $leaks ]]; then
    pass "upstream credentials (password, base64 user:pass) in none of $nresp captured front responses (headers + bodies) nor in client logs"
else
    fail "upstream credentials found in: $leaks"
fi
# for reference: the upstream's address in answers is not a secret, but say so if it leaks
if grep -l -F "$UP" "$RESP"/* >/dev/null 2>&1; then
    e2e_log "note: upstream address $UP appears in: $(grep -l -F "$UP" "$RESP"/* | xargs -n1 basename | tr '\n' ' ')"
fi

e2e_summary
