#!/usr/bin/env bash
# tests/security/registry_pullthrough_flight.sh — issue 11 #4: a pull-through request
# never joins an upstream download it may not see, and never inherits a doomed one.
#
# Upstream: a ferry registry whose repository a/priv holds blobs that b/pub does not, behind
# a small proxy that delays every blob GET by 1.5 s (so downloads are in flight long
# enough to be joined). Front: `ferry registry serve` with [upstream] at the proxy.
#  1. doomed download: eve asks for a/priv's blob through b/pub (upstream: 404); 0.3 s
#     later alice asks through a/priv -> alice gets 200 with the right bytes (not eve's 404)
#  2. cross-repository join: 10 rounds, each firing alice (a/priv) and 4 x eve (b/pub) at
#     once for a fresh blob -> eve never receives a byte of it (404 every time), alice
#     always the right bytes
#  3. afterwards (the blob cached on the front's disk) eve's GET and HEAD through b/pub
#     are still 404
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need_cmd curl python3 sha256sum
find_ferry
e2e_init
: >"$E2E_TMP/up.toml"
start_ferry_registry upstream "$E2E_TMP/up.toml" || { fail "start upstream"; e2e_summary; exit 1; }
UP=$REG_ADDR
R=http://$UP
for i in $(seq 0 11); do
    head -c $((1 << 20)) /dev/urandom >"$E2E_TMP/blob$i"
    code=$(sec_push_blob a/priv "$E2E_TMP/blob$i")
    [[ $code == 201 ]] || fail "setup: upstream push blob$i -> $code"
done
echo other >"$E2E_TMP/other"
sec_push_blob b/pub "$E2E_TMP/other" >/dev/null

PROXY_PORT=$(free_port)
cat >"$E2E_TMP/proxy.py" <<'PY'
# Forwards to the upstream registry; every blob GET waits DELAY seconds first.
import http.client, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
up_host, up_port, port, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def fwd(self):
        if self.command == "GET" and "/blobs/sha256:" in self.path:
            time.sleep(delay)
        c = http.client.HTTPConnection(up_host, up_port, timeout=30)
        hdrs = {k: v for k, v in self.headers.items() if k.lower() in ("accept", "range", "authorization")}
        c.request(self.command, self.path, headers=hdrs)
        r = c.getresponse()
        body = r.read()
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() in ("content-type", "docker-content-digest", "content-range", "www-authenticate", "etag"):
                self.send_header(k, v)
        self.send_header("Content-Length", r.getheader("Content-Length") or str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
    do_GET = do_HEAD = fwd
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
PY
python3 "$E2E_TMP/proxy.py" "${UP%:*}" "${UP##*:}" "$PROXY_PORT" 1.5 >"$E2E_TMP/proxy.log" 2>&1 &
E2E_PIDS+=($!)
cat >"$E2E_TMP/front.toml" <<TOML
[upstream]
url = "http://127.0.0.1:$PROXY_PORT"
plain_http = true
TOML
start_ferry_registry front "$E2E_TMP/front.toml" || { fail "start front"; e2e_summary; exit 1; }
F=http://$REG_ADDR

python3 - "$F" "$E2E_TMP" >"$E2E_TMP/flight.out" <<'PY'
import hashlib, sys, threading, time, urllib.request, urllib.error
front, tmp = sys.argv[1], sys.argv[2]
def digest(i):
    return "sha256:" + hashlib.sha256(open(f"{tmp}/blob{i}", "rb").read()).hexdigest()
def get(repo, d, method="GET"):
    req = urllib.request.Request(f"{front}/v2/{repo}/blobs/{d}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except Exception as e:
        return 0, str(e).encode()
# 1. alice joins after eve's doomed download started
res = {}
d = digest(0)
te = threading.Thread(target=lambda: res.__setitem__("eve", get("b/pub", d)))
te.start()
time.sleep(0.3)
res["alice"] = get("a/priv", d)
te.join()
want = open(f"{tmp}/blob0", "rb").read()
print("doomed eve", res["eve"][0], "alice", res["alice"][0], "right" if res["alice"][1] == want else "wrong")
# 2. ten races
leaks, alice_bad = 0, 0
for i in range(1, 11):
    d = digest(i)
    want = open(f"{tmp}/blob{i}", "rb").read()
    out = {}
    barrier = threading.Barrier(5)
    def run(name, repo):
        barrier.wait()
        out[name] = get(repo, d)
    ts = [threading.Thread(target=run, args=("alice", "a/priv"))] + [
        threading.Thread(target=run, args=(f"eve{k}", "b/pub")) for k in range(4)]
    for t in ts: t.start()
    for t in ts: t.join()
    for k in range(4):
        s, body = out[f"eve{k}"]
        if s == 200 or (body and body in want):
            leaks += 1
    if out["alice"][0] != 200 or out["alice"][1] != want:
        alice_bad += 1
print("races leaks", leaks, "alice_bad", alice_bad)
# 3. cached on the front now
d = digest(1)
print("cached eve", get("b/pub", d)[0], get("b/pub", d, "HEAD")[0], "alice", get("a/priv", d)[0])
PY
sed 's/^/    | /' "$E2E_TMP/flight.out"
read -r _ _ es _ as ar <<<"$(grep '^doomed' "$E2E_TMP/flight.out")"
[[ $es == 404 && $as == 200 && $ar == right ]] && pass "1. alice after eve's doomed download: eve $es, alice $as with the right bytes" ||
    fail "1. eve ${es:-?}, alice ${as:-?} ${ar:-?} (want eve 404, alice 200 right)"
read -r _ _ leaks _ abad <<<"$(grep '^races' "$E2E_TMP/flight.out")"
[[ $leaks == 0 ]] && pass "2. 40 concurrent cross-repository requests: eve received nothing" || fail "2. eve received a blob of a/priv through b/pub $leaks times"
[[ $abad == 0 ]] && pass "2. alice got the right bytes in every round" || fail "2. alice failed in $abad of 10 rounds"
read -r _ _ e1 e2 _ a1 <<<"$(grep '^cached' "$E2E_TMP/flight.out")"
[[ $e1 == 404 && $e2 == 404 && $a1 == 200 ]] && pass "3. cached blob: eve GET/HEAD through b/pub $e1/$e2, alice $a1" ||
    fail "3. cached blob: eve GET $e1 HEAD $e2, alice $a1 (want 404 404 200)"
e2e_summary
