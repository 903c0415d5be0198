#!/usr/bin/env bash
# tests/security/registry_gc_race.sh — issue 11 #6, the residual: `ferry registry gc` in
# its own process deciding to remove a blob a moment before a manifest push re-checks and
# refreshes it, and removing it after the push committed: a tag pointing at a blob that
# 404s.
#
# The server (fs storage) takes image pushes from three clients at once for a few
# seconds while `ferry registry gc --grace 0s --delete-untagged` runs back to back on the
# same root (grace 0: every blob not yet referenced is garbage, so the collections race
# every push's window between its blob uploads and its manifest). A push whose manifest
# is refused (MANIFEST_BLOB_UNKNOWN: the collection won before the commit, or the push
# noticed it lost and undid its commit) pushes its blobs again and retries.
#  1. every manifest PUT answered 201 or MANIFEST_BLOB_UNKNOWN (nothing else)
#  2. every tag answered 201 pulls whole after the race: manifest and every blob, bytes
#     verified — and still after one more collection
#  3. no collection failed, and none left a `running` or `deleting` record behind (a
#     pin written just as its collection ended may stay until the lease reaps it)
# The collections' reports (how many removals a push's pin spared) show the window was
# hit; the run is bounded in time (RACE_SECONDS, default 6) and stays on loopback.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need_cmd curl jq python3 sha256sum
find_ferry
e2e_init
: >"$E2E_TMP/reg.toml"
start_ferry_registry reg "$E2E_TMP/reg.toml" || { fail "start ferry registry"; e2e_summary; exit 1; }
R=http://$REG_ADDR
SECS=${RACE_SECONDS:-6}

# Collections back to back until the pushers are done.
: >"$E2E_TMP/gc.log"
(
    while [[ ! -e $E2E_TMP/pushers.done ]]; do
        if ! "$FERRY" registry gc --root "$REG_DATA" --grace 0s --delete-untagged >>"$E2E_TMP/gc.log" 2>&1; then
            echo "GC FAILED" >>"$E2E_TMP/gc.log"
        fi
    done
) &
GC_LOOP=$!

python3 - "$R" "$SECS" >"$E2E_TMP/pushes.json" 2>"$E2E_TMP/pushers.err" <<'PY' || true
import hashlib, http.client, json, os, sys, threading, time, urllib.parse
base, secs = sys.argv[1], float(sys.argv[2])
u = urllib.parse.urlparse(base)
deadline = time.time() + secs
results, lock = [], threading.Lock()

def req(conn, method, path, body=b"", headers=None):
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    return r.status, r.read()

def push_blob(conn, repo, data):
    d = "sha256:" + hashlib.sha256(data).hexdigest()
    st, _ = req(conn, "POST", f"/v2/{repo}/blobs/uploads/?digest={d}", data,
                {"Content-Type": "application/octet-stream"})
    return d, st

def pusher(n):
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    i = 0
    while time.time() < deadline:
        i += 1
        repo, tag = f"race/p{n}", f"r{i}"
        config = json.dumps({"architecture": "amd64", "os": "linux", "n": n, "i": i}).encode()
        layer = os.urandom(2048)
        codes = []
        for attempt in range(5):
            cd, c1 = push_blob(conn, repo, config)
            ld, c2 = push_blob(conn, repo, layer)
            m = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": len(config)},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": ld, "size": len(layer)}]}).encode()
            st, body = req(conn, "PUT", f"/v2/{repo}/manifests/{tag}", m,
                           {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
            try:
                code = json.loads(body)["errors"][0]["code"] if st != 201 else ""
            except Exception:
                code = "?"
            codes.append(f"{c1}/{c2}/{st}{':' + code if code else ''}")
            if st == 201:
                break
        with lock:
            results.append({"repo": repo, "tag": tag, "codes": codes, "ok": codes[-1].endswith("/201"),
                            "layer": layer.hex(), "config": config.decode(), "ld": ld, "cd": cd})

threads = [threading.Thread(target=pusher, args=(n,)) for n in range(3)]
for t in threads: t.start()
for t in threads: t.join()
json.dump(results, sys.stdout)
PY
touch "$E2E_TMP/pushers.done"
wait "$GC_LOOP" 2>/dev/null || true

total=$(jq length "$E2E_TMP/pushes.json" 2>/dev/null || echo 0)
ok=$(jq '[.[] | select(.ok)] | length' "$E2E_TMP/pushes.json" 2>/dev/null || echo 0)
refused=$(jq '[.[].codes[] | select(endswith("MANIFEST_BLOB_UNKNOWN"))] | length' "$E2E_TMP/pushes.json" 2>/dev/null || echo 0)
odd=$(jq -r '[.[].codes[] | select((endswith("/201") or endswith("MANIFEST_BLOB_UNKNOWN") ) | not)] | join(" ")' "$E2E_TMP/pushes.json" 2>/dev/null || echo '?')
runs=$(grep -c 'repositories:' "$E2E_TMP/gc.log" || true)
pinned=$({ grep -o '[0-9]* pinned by pushes' "$E2E_TMP/gc.log" || true; } | awk '{s += $1} END {print s + 0}')
echo "    | $total images pushed ($ok tagged), $refused manifest PUTs refused and retried; $runs collections, $pinned removals spared by a push's pin"
[[ -s $E2E_TMP/pushers.err ]] && show "$E2E_TMP/pushers.err"
if [[ $total -gt 0 && -z $odd ]]; then
    pass "1. $total pushes: every manifest PUT answered 201 or MANIFEST_BLOB_UNKNOWN"
else
    fail "1. pushes: $total, odd answers: ${odd:-none}"
fi

check_tags() {
    local when=$1 out
    out=$(python3 - "$R" "$E2E_TMP/pushes.json" <<'PY'
import hashlib, http.client, json, sys, urllib.parse
u = urllib.parse.urlparse(sys.argv[1])
conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
def get(path, accept=None):
    conn.request("GET", path, headers={"Accept": accept} if accept else {})
    r = conn.getresponse()
    return r.status, r.read()
bad, ok = [], 0
for p in json.load(open(sys.argv[2])):
    if not p["ok"]:
        continue
    ok += 1
    st, _ = get(f"/v2/{p['repo']}/manifests/{p['tag']}", "application/vnd.oci.image.manifest.v1+json")
    if st != 200:
        bad.append(f"{p['repo']}:{p['tag']} manifest {st}")
        continue
    for what in ("ld", "cd"):
        st, body = get(f"/v2/{p['repo']}/blobs/{p[what]}")
        if st != 200 or "sha256:" + hashlib.sha256(body).hexdigest() != p[what]:
            bad.append(f"{p['repo']}:{p['tag']} {what} {st}")
print(ok, len(bad), " ".join(bad[:6]))
PY
)
    read -r nok nbad rest <<<"$out"
    if [[ $nbad == 0 && $nok -gt 0 ]]; then
        pass "2. $when: all $nok tags pull whole"
    else
        fail "2. $when: $nbad of $nok tags broken: $rest"
    fi
}
check_tags "after the race"
"$FERRY" registry gc --root "$REG_DATA" --grace 0s --delete-untagged >>"$E2E_TMP/gc.log" 2>&1 || echo "GC FAILED" >>"$E2E_TMP/gc.log"
check_tags "after one more collection"

left=$(find "$REG_DATA/gc/running" "$REG_DATA/gc/deleting" -type f 2>/dev/null | wc -l)
orphans=$(find "$REG_DATA/gc/pins" -type f 2>/dev/null | wc -l)
if ! grep -q 'GC FAILED' "$E2E_TMP/gc.log" && [[ $left == 0 ]]; then
    pass "3. $((runs + 1)) collections ran, none failed, none left a running or removal record ($orphans late pins left for the lease to reap)"
else
    fail "3. collections failed or left $left records: $(grep -B3 'GC FAILED' "$E2E_TMP/gc.log" | head -8 | tr '\n' ' ')"
fi
e2e_summary
