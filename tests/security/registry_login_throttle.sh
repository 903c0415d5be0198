#!/usr/bin/env bash
# tests/security/registry_login_throttle.sh — issue 11 #7: a flood of wrong passwords
# must not buy unlimited bcrypt runs.
#
# Token auth with a bcrypt cost-10 htpasswd (the common default). An attacker on
# 127.0.0.2 sends 64 parallel streams of wrong Basic passwords (for alice and for
# made-up users) for 8 s, while alice on 127.0.0.1 uses a cached bearer token.
#  1. the attacker is throttled: answers include 429 TOOMANYREQUESTS with Retry-After, and
#     at most a few dozen of its attempts were checked (401s)
#  2. alice's cached-token requests stay fast during the flood (the slowest < 1 s; on main
#     they stalled for seconds behind the bcrypt runs)
#  3. alice (another client) can still log in with her password (token 200) — bob's user
#     budget is untouched, so bob can too
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need_cmd curl jq python3 htpasswd
find_ferry
e2e_init
: >"$E2E_TMP/htpasswd"
htpasswd -bB -C 10 "$E2E_TMP/htpasswd" alice alice-pw 2>/dev/null
htpasswd -bB -C 10 "$E2E_TMP/htpasswd" bob bob-pw 2>/dev/null
cat >"$E2E_TMP/reg.toml" <<TOML
[auth]
htpasswd = "$E2E_TMP/htpasswd"
secret = "security-test-secret-not-for-production"
TOML
start_ferry_registry reg "$E2E_TMP/reg.toml" || { fail "start ferry registry"; e2e_summary; exit 1; }
R=http://$REG_ADDR
echo x >"$E2E_TMP/x"
code=$(sec_push_blob alice/app "$E2E_TMP/x" -u alice:alice-pw)
[[ $code == 201 ]] || fail "setup: push -> $code"
TOKEN=$(sec_token alice alice-pw "repository:alice/app:pull")
python3 - "${REG_ADDR%:*}" "${REG_ADDR##*:}" "$TOKEN" "$(sha_of "$E2E_TMP/x")" >"$E2E_TMP/flood.out" <<'PY'
import base64, collections, http.client, statistics, sys, threading, time
host, port, token, digest = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
stop = time.monotonic() + 8
codes = collections.Counter()
retry_after = []
lock = threading.Lock()

class Src(http.client.HTTPConnection):
    def connect(self):
        import socket
        self.sock = socket.create_connection((self.host, self.port), 10, ("127.0.0.2", 0))

def attacker(i):
    n = 0
    while time.monotonic() < stop:
        user = "alice" if i % 2 else f"guess{i}-{n}"
        cred = base64.b64encode(f"{user}:wrong-{n}".encode()).decode()
        n += 1
        try:
            c = Src(host, port, timeout=10)
            c.request("GET", "/v2/alice/app/tags/list", headers={"Authorization": "Basic " + cred})
            r = c.getresponse()
            r.read()
            with lock:
                codes[r.status] += 1
                if r.status == 429:
                    retry_after.append(r.getheader("Retry-After"))
            c.close()
        except Exception as e:
            with lock:
                codes["err"] += 1

threads = [threading.Thread(target=attacker, args=(i,)) for i in range(64)]
for t in threads:
    t.start()
time.sleep(1)
lat = []
c = http.client.HTTPConnection(host, port, timeout=10)
while time.monotonic() < stop - 0.5:
    t0 = time.monotonic()
    c.request("HEAD", f"/v2/alice/app/blobs/{digest}", headers={"Authorization": "Bearer " + token})
    r = c.getresponse()
    r.read()
    lat.append((time.monotonic() - t0, r.status))
    time.sleep(0.05)
for t in threads:
    t.join()
print("codes", " ".join(f"{k}={v}" for k, v in sorted(codes.items(), key=str)))
print("retry_after", retry_after[0] if retry_after else "none")
ok = [l for l, s in lat if s == 200]
print("legit", len(ok), len(lat), f"{statistics.median(ok) if ok else 99:.4f}", f"{max(ok) if ok else 99:.4f}")
PY
sed 's/^/    | /' "$E2E_TMP/flood.out"
codes=$(awk '$1 == "codes"' "$E2E_TMP/flood.out")
n429=$(grep -o '429=[0-9]*' <<<"$codes" | cut -d= -f2 || true)
n401=$(grep -o '401=[0-9]*' <<<"$codes" | cut -d= -f2 || true)
ra=$(awk '$1 == "retry_after" { print $2 }' "$E2E_TMP/flood.out")
if [[ ${n429:-0} -gt 0 && $ra =~ ^[0-9]+$ && ${n401:-0} -le 60 ]]; then
    pass "1. the flood is throttled: ${n429} x 429 (Retry-After $ra), only ${n401:-0} passwords checked"
else
    fail "1. flood answers: $codes (want 429s with Retry-After and <= 60 checked)"
fi
read -r _ nok nall med worst <<<"$(awk '$1 == "legit"' "$E2E_TMP/flood.out")"
if [[ $nok == "$nall" && $nok -gt 0 ]] && python3 -c "import sys; sys.exit(0 if float('$worst') < 1.0 else 1)"; then
    pass "2. cached-token requests during the flood: $nok, median ${med}s, max ${worst}s"
else
    fail "2. cached-token requests during the flood: $nok of $nall ok, median ${med:-?}s, max ${worst:-?}s (want all ok, max < 1 s)"
fi
t1=$(sec_token alice alice-pw "repository:alice/app:pull")
t2=$(sec_token bob bob-pw "repository:bob/app:pull")
[[ -n $t2 && $t2 != null ]] && pass "3. bob logs in meanwhile (token issued)" || fail "3. bob's login refused"
if [[ -n $t1 && $t1 != null ]]; then
    pass "3. alice logs in from another client after the flood (token issued)"
else
    sleep 3
    t1=$(sec_token alice alice-pw "repository:alice/app:pull")
    [[ -n $t1 && $t1 != null ]] && pass "3. alice logs in after her user budget refilled (3 s)" || fail "3. alice's login refused"
fi
e2e_summary
