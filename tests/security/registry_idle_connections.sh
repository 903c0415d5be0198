#!/usr/bin/env bash
# tests/security/registry_idle_connections.sh — issue 11 #3: connections that send
# nothing must not lock everyone out.
#
# max_connections = 40, max_connections_per_client = 10, header_read_timeout = 2 s,
# idle_timeout = 3 s. An attacker on 127.0.0.2 (no credentials):
#  1. opens 60 TCP connections and sends nothing: at most 10 stay open (the rest are
#     closed at once), and a client on 127.0.0.1 is answered within 2 s meanwhile
#  2. those silent connections are closed by the server within 2 s + slack (8 s)
#  3. an HTTP/2 (h2c prior knowledge) connection that sends the preface and SETTINGS but no
#     request is closed within 8 s
#  4. a keep-alive connection idle after one request is closed within 3 s + slack (9 s)
#  5. a client that requests a 32 MiB blob and never reads is cut off within 3 s + slack
#  and afterwards the registry still answers.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need_cmd curl python3 sha256sum
find_ferry
e2e_init
cat >"$E2E_TMP/reg.toml" <<TOML
[limits]
max_connections = 40
max_connections_per_client = 10
header_read_timeout = "2s"
idle_timeout = "3s"
TOML
start_ferry_registry reg "$E2E_TMP/reg.toml" || { fail "start ferry registry"; e2e_summary; exit 1; }
R=http://$REG_ADDR
head -c $((32 << 20)) /dev/urandom >"$E2E_TMP/big.bin"
code=$(sec_push_blob idle/big "$E2E_TMP/big.bin")
[[ $code == 201 ]] || fail "setup: push of a 32 MiB blob -> $code"

python3 - "${REG_ADDR%:*}" "${REG_ADDR##*:}" "$(sha_of "$E2E_TMP/big.bin")" >"$E2E_TMP/attack.out" 2>&1 <<'PY' || true
import socket, subprocess, sys, time
host, port, digest = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def attacker():
    s = socket.socket()
    s.bind(("127.0.0.2", 0))
    s.settimeout(5)
    s.connect((host, port))
    return s

def closed_within(s, limit):
    """Seconds until the server closed s (EOF or reset), or None if still open after limit."""
    t0 = time.monotonic()
    s.settimeout(0.2)
    while time.monotonic() - t0 < limit:
        try:
            if not s.recv(65536):
                return time.monotonic() - t0
        except socket.timeout:
            continue
        except OSError:
            return time.monotonic() - t0
    return None

# 1. 60 silent connections from one address
socks = []
for _ in range(60):
    try:
        socks.append(attacker())
    except OSError:
        pass
time.sleep(0.5)
open_now = []
for s in socks:
    s.setblocking(False)
    try:
        data = s.recv(1)
        still = False if data == b"" else True
    except BlockingIOError:
        still = True
    except OSError:
        still = False
    s.setblocking(True)
    if still:
        open_now.append(s)
t0 = time.monotonic()
rc = subprocess.run(["curl", "-s", "--noproxy", "*", "-o", "/dev/null", "-w", "%{http_code}",
                     "--max-time", "10", f"http://{host}:{port}/v2/"], capture_output=True, text=True)
took = time.monotonic() - t0
print(f"silent-open {len(open_now)} of {len(socks)}")
print(f"legit {rc.stdout or '000'} {took:.2f}")
# 2. the silent ones are closed (all waited for at once, 8 s in all)
import select
pending = set(open_now)
deadline = time.monotonic() + 8.0
while pending and time.monotonic() < deadline:
    ready, _, _ = select.select(list(pending), [], [], 0.2)
    for s in ready:
        try:
            if s.recv(65536):
                continue
        except OSError:
            pass
        pending.discard(s)
never = len(pending)
print(f"silent-never-closed {never}")
# 3. h2c preface + SETTINGS, no stream
s = attacker()
s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
t = closed_within(s, 8.0)
print(f"h2-idle-closed {'never' if t is None else 'yes'}")
# 4. keep-alive idle after one request
try:
    s = attacker()
    s.sendall(f"GET /v2/ HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    s.recv(65536)
    t = closed_within(s, 9.0)
    print(f"keepalive-idle-closed {'never' if t is None else 'yes'}")
except OSError as e:
    print(f"keepalive-idle-closed error {e}")
# 5. a response nobody reads
s = socket.socket()
s.bind(("127.0.0.2", 0))
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
s.connect((host, port))
s.sendall(f"GET /v2/idle/big/blobs/{digest} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
time.sleep(12)  # never reading; the server's writes block
s.settimeout(5)
got = 0
eof = False
try:
    while True:
        b = s.recv(1 << 20)
        if not b:
            eof = True
            break
        got += len(b)
except socket.timeout:
    pass
except OSError:
    eof = True
eof = eof and got < (32 << 20)  # closed before the whole blob was sent
print(f"unread-closed {'yes' if eof else 'never'} after {got} bytes")
PY
cat "$E2E_TMP/attack.out" | sed 's/^/    | /'
get() { awk -v k="$1" '$1 == k { $1 = ""; sub(/^ /, ""); print }' "$E2E_TMP/attack.out"; }
read -r open_n _ total <<<"$(get silent-open)"
read -r lcode ltook <<<"$(get legit)"
if [[ -n ${open_n:-} ]] && ((open_n <= 10)); then pass "1. 60 silent connections from one client: $open_n kept open (cap 10)"; else fail "1. silent connections kept open: ${open_n:-?} of ${total:-?} (want <= 10)"; fi
if [[ ${lcode:-} == 200 ]] && python3 -c "import sys; sys.exit(0 if float('${ltook:-99}') < 2 else 1)"; then
    pass "1. another client answered meanwhile ($lcode in ${ltook}s)"
else
    fail "1. another client during the attack: ${lcode:-000} in ${ltook:-?}s (want 200 within 2 s)"
fi
[[ $(get silent-never-closed) == 0 ]] && pass "2. every silent connection closed by the server within 8 s" || fail "2. silent connections never closed: $(get silent-never-closed)"
[[ $(get h2-idle-closed) == yes ]] && pass "3. an h2c connection with no request closed within 8 s" || fail "3. an h2c connection with no request stayed open"
[[ $(get keepalive-idle-closed) == yes ]] && pass "4. an idle keep-alive connection closed within 9 s" || fail "4. an idle keep-alive connection stayed open"
[[ $(get unread-closed) == yes* ]] && pass "5. a response nobody reads is cut off ($(get unread-closed))" || fail "5. a response nobody reads: $(get unread-closed)"
code=$(curl -s --noproxy '*' -o /dev/null -w '%{http_code}' --max-time 10 "$R/v2/") || true
[[ $code == 200 ]] && pass "the registry still answers (200)" || fail "the registry after the attack: $code"
e2e_summary
