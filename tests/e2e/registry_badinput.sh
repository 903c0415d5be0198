#!/usr/bin/env bash
# tests/e2e/registry_badinput.sh — hostile and broken requests against `ferry registry serve`.
#
#   bash tests/e2e/registry_badinput.sh
#   REGISTRY_UNDER_TEST=docker-registry bash tests/e2e/registry_badinput.sh  # check the checks
#
# One registry (no auth, body idle timeout $IDLE s) with the small image pushed by skopeo.
# With curl (--path-as-is) and python3 sockets:
#  1. malformed manifest JSON / wrong schema -> 400 MANIFEST_INVALID, tag not created
#  2. manifest naming a blob that was never pushed -> 400 (or 404) MANIFEST_BLOB_UNKNOWN
#     (ferry's registry with `sparse_manifests = false`);
#     a layer of one repository is not served through another (404 BLOB_UNKNOWN), nor
#     mounted from a repository that lacks it (202 upload) or a '..' name; a real mount works
#  3. blob upload whose data does not match ?digest= -> 400 DIGEST_INVALID (two-step and
#     monolithic POST), a malformed digest -> 400 DIGEST_INVALID; the data is not
#     retrievable under the claimed or the real digest
#  4. repository names with path tricks (.., %2e%2e, a/../b, a//b, uppercase, 300 chars,
#     %2f, NUL, ...) on push, manifest PUT and tag list -> 400 NAME_INVALID or 404;
#     nothing named ferry-escape-* anywhere under the temp dir, /tmp or /, nothing in the
#     server's working directory, nothing but the data dir in the registry's parent
#  5. oversized manifest: 5 MiB body -> 413 / SIZE_INVALID, not stored; a PUT declaring
#     Content-Length 1 GiB is answered (413/400) after only 256 KiB were sent (the server
#     does not wait for / buffer the body); an 64 MiB chunked manifest body is refused and
#     the server's peak RSS grows by less than 48 MiB
#  6. slow clients: a PATCH whose body stalls and a request whose headers stall are cut off
#     after the idle timeout (between IDLE-1 and IDLE+20 s) while other requests are
#     served promptly (< 2 s each) meanwhile; nothing of the stalled upload is stored
#  7. chunked upload: PATCH out of order -> 416; the upload then continues in order and
#     completes with the right bytes; an upload id is not usable through another
#     repository, dotted ids are refused, DELETE cancels (then 404 BLOB_UPLOAD_UNKNOWN);
#     max_blob_bytes (8 MiB): a PATCH declaring 1 GiB is answered 413 early, a streamed
#     16 MiB body is refused and nothing is stored
#  8. Range: bytes=0-99 / -10 -> 206 with the right bytes; bytes=SIZE- -> 416 with
#     Content-Range: bytes */SIZE
#  9. every error response above (non-HEAD) is JSON with a non-empty `errors` array of
#     {code, message}
# 10. afterwards the server process is alive and a normal skopeo pull gives the source
#     digests
#
# Env: FERRY, REGISTRY_UNDER_TEST=ferry|docker-registry, OUT, IDLE (idle timeout, 3),
#      E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_cmd skopeo jq curl sha256sum python3 timeout head

TARGET=${REGISTRY_UNDER_TEST:-ferry}
IDLE=${IDLE:-3}
find_ferry
e2e_init
small_image
SRC_DIGEST=$(jq -r '.manifests[0].digest' "$SMALL/index.json")
SRC_MANIFEST=$(oci_manifest "$SMALL" small)
SRC_CONFIG=$(jq -r .config.digest <<<"$SRC_MANIFEST")
SRC_LAYERS=$(jq -r '[.layers[].digest] | join(" ")' <<<"$SRC_MANIFEST")
BIG_LAYER=$(jq -r '.layers | max_by(.size) | .digest' <<<"$SRC_MANIFEST")
BIG_SIZE=$(jq -r '.layers | max_by(.size) | .size' <<<"$SRC_MANIFEST")
POLICY=$E2E_TMP/policy.json
echo '{"default":[{"type":"insecureAcceptAnything"}]}' >"$POLICY"

show() { sed 's/^/    | /' "$1" | tail -"${2:-6}" || true; }
sha_of() { echo "sha256:$(sha256sum <"$1" | cut -d' ' -f1)"; }
baseline_skip() {
    if [[ $TARGET == docker-registry ]]; then
        echo "SKIP (docker-registry): $*"
        return 0
    fi
    return 1
}
error_codes() { jq -r '[.errors[]?.code] | join(" ")' "$HTTP_BODY" 2>/dev/null || true; }

# JSON error bodies seen / bad ones (check 9)
ERR_SEEN=0
ERR_BAD=()
# note_error_body LABEL: after an http_req with status >= 400 (not HEAD), record whether
# the body is {"errors":[{"code":..,"message":..},..]}
note_error_body() {
    [[ $HTTP_CODE =~ ^[45] ]] || return 0
    ERR_SEEN=$((ERR_SEEN + 1))
    jq -e '(.errors | type == "array" and length > 0) and all(.errors[]; (.code | type == "string") and has("message"))' \
        "$HTTP_BODY" >/dev/null 2>&1 || ERR_BAD+=("$1 -> $HTTP_CODE '$(head -c 80 "$HTTP_BODY" | tr -d '\n')'")
}
# req LABEL METHOD URL [CURL_ARGS...]: http_req + note_error_body
req() {
    local label=$1
    shift
    http_req "$@"
    [[ $1 == HEAD ]] || note_error_body "$label"
}
# expect NAME "STATUS..." "CODE..." : the last response has one of STATUS and (if CODE is
# not "-") one of the error codes
expect() {
    local name=$1 statuses=$2 codes=$3 s c ok_s=0 ok_c=0 got
    got=$(error_codes)
    for s in $statuses; do [[ $HTTP_CODE == "$s" ]] && ok_s=1; done
    if [[ $codes == - ]]; then
        ok_c=1
    else
        for c in $codes; do [[ " $got " == *" $c "* ]] && ok_c=1; done
    fi
    if [[ $ok_s == 1 && $ok_c == 1 ]]; then
        pass "$name -> $HTTP_CODE ${got:-}"
    else
        fail "$name -> $HTTP_CODE '${got}' (want $statuses ${codes/-/})"
        show "$HTTP_BODY" 3
    fi
}

# ---------------------------------------------------------------- registry
WORK=$E2E_TMP/cwd
mkdir -p "$WORK"
cd "$WORK"  # the server's working directory: must stay empty
if [[ $TARGET == docker-registry ]]; then
    start_docker_registry reg || { fail "start docker-registry"; e2e_summary || exit 1; }
else
    cat >"$E2E_TMP/reg.toml" <<EOF
[limits]
# refused, as docker-registry refuses them: check 2 wants a manifest naming a layer never
# pushed refused (the default accepts such sparse manifests, as the OCI suite's sparse
# workflow expects; docs/registry.md)
sparse_manifests = false
max_manifest_bytes = 4194304
max_blob_bytes = 8388608
body_idle_timeout = "${IDLE}s"
header_read_timeout = "${IDLE}s"
EOF
    start_ferry_registry reg "$E2E_TMP/reg.toml" || { fail "start ferry registry"; e2e_summary || exit 1; }
fi
R=http://$REG_ADDR
PARENT=$(dirname "$REG_DATA")
if timeout 120 skopeo --policy "$POLICY" copy --dest-tls-verify=false "oci:$SMALL:small" \
    "docker://$REG_ADDR/bad/small:v1" >"$E2E_TMP/push.log" 2>&1; then
    pass "setup: skopeo push of the small image to $REG_ADDR/bad/small:v1"
else
    fail "setup: skopeo push"; show "$E2E_TMP/push.log"
fi

# push_blob REPO FILE: POST + PUT ?digest= ; returns 0 on 201
push_blob() {
    local repo=$1 file=$2 loc
    http_req POST "$R/v2/$repo/blobs/uploads/"
    [[ $HTTP_CODE == 202 ]] || return 1
    loc=$(abs_location)
    http_req PUT "$(with_query "$loc" "digest=$(sha_of "$file")")" -H 'Content-Type: application/octet-stream' --data-binary "@$file"
    [[ $HTTP_CODE == 201 ]]
}
abs_location() {
    local loc
    loc=$(http_header location)
    [[ $loc == http* ]] || loc=$R$loc
    echo "$loc"
}
with_query() { if [[ $1 == *\?* ]]; then echo "$1&$2"; else echo "$1?$2"; fi; }
# start_upload REPO: POST, sets LOC (absolute upload URL)
start_upload() {
    req "POST upload" POST "$R/v2/$1/blobs/uploads/"
    LOC=""
    [[ $HTTP_CODE == 202 ]] && LOC=$(abs_location)
    [[ -n $LOC ]]
}
OCI_MT=application/vnd.oci.image.manifest.v1+json

# ================================================================ 1. malformed manifests
printf '{"schemaVersion": 2, "mediaType": "%s", "config": {' "$OCI_MT" >"$E2E_TMP/broken.json"
req "PUT malformed manifest" PUT "$R/v2/bad/small/manifests/broken" -H "Content-Type: $OCI_MT" --data-binary "@$E2E_TMP/broken.json"
expect "PUT truncated manifest JSON" 400 MANIFEST_INVALID
jq -c '.schemaVersion = 3 | del(.config)' <<<"$SRC_MANIFEST" >"$E2E_TMP/wrong.json"
req "PUT wrong-schema manifest" PUT "$R/v2/bad/small/manifests/wrong" -H "Content-Type: $OCI_MT" --data-binary "@$E2E_TMP/wrong.json"
expect "PUT manifest without config / schemaVersion 3" 400 "MANIFEST_INVALID"
printf '\xff\xfe\x00garbage' >"$E2E_TMP/bin.json"
req "PUT binary manifest" PUT "$R/v2/bad/small/manifests/binary" -H "Content-Type: $OCI_MT" --data-binary "@$E2E_TMP/bin.json"
expect "PUT non-UTF-8 manifest body" 400 "MANIFEST_INVALID"
req "GET broken tag" GET "$R/v2/bad/small/manifests/broken" -H "Accept: $OCI_MT"
expect "GET the rejected tag 'broken'" 404 MANIFEST_UNKNOWN

# ================================================================ 2. missing blob
head -c 4096 /dev/urandom >"$E2E_TMP/never-pushed.bin"
jq -c --arg d "$(sha_of "$E2E_TMP/never-pushed.bin")" '.layers[0].digest = $d | .layers[0].size = 4096' <<<"$SRC_MANIFEST" >"$E2E_TMP/missing.json"
req "PUT manifest missing blob" PUT "$R/v2/bad/small/manifests/missing" -H "Content-Type: $OCI_MT" --data-binary "@$E2E_TMP/missing.json"
expect "PUT manifest naming a never-pushed layer" "400 404" MANIFEST_BLOB_UNKNOWN
[[ $HTTP_CODE == 400 ]] || echo "    (note: distribution answers 400 here; $HTTP_CODE is allowed by the spec)"
req "GET missing tag" GET "$R/v2/bad/small/manifests/missing" -H "Accept: $OCI_MT"
expect "GET the rejected tag 'missing'" 404 MANIFEST_UNKNOWN

# ================================================================ 3. wrong digest
echo "real data $$ $RANDOM" >"$E2E_TMP/real.bin"
echo "claimed data $$" >"$E2E_TMP/claimed.bin"
REAL=$(sha_of "$E2E_TMP/real.bin")
CLAIMED=$(sha_of "$E2E_TMP/claimed.bin")
if start_upload bad/digest; then
    req "PUT wrong digest" PUT "$(with_query "$LOC" "digest=$CLAIMED")" -H 'Content-Type: application/octet-stream' --data-binary "@$E2E_TMP/real.bin"
    expect "upload finished with ?digest= of other data" 400 DIGEST_INVALID
else
    fail "POST upload -> $HTTP_CODE"
fi
req "POST monolithic wrong digest" POST "$R/v2/bad/digest/blobs/uploads/?digest=$CLAIMED" -H 'Content-Type: application/octet-stream' --data-binary "@$E2E_TMP/real.bin"
if [[ $HTTP_CODE == 202 ]]; then
    echo "    (monolithic POST not supported: 202, fell back to a session; not an error)"
    pass "monolithic POST with a wrong digest not accepted (202: session opened instead)"
else
    expect "monolithic POST ?digest= of other data" 400 DIGEST_INVALID
fi
if start_upload bad/digest; then
    req "PUT malformed digest" PUT "$(with_query "$LOC" "digest=sha256:not-hex")" -H 'Content-Type: application/octet-stream' --data-binary "@$E2E_TMP/real.bin"
    expect "upload finished with ?digest=sha256:not-hex" 400 "DIGEST_INVALID"
fi
ok=1
for d in "$REAL" "$CLAIMED"; do
    for repo in bad/digest bad/small; do
        http_req HEAD "$R/v2/$repo/blobs/$d"
        [[ $HTTP_CODE == 404 ]] || { ok=0; echo "    HEAD $repo/blobs/$d -> $HTTP_CODE"; }
        req "GET wrong-digest blob" GET "$R/v2/$repo/blobs/$d"
        [[ $HTTP_CODE == 404 ]] || { ok=0; echo "    GET $repo/blobs/$d -> $HTTP_CODE"; }
    done
done
if [[ $ok == 1 ]]; then pass "the mismatched data is not retrievable (real or claimed digest, HEAD and GET -> 404)"; else fail "mismatched upload data is retrievable"; fi

# a blob is served only through a repository that references it
req "GET layer via unrelated repo" GET "$R/v2/bad/other/blobs/$BIG_LAYER"
expect "GET a layer of bad/small through bad/other (never pushed there)" 404 "BLOB_UNKNOWN NAME_UNKNOWN"
http_req HEAD "$R/v2/bad/other/blobs/$BIG_LAYER"
if [[ $HTTP_CODE == 404 ]]; then pass "HEAD of that layer through bad/other -> 404"; else fail "HEAD bad/other/blobs/<layer of bad/small> -> $HTTP_CODE"; fi

# cross-repository mount: only from a repository that has the blob
req "mount from a repo without the blob" POST "$R/v2/bad/mnt/blobs/uploads/?mount=$BIG_LAYER&from=bad/nonexistent"
c1=$HTTP_CODE
http_req HEAD "$R/v2/bad/mnt/blobs/$BIG_LAYER"
c2=$HTTP_CODE
req "mount from ../ name" POST "$R/v2/bad/mnt/blobs/uploads/?mount=$BIG_LAYER&from=bad/../bad/small"
c3=$HTTP_CODE
http_req HEAD "$R/v2/bad/mnt/blobs/$BIG_LAYER"
c4=$HTTP_CODE
if [[ $c1 == 202 && $c2 == 404 && $c3 != 201 && $c4 == 404 ]]; then
    pass "mount from a repository without the blob -> 202 (plain upload), from 'bad/../bad/small' -> $c3; blob still 404 in bad/mnt"
else
    fail "bogus mounts: from bad/nonexistent -> $c1 (want 202), HEAD after -> $c2; from bad/../bad/small -> $c3 (want not 201), HEAD after -> $c4 (want 404)"
fi
req "mount from bad/small" POST "$R/v2/bad/mnt/blobs/uploads/?mount=$BIG_LAYER&from=bad/small"
c1=$HTTP_CODE
http_req HEAD "$R/v2/bad/mnt/blobs/$BIG_LAYER"
if [[ $c1 == 201 && $HTTP_CODE == 200 ]]; then
    pass "mount from bad/small -> 201, blob then served through bad/mnt"
else
    fail "mount from bad/small -> $c1 (want 201), HEAD through bad/mnt -> $HTTP_CODE"
fi

# ================================================================ 4. path tricks
touch "$E2E_TMP/before-names"
sleep 1
LONG=$(printf 'a%.0s' $(seq 300))
DEEP=$(printf 'a/%.0s' $(seq 150))ferry-escape-deep
NAMES=(
    ".." "%2e%2e" "../ferry-escape-1" "%2e%2e/ferry-escape-2" "a/../../../../ferry-escape-3"
    "a/%2e%2e/%2e%2e/%2e%2e/%2e%2e/ferry-escape-4" "..%2f..%2f..%2fferry-escape-5"
    "a%2f..%2f..%2f..%2fferry-escape-6" "a//ferry-escape-7" "a/./ferry-escape-8"
    "UPPER/ferry-escape-9" "ferry-escape-10%00x" "/ferry-escape-11" ".ferry-escape-12"
    "-ferry-escape-13" "ferry-escape-14/" "$LONG" "$DEEP" "ferry-escape-15%20x" "ferry%5cescape-16"
)
bad_names=()
for n in "${NAMES[@]}"; do
    short=${n:0:40}
    [[ ${#n} -gt 40 ]] && short="$short...(${#n} chars)"
    res=""
    req "POST upload $short" POST "$R/v2/$n/blobs/uploads/"
    res+=" POST:$HTTP_CODE"
    okn=1
    [[ $HTTP_CODE == 404 || ($HTTP_CODE == 400 && $(error_codes) == *NAME_INVALID*) ]] || okn=0
    req "PUT manifest $short" PUT "$R/v2/$n/manifests/v1" -H "Content-Type: $OCI_MT" --data-binary "$SRC_MANIFEST"
    res+=" PUT:$HTTP_CODE"
    [[ $HTTP_CODE == 404 || ($HTTP_CODE == 400 && $(error_codes) == *NAME_INVALID*) ]] || okn=0
    req "GET tags $short" GET "$R/v2/$n/tags/list"
    res+=" GET:$HTTP_CODE"
    [[ $HTTP_CODE == 404 || ($HTTP_CODE == 400 && $(error_codes) == *NAME_INVALID*) ]] || okn=0
    [[ $okn == 1 ]] || bad_names+=("'$short'$res")
done
if [[ ${#bad_names[@]} == 0 ]]; then
    pass "${#NAMES[@]} tricky repository names: POST upload / PUT manifest / GET tags all -> 400 NAME_INVALID or 404"
else
    fail "tricky names accepted or odd status (want 400 NAME_INVALID / 404): ${bad_names[*]}"
fi
escaped=$( { find "$E2E_TMP" /tmp -xdev -name '*ferry-escape*' 2>/dev/null; find / -xdev -maxdepth 3 -name '*ferry-escape*' 2>/dev/null; } | sort -u | head -5)
extra_parent=$(find "$PARENT" -mindepth 1 -maxdepth 1 ! -path "$REG_DATA" ! -name config.yml 2>/dev/null | head -5)
in_cwd=$(find "$WORK" -mindepth 1 2>/dev/null | head -5)
if [[ -z $escaped && -z $extra_parent && -z $in_cwd ]]; then
    pass "nothing created by the tricky names: no ferry-escape* under the temp dir, /tmp or /; registry parent and cwd untouched"
else
    fail "files created: escaped='$escaped' parent='$extra_parent' cwd='$in_cwd'"
fi
# the valid repository still works
http_req GET "$R/v2/bad/small/tags/list"
if [[ $HTTP_CODE == 200 && $(jq -r '.tags | join(",")' "$HTTP_BODY") == v1 ]]; then
    pass "tags of bad/small after all that: only v1"
else
    fail "tags of bad/small: $HTTP_CODE $(head -c 200 "$HTTP_BODY")"
fi

# ================================================================ 5. oversized manifests
python3 - "$E2E_TMP/huge.json" "$SRC_MANIFEST" <<'PY'
import json, sys
m = json.loads(sys.argv[2])
m["annotations"] = {"pad": "x" * (5 * 1024 * 1024)}
open(sys.argv[1], "w").write(json.dumps(m))
PY
req "PUT 5 MiB manifest" PUT "$R/v2/bad/small/manifests/huge" -H "Content-Type: $OCI_MT" --data-binary "@$E2E_TMP/huge.json"
expect "PUT 5 MiB manifest" "413 400" "SIZE_INVALID MANIFEST_INVALID"
[[ $HTTP_CODE == 413 || $(error_codes) == *SIZE_INVALID* ]] ||
    fail "5 MiB manifest: want status 413 or code SIZE_INVALID, got $HTTP_CODE $(error_codes)"
http_req HEAD "$R/v2/bad/small/manifests/huge"
if [[ $HTTP_CODE == 404 ]]; then pass "the 5 MiB manifest was not stored (HEAD -> 404)"; else fail "HEAD huge -> $HTTP_CODE"; fi

# declared 1 GiB, only 256 KiB sent: the answer must come without the rest of the body
cat >"$E2E_TMP/early.py" <<'PY'
import socket, sys, time
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
method = sys.argv[4] if len(sys.argv) > 4 else "PUT"
s = socket.create_connection((host, port), timeout=15)
s.sendall((f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
           "Content-Type: application/vnd.oci.image.manifest.v1+json\r\n"
           f"Content-Length: {1 << 30}\r\n\r\n").encode() + b'{"schemaVersion":2,"annotations":{"a":"')
t0 = time.monotonic()
data = b""
sent = 0
s.settimeout(2)
try:
    data = s.recv(4096)  # a server may answer from the headers alone
except socket.timeout:
    try:
        s.sendall(b"x" * (256 * 1024))
        sent = 256 * 1024
    except OSError:
        pass
    s.settimeout(15)
    try:
        data = s.recv(4096)
    except socket.timeout:
        print("TIMEOUT no answer within 17 s")
        sys.exit(0)
    except OSError as e:
        print(f"RESET {e}")
        sys.exit(0)
except OSError as e:
    print(f"RESET {e}")
    sys.exit(0)
line = data.split(b"\r\n", 1)[0].decode(errors="replace")
print(f"{line} after {time.monotonic() - t0:.1f}s and {sent} body bytes")
PY
ans=$(python3 "$E2E_TMP/early.py" "${REG_ADDR%:*}" "${REG_ADDR##*:}" /v2/bad/small/manifests/early 2>&1) || true
if [[ $ans == HTTP/1.1\ 413* || $ans == HTTP/1.1\ 400* ]]; then
    pass "PUT declaring Content-Length 1 GiB answered after 256 KiB: $ans"
else
    fail "PUT declaring Content-Length 1 GiB, 256 KiB sent: '$ans' (want an early 413/400)"
fi

# 64 MiB chunked (no Content-Length): refused; the server does not hold it in memory
rss_hwm() { awk '/^VmHWM/ { print $2 }' "/proc/$REG_PID/status" 2>/dev/null || echo 0; }
hwm0=$(rss_hwm)
http_req PUT "$R/v2/bad/small/manifests/chunked" -H "Content-Type: $OCI_MT" -H "Expect:" -T - \
    < <(printf '{"schemaVersion":2,"annotations":{"a":"'; head -c $((64 << 20)) /dev/zero | tr '\0' x)
hwm1=$(rss_hwm)
grow=$(((hwm1 - hwm0) / 1024))
if [[ ($HTTP_CODE == 413 || $HTTP_CODE == 400 || $HTTP_CODE == 000) ]] && ((grow < 48)); then
    pass "64 MiB chunked manifest refused (HTTP $HTTP_CODE $(error_codes)), peak RSS +${grow} MiB"
else
    fail "64 MiB chunked manifest: HTTP $HTTP_CODE $(error_codes), peak RSS +${grow} MiB (want 413/400 and < 48 MiB)"
fi
[[ $HTTP_CODE =~ ^4 ]] && note_error_body "PUT 64 MiB chunked manifest"

# ================================================================ 6. slow clients
cat >"$E2E_TMP/slow.py" <<'PY'
# stall a request body and a request head; meanwhile other requests must be served.
# prints: "body-closed S", "head-closed S", "probe-max S", "probe-fail N"
import socket, sys, threading, time
host, port, patch_path, idle = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
limit = idle + 25
results = {}

def wait_closed(name, s):
    t0 = time.monotonic()
    s.settimeout(limit)
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
    except socket.timeout:
        results[name] = "never"
        return
    except OSError:
        pass
    results[name] = f"{time.monotonic() - t0:.1f}"

def stalled_body():
    s = socket.create_connection((host, port))
    s.sendall((f"PATCH {patch_path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
               "Content-Type: application/octet-stream\r\nContent-Length: 1000000\r\n\r\n").encode()
              + b"stalled-upload-marker-0123456789")
    wait_closed("body-closed", s)

def stalled_head():
    s = socket.create_connection((host, port))
    s.sendall(f"GET /v2/ HTTP/1.1\r\nHost: {host}:{port}\r\nX-Slow: ".encode())
    wait_closed("head-closed", s)

ts = [threading.Thread(target=stalled_body), threading.Thread(target=stalled_head)]
for t in ts:
    t.start()
worst, fails = 0.0, 0
deadline = time.monotonic() + idle + 2
while time.monotonic() < deadline:
    t0 = time.monotonic()
    try:
        c = socket.create_connection((host, port), timeout=5)
        c.sendall(f"GET /v2/ HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        r = c.recv(64)
        if not r.startswith(b"HTTP/1.1 200") and not r.startswith(b"HTTP/1.1 401"):
            fails += 1
        c.close()
    except OSError:
        fails += 1
    worst = max(worst, time.monotonic() - t0)
    time.sleep(0.3)
for t in ts:
    t.join()
print("body-closed", results.get("body-closed"))
print("head-closed", results.get("head-closed"))
print(f"probe-max {worst:.2f}")
print("probe-fail", fails)
PY
if ! baseline_skip "idle timeout on stalled bodies/heads (distribution 2.8 has no read timeout)"; then
    if start_upload bad/slow; then
        path=/${LOC#http://*/}
        python3 "$E2E_TMP/slow.py" "${REG_ADDR%:*}" "${REG_ADDR##*:}" "$path" "$IDLE" >"$E2E_TMP/slow.out" 2>&1 || true
        body=$(awk '$1 == "body-closed" { print $2 }' "$E2E_TMP/slow.out")
        head=$(awk '$1 == "head-closed" { print $2 }' "$E2E_TMP/slow.out")
        pmax=$(awk '$1 == "probe-max" { print $2 }' "$E2E_TMP/slow.out")
        pfail=$(awk '$1 == "probe-fail" { print $2 }' "$E2E_TMP/slow.out")
        in_window() { [[ $1 =~ ^[0-9.]+$ ]] && python3 -c "import sys; v=float(sys.argv[1]); sys.exit(0 if $IDLE-1 <= v <= $IDLE+20 else 1)" "$1"; }
        if in_window "$body"; then pass "stalled PATCH body cut off after ${body}s (idle timeout ${IDLE}s)"; else fail "stalled PATCH body: closed after '${body}' s (want ~${IDLE}s)"; show "$E2E_TMP/slow.out"; fi
        if in_window "$head"; then pass "stalled request head cut off after ${head}s"; else fail "stalled request head: closed after '${head}' s (want ~${IDLE}s)"; fi
        if [[ $pfail == 0 ]] && python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < 2 else 1)" "${pmax:-99}"; then
            pass "other requests served meanwhile (slowest ${pmax}s, no failures)"
        else
            fail "other requests while stalled: slowest '${pmax}' s, $pfail failed"
        fi
        printf 'stalled-upload-marker-0123456789' >"$E2E_TMP/marker"
        http_req HEAD "$R/v2/bad/slow/blobs/$(sha_of "$E2E_TMP/marker")"
        if [[ $HTTP_CODE == 404 ]]; then
            pass "nothing of the stalled upload is served as a blob (HEAD -> 404)"
        else
            fail "the stalled upload's bytes are served as a blob (HEAD -> $HTTP_CODE)"
        fi
    else
        fail "slow client: POST upload -> $HTTP_CODE"
    fi
fi

# ================================================================ 7. chunked upload order
printf 'AAAAAAAAAA' >"$E2E_TMP/c1"
printf 'BBBBBBBBBB' >"$E2E_TMP/c2"
printf 'CCCCCCCCCC' >"$E2E_TMP/c3"
cat "$E2E_TMP/c1" "$E2E_TMP/c2" "$E2E_TMP/c3" >"$E2E_TMP/c123"
if start_upload bad/chunks; then
    patch() { req "PATCH $2" PATCH "$LOC" -H 'Content-Type: application/octet-stream' -H "Content-Range: $2" --data-binary "@$1"; }
    patch "$E2E_TMP/c1" 0-9
    if [[ $HTTP_CODE == 202 && $(http_header range) == 0-9 ]]; then
        pass "PATCH 0-9 -> 202, Range: 0-9"
        LOC=$(abs_location)
    else
        fail "PATCH 0-9 -> $HTTP_CODE, Range '$(http_header range)'"
    fi
    patch "$E2E_TMP/c3" 20-29
    expect "PATCH 20-29 after 0-9 (out of order)" 416 -
    patch "$E2E_TMP/c1" 0-9
    expect "PATCH 0-9 again (overlapping)" 416 -
    patch "$E2E_TMP/c2" 10-19
    [[ $HTTP_CODE == 202 ]] && LOC=$(abs_location)
    patch "$E2E_TMP/c3" 20-29
    [[ $HTTP_CODE == 202 ]] && LOC=$(abs_location)
    req "PUT finish chunks" PUT "$(with_query "$LOC" "digest=$(sha_of "$E2E_TMP/c123")")"
    code=$HTTP_CODE
    req "GET chunked blob" GET "$R/v2/bad/chunks/blobs/$(sha_of "$E2E_TMP/c123")"
    if [[ $code == 201 && $HTTP_CODE == 200 ]] && cmp -s "$HTTP_BODY" "$E2E_TMP/c123"; then
        pass "after the 416s the upload continued in order and completed (201, GET returns the 30 bytes)"
    else
        fail "chunked upload after 416: PUT -> $code, GET -> $HTTP_CODE"
    fi
else
    fail "chunked: POST upload -> $HTTP_CODE"
fi

# upload sessions: bound to their repository, cancellable, ids not paths
if start_upload bad/sess; then
    id=${LOC%%\?*}
    id=${id##*/}
    other=${LOC/\/bad\/sess\//\/bad\/other\/}
    req "PATCH upload via other repo" PATCH "$other" -H 'Content-Type: application/octet-stream' --data-binary 'xx'
    c1=$HTTP_CODE
    req "GET upload id with dots" GET "$R/v2/bad/sess/blobs/uploads/..%2f..%2f$id"
    c2=$HTTP_CODE
    req "DELETE upload" DELETE "$LOC"
    c3=$HTTP_CODE
    req "PATCH cancelled upload" PATCH "$LOC" -H 'Content-Type: application/octet-stream' --data-binary 'yy'
    c4=$HTTP_CODE
    if [[ $c1 == 404 && ($c2 == 404 || $c2 == 400) && ($c3 == 204 || $c3 == 202 || $c3 == 200) && $c4 == 404 ]] &&
        [[ $(error_codes) == *BLOB_UPLOAD_UNKNOWN* ]]; then
        pass "upload session: PATCH through another repository -> 404, '..%2f' id -> $c2, DELETE -> $c3, then PATCH -> 404 BLOB_UPLOAD_UNKNOWN"
    else
        fail "upload session: via other repo $c1 (want 404), dotted id $c2 (want 404/400), DELETE $c3 (want 204), PATCH after cancel $c4 '$(error_codes)' (want 404 BLOB_UPLOAD_UNKNOWN)"
    fi
else
    fail "upload session: POST -> $HTTP_CODE"
fi

# blob size limit (max_blob_bytes = 8 MiB): declared and streamed
if ! baseline_skip "blob size limit (distribution 2.8 has none)"; then
    if start_upload bad/big; then
        ans=$(python3 "$E2E_TMP/early.py" "${REG_ADDR%:*}" "${REG_ADDR##*:}" "/${LOC#http://*/}" PATCH 2>&1) || true
        if [[ $ans == HTTP/1.1\ 413* ]]; then
            pass "PATCH declaring 1 GiB > max_blob_bytes answered early: $ans"
        else
            fail "PATCH declaring 1 GiB > max_blob_bytes: '$ans' (want an early 413)"
        fi
    fi
    if start_upload bad/big; then
        req "PATCH 16 MiB chunked blob" PATCH "$LOC" -H 'Content-Type: application/octet-stream' -H 'Expect:' -T - \
            < <(head -c $((16 << 20)) /dev/zero)
        c1=$HTTP_CODE
        http_req HEAD "$R/v2/bad/big/blobs/sha256:$(head -c $((16 << 20)) /dev/zero | sha256sum | cut -d' ' -f1)"
        if [[ ($c1 == 413 || $c1 == 000) && $HTTP_CODE == 404 ]]; then
            pass "16 MiB streamed blob (> max_blob_bytes) refused ($c1), not stored"
        else
            fail "16 MiB streamed blob: PATCH -> $c1 (want 413), HEAD -> $HTTP_CODE (want 404)"
        fi
    fi
fi

# ================================================================ 8. Range
B="$R/v2/bad/small/blobs/$BIG_LAYER"
BLOB=$SMALL/blobs/sha256/${BIG_LAYER#sha256:}
req "GET Range 0-99" GET "$B" -H 'Range: bytes=0-99'
if [[ $HTTP_CODE == 206 ]] && cmp -s "$HTTP_BODY" <(head -c 100 "$BLOB"); then
    pass "Range: bytes=0-99 -> 206, the first 100 bytes ($(http_header content-range))"
else
    fail "Range: bytes=0-99 -> $HTTP_CODE, $(stat -c %s "$HTTP_BODY") bytes"
fi
req "GET Range -10" GET "$B" -H 'Range: bytes=-10'
if [[ $HTTP_CODE == 206 ]] && cmp -s "$HTTP_BODY" <(tail -c 10 "$BLOB"); then
    pass "Range: bytes=-10 (suffix) -> 206, the last 10 bytes"
else
    fail "Range: bytes=-10 -> $HTTP_CODE, $(stat -c %s "$HTTP_BODY") bytes"
fi
req "GET Range beyond end" GET "$B" -H "Range: bytes=$BIG_SIZE-"
cr=$(http_header content-range)
if [[ $HTTP_CODE == 416 && $cr == "bytes */$BIG_SIZE" ]]; then
    pass "Range: bytes=$BIG_SIZE- (past the end) -> 416, Content-Range: $cr"
else
    fail "Range: bytes=$BIG_SIZE- -> $HTTP_CODE, Content-Range '$cr' (want 416, bytes */$BIG_SIZE)"
fi

# ================================================================ 9. error bodies
if [[ ${#ERR_BAD[@]} == 0 && $ERR_SEEN -gt 10 ]]; then
    pass "all $ERR_SEEN error responses are JSON {\"errors\":[{code,message}...]}"
else
    fail "$ERR_SEEN error responses, ${#ERR_BAD[@]} without a JSON errors array:"
    printf '    | %s\n' "${ERR_BAD[@]:0:8}"
fi

# ================================================================ 10. still alive
rm -rf "$E2E_TMP/after"
if kill -0 "$REG_PID" 2>/dev/null &&
    timeout 120 skopeo --policy "$POLICY" copy --src-tls-verify=false "docker://$REG_ADDR/bad/small:v1" \
        "oci:$E2E_TMP/after:v1" >"$E2E_TMP/after.log" 2>&1; then
    m=$(oci_manifest "$E2E_TMP/after" v1)
    got=$(jq -r '.manifests[0].digest' "$E2E_TMP/after/index.json")
    if [[ $got == "$SRC_DIGEST" && $(jq -r .config.digest <<<"$m") == "$SRC_CONFIG" &&
        $(jq -r '[.layers[].digest] | join(" ")' <<<"$m") == "$SRC_LAYERS" ]]; then
        pass "server alive (pid $REG_PID) and a normal skopeo pull gives the source digests"
    else
        fail "pull after bad input: digest $got (want $SRC_DIGEST)"
    fi
else
    fail "server dead or pull failed after bad input (pid $REG_PID alive: $(kill -0 "$REG_PID" 2>/dev/null && echo yes || echo no))"
    show "$E2E_TMP/after.log"; show "$REG_LOG" 10
fi
cd "$FERRY_ROOT"
e2e_summary
