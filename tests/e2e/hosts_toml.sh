#!/usr/bin/env bash
# tests/e2e/hosts_toml.sh — ferry reads containerd's registry host configuration
# (`config_path` with <host[:port]>/hosts.toml) the way containerd does, with real
# components on loopback: ferry's registry (plain and TLS), small python proxies of our
# own, `ferry mount` (lazy, every byte verified) with --registry-config-path.
#
#   bash tests/e2e/hosts_toml.sh
#
# Setup: the small image indexed (`indexed_small`) in ferry's registry (the origin); the
# reference is every regular file's md5sum in the image extracted normally.
# 1. A mirror that is down (connection refused) listed first: the origin serves, the
#    mount's files equal the reference.
# 2. A mirror that serves corrupt bytes (a proxy flipping one byte of every blob body):
#    it is asked (its count of corrupted answers > 0), nothing corrupt is served (the
#    files equal the reference), the origin supplies the verified bytes.
# 3. `override_path`: a mirror reachable only under /mirror/prefix (a reverse proxy),
#    capabilities pull and resolve: it serves the mount (its request count > 0).
# 4. TLS: a second ferry registry over HTTPS on the same storage with a certificate
#    signed by a CA made here with openssl. With `server = "https://…"` and `ca = "ca.pem"`
#    (relative to the host's directory) the mount works; without `ca` it fails with an
#    error naming the certificate problem.
# 5. The node daemon with `[registry] config_path`: `ferry mount` through the daemon
#    uses the hosts.toml of its config (the TLS registry and its CA, as in 4).
# 6. `header` per host: the origin reached through `server` (a logging proxy) with a
#    top-level `[header]`, and a pull-only mirror (another logging proxy) with its own
#    `[host."…".header]`, the same header name with a different value: the mount works;
#    every API request each host got carried its own value, none carried the other's
#    (a list-valued header reaches the mirror with both values); both hosts were used.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), OUT,
#      FERRY_TIMEOUT (seconds per ferry call, 120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

mount_prologue openssl

publish_indexed_small e2e/small:v1
ORIGIN=$REG_ADDR
ORIGIN_DATA=$REG_DATA
IMAGE=$ORIGIN/e2e/small:v1

# The reference: md5sum of every regular file of the image extracted normally.
reference_tree "$IMG"

# hosts_toml CONFIG_DIR HOST TEXT: write CONFIG_DIR/HOST/hosts.toml
hosts_toml() {
    mkdir -p "$1/$2"
    printf '%s\n' "$3" >"$1/$2/hosts.toml"
}

# mount_check NAME IMAGE CONFIG_DIR: `ferry mount` (its own detached process, empty
# store) with --registry-config-path CONFIG_DIR; every file must equal the reference
n=0
mount_check() {
    local name=$1 image=$2 cfg=$3 mnt
    n=$((n + 1))
    mnt=$E2E_TMP/mnt$n
    mkdir -p "$mnt"
    fy "$E2E_TMP/m$n.out" "$E2E_TMP/m$n.err" mount "$image" "$mnt" --store "$E2E_TMP/store$n" \
        --stats-file "$E2E_TMP/stats$n.json" --registry-config-path "$cfg" --timeout 20
    if [[ $RC != 0 ]] || ! mountpoint -q "$mnt"; then
        fail "$name: ferry mount exit $RC"
        show "$E2E_TMP/m$n.err"
        return 1
    fi
    if tree_equals_ref "$mnt" "$E2E_TMP/got$n.sums"; then
        pass "$name: every file read through the mount equals the image's ($(wc -l <"$E2E_TMP/got$n.sums") files)"
    else
        fail "$name: files read through the mount differ from the image's"
        diff "$REF_SUMS" "$E2E_TMP/got$n.sums" | head -5 | show /dev/stdin
        show "$E2E_TMP/got$n.sums.err"
    fi
    timeout 60 "$FERRY" umount "$mnt" >/dev/null 2>&1 || umount -l "$mnt" 2>/dev/null || true
}

# start_proxy MODE [NAME]: a proxy in front of the origin: MODE corrupt (flip one byte
# of every blob body), prefix (serve the API under /mirror/prefix instead of /v2) or
# headers (forward as is, and log every request's headers, as JSON, on a line
# "headers METHOD PATH [[name, value], ...]"). Log $E2E_TMP/proxy-NAME.log (NAME
# defaults to MODE); address in PROXY_ADDR.
start_proxy() {
    local mode=$1 name=${2:-$1} port log
    log=$E2E_TMP/proxy-$name.log
    port=$(free_port)
    python3 - "$mode" "$port" "$ORIGIN" "$log" >"$E2E_TMP/proxy-$name.err" 2>&1 <<'PY' &
import http.client, json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

mode, port, origin, log = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
lock = threading.Lock()

def note(line):
    with lock:
        with open(log, "a") as f:
            f.write(line + "\n")

class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def forward(self):
        path = self.path
        if mode == "headers":
            note(f"headers {self.command} {path} " + json.dumps([[k.lower(), v] for k, v in self.headers.items()]))
        if mode == "prefix":
            if not path.startswith("/mirror/prefix"):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                note(f"404 {self.command} {path}")
                return
            path = "/v2" + path[len("/mirror/prefix"):]
        conn = http.client.HTTPConnection(origin, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("accept", "range", "authorization")}
        conn.request(self.command, path, headers=headers)
        r = conn.getresponse()
        body = r.read()
        corrupted = False
        if mode == "corrupt" and self.command == "GET" and "/blobs/" in path and r.status in (200, 206) and body:
            b = bytearray(body)
            b[len(b) // 2] ^= 0xFF
            body = bytes(b)
            corrupted = True
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() in ("content-type", "content-range", "docker-content-digest", "location", "link", "www-authenticate", "accept-ranges"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        note(f"{'corrupted' if corrupted else 'served'} {r.status} {self.command} {self.path}")

    do_GET = forward
    do_HEAD = forward

ThreadingHTTPServer(("127.0.0.1", port), Proxy).serve_forever()
PY
    E2E_PIDS+=("$!")
    PROXY_ADDR=127.0.0.1:$port
    wait_for 20 "proxy $name" curl -s -o /dev/null "http://$PROXY_ADDR/" || e2e_die "proxy $name did not start"
}

# ---------------------------------------------------------------- 1. a mirror that is down
echo "# 1. a mirror that is down, then the origin"
DEAD=$(free_port)
C1=$E2E_TMP/certs.d-down
hosts_toml "$C1" "$ORIGIN" "[host.\"http://127.0.0.1:$DEAD\"]
  capabilities = [\"pull\", \"resolve\"]"
mount_check "mirror down (connection refused)" "$IMAGE" "$C1" || true

# ---------------------------------------------------------------- 2. a corrupt mirror
echo "# 2. a mirror that serves corrupt bytes"
start_proxy corrupt
C2=$E2E_TMP/certs.d-corrupt
hosts_toml "$C2" "$ORIGIN" "[host.\"http://$PROXY_ADDR\"]
  capabilities = [\"pull\"]"
if mount_check "corrupt mirror" "$IMAGE" "$C2"; then
    bad=$(grep -c '^corrupted' "$E2E_TMP/proxy-corrupt.log" 2>/dev/null || true)
    if ((${bad:-0} > 0)); then
        pass "corrupt mirror: it was asked and answered $bad blob reads with corrupt bytes, none reached a reader"
    else
        fail "corrupt mirror: the proxy corrupted nothing (was it used?)"
        show "$E2E_TMP/proxy-corrupt.log"
    fi
fi

# ---------------------------------------------------------------- 3. override_path
echo "# 3. override_path: a mirror under a path prefix"
start_proxy prefix
C3=$E2E_TMP/certs.d-prefix
hosts_toml "$C3" "$ORIGIN" "[host.\"http://$PROXY_ADDR/mirror/prefix\"]
  capabilities = [\"pull\", \"resolve\"]
  override_path = true"
if mount_check "override_path mirror" "$IMAGE" "$C3"; then
    served=$(grep -c '^served 20[06] GET /mirror/prefix/e2e/small/blobs/' "$E2E_TMP/proxy-prefix.log" 2>/dev/null || true)
    # Requests outside the prefix (the readiness probe's `GET /` aside) would be 404s.
    stray=$(grep -c '^404 [A-Z]* /v2' "$E2E_TMP/proxy-prefix.log" 2>/dev/null || true)
    if ((${served:-0} > 0 && ${stray:-0} == 0)); then
        pass "override_path mirror: $served blob reads under /mirror/prefix, none under /v2"
    else
        fail "override_path mirror: $served blob reads under the prefix, $stray requests elsewhere"
        show "$E2E_TMP/proxy-prefix.log"
    fi
fi

# ---------------------------------------------------------------- 4. TLS with a CA
echo "# 4. a TLS registry with a certificate signed by a test CA"
PKI=$E2E_TMP/pki
mkdir -p "$PKI"
(
    cd "$PKI"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=ferry e2e test CA" \
        -keyout ca.key -out ca.pem
    openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout server.key -out server.csr
    printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >ext.cnf
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
        -extfile ext.cnf -out server.pem
) >"$E2E_TMP/openssl.log" 2>&1 || { show "$E2E_TMP/openssl.log"; e2e_die "openssl failed"; }
TLS_ADDR=127.0.0.1:$(free_port)
printf '[tls]\ncert = "%s"\nkey = "%s"\n' "$PKI/server.pem" "$PKI/server.key" >"$E2E_TMP/tls.toml"
# The same storage as the origin: the image is there already.
"$FERRY" registry serve --config "$E2E_TMP/tls.toml" --addr "$TLS_ADDR" --root "$ORIGIN_DATA" \
    >"$E2E_TMP/tls-registry.log" 2>&1 &
E2E_PIDS+=("$!")
wait_for 30 "TLS registry" curl -sf --cacert "$PKI/ca.pem" -o /dev/null "https://$TLS_ADDR/v2/" ||
    { show "$E2E_TMP/tls-registry.log"; e2e_die "the TLS registry did not come up"; }
C4=$E2E_TMP/certs.d-tls
hosts_toml "$C4" "$TLS_ADDR" "server = \"https://$TLS_ADDR\"
ca = \"ca.pem\""
cp "$PKI/ca.pem" "$C4/$TLS_ADDR/ca.pem"
mount_check "TLS registry, ca in hosts.toml (relative to its directory)" "$TLS_ADDR/e2e/small:v1" "$C4" || true
C5=$E2E_TMP/certs.d-tls-noca
hosts_toml "$C5" "$TLS_ADDR" "server = \"https://$TLS_ADDR\""
mkdir -p "$E2E_TMP/mnt-noca"
fy "$E2E_TMP/noca.out" "$E2E_TMP/noca.err" mount "$TLS_ADDR/e2e/small:v1" "$E2E_TMP/mnt-noca" \
    --store "$E2E_TMP/store-noca" --stats-file "$E2E_TMP/noca.json" --registry-config-path "$C5" --timeout 10
if [[ $RC != 0 ]] && ! mountpoint -q "$E2E_TMP/mnt-noca" &&
    grep -qiE 'certificate|UnknownIssuer' "$E2E_TMP/noca.err"; then
    pass "TLS registry without ca: refused with a clear error ($(grep -oiE '[^:]*(UnknownIssuer|certificate)[^:]*' "$E2E_TMP/noca.err" | head -1 | sed 's/^ *//'))"
else
    fail "TLS registry without ca: exit $RC, mounted: $(mountpoint -q "$E2E_TMP/mnt-noca" && echo yes || echo no)"
    show "$E2E_TMP/noca.err"
    umount -l "$E2E_TMP/mnt-noca" 2>/dev/null || true
fi

# ---------------------------------------------------------------- 5. the daemon
echo "# 5. the node daemon's [registry] config_path"
DSOCK=$E2E_TMP/daemon/daemon.sock
mkdir -p "$E2E_TMP/daemon"
cat >"$E2E_TMP/daemon.toml" <<TOML
[store]
path = "$E2E_TMP/daemon-store"
[control]
socket = "$DSOCK"
[snapshotter]
enabled = false
[registry]
config_path = "$C4"
TOML
"$FERRY" daemon --config "$E2E_TMP/daemon.toml" >"$E2E_TMP/daemon.log" 2>&1 &
DPID=$!
E2E_PIDS+=("$DPID")
if wait_for 30 "daemon" test -S "$DSOCK"; then
    MNT=$E2E_TMP/mnt-daemon
    mkdir -p "$MNT"
    fy "$E2E_TMP/dm.out" "$E2E_TMP/dm.err" mount "$TLS_ADDR/e2e/small:v1" "$MNT" --socket "$DSOCK"
    if [[ $RC == 0 ]] && mountpoint -q "$MNT" && tree_equals_ref "$MNT" "$E2E_TMP/daemon.sums"; then
        pass "daemon with [registry] config_path: the TLS registry's CA from hosts.toml, every file equal"
    else
        fail "daemon with [registry] config_path: mount exit $RC"
        show "$E2E_TMP/dm.err"
        show "$E2E_TMP/daemon.log"
    fi
    timeout 60 "$FERRY" umount "$MNT" --socket "$DSOCK" >/dev/null 2>&1 || umount -l "$MNT" 2>/dev/null || true
else
    fail "the daemon did not start"
    show "$E2E_TMP/daemon.log"
fi
kill "$DPID" 2>/dev/null || true
wait "$DPID" 2>/dev/null || true

# ---------------------------------------------------------------- 6. headers per host
echo "# 6. each host's [header] goes to that host only"
# The origin is reached through `server` (a logging proxy); a pull-only mirror (another
# logging proxy) is tried first for blobs; manifests (resolve) go to the server. Both
# send the same header name with values that say whose they are.
start_proxy headers headers-server
SERVER_PROXY=$PROXY_ADDR
start_proxy headers headers-mirror
MIRROR_PROXY=$PROXY_ADDR
C6=$E2E_TMP/certs.d-headers
hosts_toml "$C6" "$ORIGIN" "server = \"http://$SERVER_PROXY\"
[header]
  x-ferry-secret = \"for-server-only\"
[host.\"http://$MIRROR_PROXY\"]
  capabilities = [\"pull\"]
  [host.\"http://$MIRROR_PROXY\".header]
    x-ferry-secret = \"for-mirror-only\"
    x-ferry-mirror-list = [\"mirror-a\", \"mirror-b\"]"
# header_check NAME LOG OWN ALIEN...: every API request (path /v2…) in LOG carried
# x-ferry-secret OWN; no request carried any of ALIEN anywhere in its headers
header_check() {
    local name=$1 log=$2 own=$3 total with alien n bad=""
    shift 3
    total=$(grep -c '^headers [A-Z]* /v2' "$log" 2>/dev/null || true)
    with=$(grep '^headers [A-Z]* /v2' "$log" 2>/dev/null | grep -cF "[\"x-ferry-secret\", \"$own\"]" || true)
    for alien in "$@"; do
        n=$(grep -cF -- "$alien" "$log" 2>/dev/null || true)
        ((${n:-0} == 0)) || bad+=" $alien (${n}x)"
    done
    if ((${total:-0} > 0 && ${with:-0} == ${total:-0})) && [[ -z $bad ]]; then
        pass "$name: all $total API requests carried its own header ($own), none another host's ($*)"
    else
        fail "$name: ${with:-0} of ${total:-0} API requests carried $own; other hosts' values seen:${bad:- none}"
        show "$log"
    fi
}
if mount_check "headers per host" "$IMAGE" "$C6"; then
    header_check "the mirror" "$E2E_TMP/proxy-headers-mirror.log" for-mirror-only for-server-only
    header_check "the server" "$E2E_TMP/proxy-headers-server.log" for-server-only \
        for-mirror-only mirror-a mirror-b
    mb=$(grep -c '^headers GET /v2/e2e/small/blobs/' "$E2E_TMP/proxy-headers-mirror.log" 2>/dev/null || true)
    sm=$(grep -c '^headers [A-Z]* /v2/e2e/small/manifests/' "$E2E_TMP/proxy-headers-server.log" 2>/dev/null || true)
    if ((${mb:-0} > 0 && ${sm:-0} > 0)); then
        pass "headers per host: both hosts were used (the mirror for $mb blob reads, the server for $sm manifest requests)"
    else
        fail "headers per host: mirror blob reads ${mb:-0}, server manifest requests ${sm:-0} (both must be > 0)"
    fi
    if grep -q '^headers [A-Z]* /v2.*\["x-ferry-mirror-list", "mirror-a, mirror-b"\]\|^headers [A-Z]* /v2.*"mirror-a".*"mirror-b"' \
        "$E2E_TMP/proxy-headers-mirror.log"; then
        pass "headers per host: a header given as a list reaches the mirror with both values"
    else
        fail "headers per host: the mirror never saw x-ferry-mirror-list with both values"
        show "$E2E_TMP/proxy-headers-mirror.log"
    fi
fi

e2e_summary
