#!/usr/bin/env bash
# tests/security/registry_kill_steps.sh — issue 11, durability: `kill -9` of
# `ferry registry serve` (fs storage) at each step of a blob upload and of a manifest
# push, the server restarted on the same root after each kill.
#
#  1. after POST (session open): the blob is not visible (HEAD 404); the session resumes
#     (PATCH 202, PUT 201) or is cleanly gone (404 BLOB_UPLOAD_UNKNOWN)
#  2. mid-PATCH (half of a declared 4 MiB chunk sent): not visible; the session reports a
#     prefix of what was sent (Range) and continuing from there gives the right blob, or
#     it is gone
#  3. after a complete PATCH: not visible (no PUT yet); the PUT after the restart commits
#     the right bytes (the hash is recomputed from disk), or the session is gone
#  4. during the completing PUT (the rest of the blob as its body, held half-sent): not
#     visible; the session goes on from what it holds, or is gone
#  5. as a 24 MiB monolithic PUT is received and committed (kills at six delays, from late
#     in the body through hashing, fsync and rename to just after the answer): the blob
#     is absent or whole, never partial or wrong
#  6. mid-manifest PUT (half the body sent): no tag; right after a manifest PUT answered
#     201: the tag and every blob it names pull whole after the restart
#  In every case re-uploading afterwards works and verifies. Finally `ferry registry gc
#  --grace 0s` runs on the root and leaves a consistent store: every blob file hashes to
#  its name, every manifest link and tag points at a stored manifest, the tagged image
#  pulls whole.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need_cmd curl jq python3 sha256sum
find_ferry
e2e_init
: >"$E2E_TMP/reg.toml"
REG_ADDR=127.0.0.1:$(free_port)
start_ferry_registry reg "$E2E_TMP/reg.toml" "$REG_ADDR" || { fail "start ferry registry"; e2e_summary; exit 1; }
ADDR=$REG_ADDR
R=http://$ADDR
REPO=kill/app

kill_and_restart() {
    kill -9 "$REG_PID"
    wait "$REG_PID" 2>/dev/null || true
    "$FERRY" registry serve --config "$E2E_TMP/reg.toml" --addr "$ADDR" --root "$REG_DATA" >>"$REG_LOG" 2>&1 &
    REG_PID=$!
    E2E_PIDS+=("$REG_PID")
    _wait_registry_up "ferry registry (after kill -9: $1)" >/dev/null 2>&1 || { fail "$1: restart after kill -9"; e2e_summary; exit 1; }
}
abs() { [[ $1 == http* ]] && echo "$1" || echo "$R$1"; }
with_digest() { local sep='?'; [[ $1 == *\?* ]] && sep='&'; echo "$1${sep}digest=$2"; }
# Held request: raw HTTP, headers plus the first $4 bytes of file $3 of a body declared
# $5 bytes long, then it waits (killed with the server). Prints nothing.
held() {
    python3 - "${ADDR%:*}" "${ADDR##*:}" "$1" "$2" "$3" "$4" "$5" "${6:-application/octet-stream}" <<'PY' &
import socket, sys, time
host, port, method, path, f, send, total, ctype = sys.argv[1:9]
data = open(f, "rb").read()[: int(send)]
s = socket.create_connection((host, int(port)))
s.sendall((f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n"
           f"Content-Length: {total}\r\n\r\n").encode())
s.sendall(data)
time.sleep(60)
PY
    HELD=$!
}
path_of() { local u=$1; u=${u#http://*/}; echo "/$u"; }
visible() { http_req HEAD "$R/v2/$REPO/blobs/$1"; [[ $HTTP_CODE == 200 ]]; }
# The session at $1 after a restart: prints "gone", or the size it holds.
session_state() {
    http_req GET "$1"
    if [[ $HTTP_CODE == 404 ]]; then
        [[ $(jq -r '.errors[0].code' "$HTTP_BODY" 2>/dev/null) == BLOB_UPLOAD_UNKNOWN ]] && echo gone || echo "404-not-upload-unknown"
    elif [[ $HTTP_CODE == 204 ]]; then
        # "0-0" is both empty and one byte (the distribution convention); this test never
        # leaves a session at one byte.
        local r; r=$(http_header range)
        [[ -z $r || $r == 0-0 ]] && echo 0 || echo $((${r#*-} + 1))
    else
        echo "status-$HTTP_CODE"
    fi
}
# Continues session $1 (holding $2 bytes) with the rest of file $3; prints PATCH/PUT codes.
finish_from() {
    local loc=$1 have=$2 file=$3 d; d=$(sha_of "$file")
    tail -c +$((have + 1)) "$file" >"$E2E_TMP/rest"
    local size; size=$(stat -c %s "$E2E_TMP/rest")
    local pc=skip
    if ((size > 0)); then
        http_req PATCH "$loc" -H 'Content-Type: application/octet-stream' -H "Content-Range: $have-$((have + size - 1))" --data-binary "@$E2E_TMP/rest"
        pc=$HTTP_CODE
        loc=$(abs "$(http_header location)")
    fi
    http_req PUT "$(with_digest "$loc" "$d")" -H 'Content-Length: 0'
    echo "$pc/$HTTP_CODE"
}
pulls_whole() { http_req GET "$R/v2/$REPO/blobs/$(sha_of "$1")"; [[ $HTTP_CODE == 200 ]] && cmp -s "$HTTP_BODY" "$1"; }
repush_ok() { [[ $(sec_push_blob "$REPO" "$1") == 201 ]] && pulls_whole "$1"; }
start_session() { http_req POST "$R/v2/$REPO/blobs/uploads/"; abs "$(http_header location)"; }

# ---------------------------------------------------------------- 1. after POST
head -c $((3 << 20)) /dev/urandom >"$E2E_TMP/b1"
LOC=$(start_session)
kill_and_restart "after POST"
v=no; visible "$(sha_of "$E2E_TMP/b1")" && v=yes
st=$(session_state "$LOC")
res=gone
[[ $st =~ ^[0-9]+$ ]] && res=$(finish_from "$LOC" "$st" "$E2E_TMP/b1")
if [[ $v == no && ($st == gone || ($st == 0 && $res == 202/201)) ]] && pulls_whole "$E2E_TMP/b1" 2>/dev/null || { [[ $v == no && $st == gone ]] && repush_ok "$E2E_TMP/b1"; }; then
    pass "1. kill after POST: not visible, session $st, resumed $res, blob whole"
else
    fail "1. kill after POST: visible=$v session=$st resumed=$res"
fi

# ---------------------------------------------------------------- 2. mid-PATCH
head -c $((4 << 20)) /dev/urandom >"$E2E_TMP/b2"
LOC=$(start_session)
held PATCH "$(path_of "$LOC")" "$E2E_TMP/b2" $((2 << 20)) $((4 << 20))
sleep 1
kill_and_restart "mid-PATCH"
kill "$HELD" 2>/dev/null || true
v=no; visible "$(sha_of "$E2E_TMP/b2")" && v=yes
st=$(session_state "$LOC")
res=gone
[[ $st =~ ^[0-9]+$ ]] && res=$(finish_from "$LOC" "$st" "$E2E_TMP/b2")
if [[ $v == no && ($st == gone || ($st =~ ^[0-9]+$ && $st -le $((2 << 20)) && $res =~ ^(202|skip)/201$)) ]] && { pulls_whole "$E2E_TMP/b2" || [[ $st == gone ]]; }; then
    pass "2. kill mid-PATCH (2 of 4 MiB sent): not visible, session holds ${st} bytes (a prefix), continued $res"
else
    fail "2. kill mid-PATCH: visible=$v session=$st (want gone or <= $((2 << 20))) continued=$res"
fi
repush_ok "$E2E_TMP/b2" && pass "2. pushed again after the crash: verified" || fail "2. re-push after crash"

# ---------------------------------------------------------------- 3. after PATCH complete
head -c $((3 << 20)) /dev/urandom >"$E2E_TMP/b3"
LOC=$(start_session)
http_req PATCH "$LOC" -H 'Content-Type: application/octet-stream' --data-binary "@$E2E_TMP/b3"
pc=$HTTP_CODE
LOC=$(abs "$(http_header location)")
kill_and_restart "after PATCH"
v=no; visible "$(sha_of "$E2E_TMP/b3")" && v=yes
st=$(session_state "$LOC")
res=gone
[[ $st =~ ^[0-9]+$ ]] && res=$(finish_from "$LOC" "$st" "$E2E_TMP/b3")
if [[ $pc == 202 && $v == no && ($st == gone || ($st == $((3 << 20)) && $res == skip/201)) ]] && { pulls_whole "$E2E_TMP/b3" || [[ $st == gone ]]; }; then
    pass "3. kill after a complete PATCH: not visible, session holds $st bytes, PUT after restart $res, blob whole"
else
    fail "3. kill after PATCH ($pc): visible=$v session=$st finished=$res"
fi

# ---------------------------------------------------------------- 4. during the completing PUT
head -c $((4 << 20)) /dev/urandom >"$E2E_TMP/b4"
head -c $((2 << 20)) "$E2E_TMP/b4" >"$E2E_TMP/b4.first"
tail -c +$(((2 << 20) + 1)) "$E2E_TMP/b4" >"$E2E_TMP/b4.rest"
LOC=$(start_session)
http_req PATCH "$LOC" -H 'Content-Type: application/octet-stream' --data-binary "@$E2E_TMP/b4.first"
LOC=$(abs "$(http_header location)")
held PUT "$(with_digest "$(path_of "$LOC")" "$(sha_of "$E2E_TMP/b4")")" "$E2E_TMP/b4.rest" $((1 << 20)) $((2 << 20))
sleep 1
kill_and_restart "during PUT"
kill "$HELD" 2>/dev/null || true
v=no; visible "$(sha_of "$E2E_TMP/b4")" && v=yes
st=$(session_state "$LOC")
res=gone
[[ $st =~ ^[0-9]+$ ]] && res=$(finish_from "$LOC" "$st" "$E2E_TMP/b4")
if [[ $v == no && ($st == gone || ($st =~ ^[0-9]+$ && $st -ge $((2 << 20)) && $st -le $((3 << 20)) && $res =~ ^(202|skip)/201$)) ]] && { pulls_whole "$E2E_TMP/b4" || [[ $st == gone ]]; }; then
    pass "4. kill during the completing PUT (1 of 2 MiB sent): not visible, session holds $st bytes, continued $res"
else
    fail "4. kill during PUT: visible=$v session=$st (want gone or 2-3 MiB) continued=$res"
fi
repush_ok "$E2E_TMP/b4" && pass "4. pushed again after the crash: verified" || fail "4. re-push after crash"

# ---------------------------------------------------------------- 5. around the rename
bad=()
i=0
for delay in 0.05 0.1 0.2 0.3 0.45 0.7; do
    i=$((i + 1))
    head -c $((24 << 20)) /dev/urandom >"$E2E_TMP/b5"
    D5=$(sha_of "$E2E_TMP/b5")
    curl -sS --noproxy '*' -o /dev/null -X POST -H 'Content-Type: application/octet-stream' \
        --data-binary "@$E2E_TMP/b5" "$R/v2/$REPO/blobs/uploads/?digest=$D5" 2>/dev/null &
    CURL=$!
    # Kills from late in the body to just after the answer: the server receiving,
    # hashing, fsyncing or renaming (or done).
    sleep "$delay"
    kill_and_restart "around the rename ($i)"
    kill "$CURL" 2>/dev/null || true
    http_req GET "$R/v2/$REPO/blobs/$D5"
    if [[ $HTTP_CODE == 200 ]]; then
        cmp -s "$HTTP_BODY" "$E2E_TMP/b5" || bad+=("$i:200-but-wrong-bytes")
        outcome+="whole "
    elif [[ $HTTP_CODE == 404 ]]; then
        outcome+="absent "
    else
        bad+=("$i:$HTTP_CODE")
    fi
    repush_ok "$E2E_TMP/b5" || bad+=("$i:repush")
done
[[ ${#bad[@]} == 0 ]] && pass "5. kill -9 as a 24 MiB monolithic PUT is received and committed, 6 delays: each blob absent or whole (${outcome% }), never partial; re-push verifies" ||
    fail "5. around the rename: ${bad[*]} (${outcome:-})"

# ---------------------------------------------------------------- 6. manifests
echo '{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}' >"$E2E_TMP/config.json"
head -c 8192 /dev/urandom >"$E2E_TMP/layer.bin"
c1=$(sec_push_blob "$REPO" "$E2E_TMP/config.json")
c2=$(sec_push_blob "$REPO" "$E2E_TMP/layer.bin")
jq -cn --arg c "$(sha_of "$E2E_TMP/config.json")" --argjson cs "$(stat -c %s "$E2E_TMP/config.json")" --arg l "$(sha_of "$E2E_TMP/layer.bin")" '{
  schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json",
  config: {mediaType: "application/vnd.oci.image.config.v1+json", digest: $c, size: $cs},
  layers: [{mediaType: "application/vnd.oci.image.layer.v1.tar", digest: $l, size: 8192}]}' >"$E2E_TMP/manifest.json"
MT=application/vnd.oci.image.manifest.v1+json
msize=$(stat -c %s "$E2E_TMP/manifest.json")
held PUT "/v2/$REPO/manifests/half" "$E2E_TMP/manifest.json" $((msize / 2)) "$msize" "$MT"
sleep 1
kill_and_restart "mid-manifest PUT"
kill "$HELD" 2>/dev/null || true
http_req GET "$R/v2/$REPO/manifests/half" -H "Accept: $MT"
[[ $c1$c2 == 201201 && $HTTP_CODE == 404 ]] && pass "6. kill mid-manifest PUT: no tag (404)" || fail "6. mid-manifest PUT: blobs $c1 $c2, tag -> $HTTP_CODE"
http_req PUT "$R/v2/$REPO/manifests/v1" -H "Content-Type: $MT" --data-binary "@$E2E_TMP/manifest.json"
m=$HTTP_CODE
kill_and_restart "after manifest PUT"
http_req GET "$R/v2/$REPO/manifests/v1" -H "Accept: $MT"
g=$HTTP_CODE
same=no; cmp -s "$HTTP_BODY" "$E2E_TMP/manifest.json" && same=yes
image_pulls() {
    http_req GET "$R/v2/$REPO/manifests/v1" -H "Accept: $MT"
    [[ $HTTP_CODE == 200 ]] || return 1
    http_req GET "$R/v2/$REPO/blobs/$(sha_of "$E2E_TMP/config.json")"
    [[ $HTTP_CODE == 200 ]] && cmp -s "$HTTP_BODY" "$E2E_TMP/config.json" || return 1
    http_req GET "$R/v2/$REPO/blobs/$(sha_of "$E2E_TMP/layer.bin")"
    [[ $HTTP_CODE == 200 ]] && cmp -s "$HTTP_BODY" "$E2E_TMP/layer.bin"
}
[[ $m == 201 && $g == 200 && $same == yes ]] && image_pulls && pass "6. kill right after a manifest PUT's 201: the tag and its blobs pull whole" ||
    fail "6. after manifest PUT ($m): tag GET $g, same bytes $same"

# ---------------------------------------------------------------- GC, then consistency
if "$FERRY" registry gc --root "$REG_DATA" --grace 0s >"$E2E_TMP/gc.log" 2>&1; then
    gcok=yes
else
    gcok=no
fi
python3 - "$REG_DATA" >"$E2E_TMP/consistency" <<'PY'
import hashlib, os, sys
root = sys.argv[1]
bad = []
blobs = set()
for dirpath, _, files in os.walk(os.path.join(root, "blobs", "sha256")):
    for f in files:
        h = hashlib.sha256(open(os.path.join(dirpath, f), "rb").read()).hexdigest()
        if h != f:
            bad.append(f"blob {f} hashes to {h}")
        blobs.add(f)
for dirpath, _, files in os.walk(os.path.join(root, "repositories")):
    for f in files:
        p = os.path.join(dirpath, f)
        if "/_manifests/revisions/sha256" in dirpath and f not in blobs:
            bad.append(f"manifest link {p} without its blob")
        if dirpath.endswith("/_manifests/tags"):
            d = open(p).read().strip().removeprefix("sha256:")
            rev = os.path.join(os.path.dirname(dirpath), "revisions", "sha256", d)
            if d not in blobs or not os.path.exists(rev):
                bad.append(f"tag {p} -> {d} not stored")
print(len(blobs), len(bad), "; ".join(bad[:5]))
PY
read -r nblobs nbad rest <"$E2E_TMP/consistency"
if [[ $gcok == yes && $nbad == 0 ]] && image_pulls; then
    pass "7. gc after the crashes ($(tail -1 "$E2E_TMP/gc.log" | cut -d';' -f1)): $nblobs blobs all hash to their names, links and tags consistent, the tagged image pulls whole"
else
    fail "7. gc ran: $gcok; $nbad inconsistencies: $rest"
fi
e2e_summary
