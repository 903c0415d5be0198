#!/usr/bin/env bash
# tests/security/node_dead_mounts.sh — a `ferry mount` whose daemon and fd holder were both
# killed with -9 (issue 11, finding 10); needs root and /dev/fuse.
#
#   bash tests/security/node_dead_mounts.sh
#
# 1. `ferry daemon` (with its fd holder) mounts the indexed small image from ferry's
#    registry; a `ferry mount --foreground` serves another mount from its own process
#    and store (a live mount that is not the daemon's).
# 2. kill -9 the daemon and its holder: the connection ends, the mount point answers
#    ENOTCONN ("Transport endpoint is not connected").
# 3. The next daemon detects and detaches the dead mount at start: the mount point is a
#    plain directory again; `ferry status` (table and JSON) reports what was found and
#    cleaned; `ferry mount` there works again; the foreground mount was left alone and
#    still serves.
# Checks 2's cleanup and 3's report fail on ferry before issue 11's fix (the mount stayed
# dead and `ferry mount` there failed with "not a directory").
#
# Env: FERRY, E2E_KEEP=1, E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"

need_root "FUSE mounts"
need_cmd jq curl timeout stat
[[ -e /dev/fuse ]] || skip "no /dev/fuse"
find_ferry
e2e_init
small_image
require_ferry daemon

say() { sed 's/^/    | /' <<<"$1" | tail -"${2:-6}"; }
mounts_at() { awk -v d="$1" '$5 == d' /proc/self/mountinfo | wc -l; }
holder_pid() {
    ps -eo pid=,args= | awk -v s="--fd-holder $1" 'index($0, s) { print $1; exit }'
}
start_daemon() {
    "$FERRY" --log info daemon --config "$CFG" >>"$E2E_TMP/daemon.log" 2>&1 &
    DAEMON=$!
    E2E_PIDS+=("$DAEMON")
    wait_for 30 "daemon status" "$FERRY" status --socket "$SOCK"
}

publish_indexed_small e2e/small:v1 # IMG, REG_ADDR, IMAGE
SOCK=$E2E_TMP/run/daemon.sock
HSOCK=$E2E_TMP/run/fdstore.sock
CFG=$E2E_TMP/daemon.toml
cat >"$CFG" <<TOML
[store]
path = "$E2E_TMP/store"
[control]
socket = "$SOCK"
[snapshotter]
enabled = false
[warm]
prefetch = false
background_fill = false
TOML
M=$E2E_TMP/mnt
OTHER=$E2E_TMP/other
mkdir -p "$M" "$OTHER"
WANT="hello from the ferry small image"

echo "# 1. a daemon mount and a foreground mount"
start_daemon || { fail "the daemon did not start"; e2e_summary || exit 1; }
fy "$E2E_TMP/m.out" "$E2E_TMP/m.err" mount --socket "$SOCK" "$IMAGE" "$M"
if [[ $RC == 0 && $(cat "$M/app/hello.txt" 2>/dev/null) == "$WANT" ]]; then
    pass "ferry mount through the daemon serves $M"
else
    fail "ferry mount: exit $RC"; show "$E2E_TMP/m.err"
    e2e_summary || exit 1
fi
HOLDER=$(holder_pid "$HSOCK")
[[ -n $HOLDER ]] || fail "no fd holder on $HSOCK"
"$FERRY" mount --foreground --store "$E2E_TMP/other-store" "$IMAGE" "$OTHER" >"$E2E_TMP/fg.log" 2>&1 &
FG=$!
E2E_PIDS+=("$FG")
e2e_defer "kill $FG"
wait_for 30 "foreground mount" test -f "$OTHER/app/hello.txt" || fail "the foreground mount did not come up"

echo "# 2. kill -9 the daemon and its fd holder"
kill -9 "$DAEMON" ${HOLDER:+"$HOLDER"}
wait "$DAEMON" 2>/dev/null || true
sleep 0.5
set +e
ERR=$(timeout 10 stat "$M/app/hello.txt" 2>&1)
SRC=$?
set -e
if [[ $SRC != 0 && $ERR == *"not connected"* && $(mounts_at "$M") == 1 ]]; then
    pass "the mount point is dead (ENOTCONN) and still mounted"
else
    fail "after kill -9: stat exit $SRC, $(mounts_at "$M") mounts at $M"; say "$ERR"
fi

echo "# 3. the next daemon cleans it and says so"
start_daemon || { fail "the daemon did not restart"; e2e_summary || exit 1; }
if [[ $(mounts_at "$M") == 0 ]] && ls "$M" >/dev/null 2>&1; then
    pass "the dead mount was detached at start: $M is a plain directory again"
else
    fail "after restart: $(mounts_at "$M") mounts at $M"
fi
STATUS=$(timeout 20 "$FERRY" status --json --socket "$SOCK" || true)
if jq -e --arg m "$M" '.daemon.dead_mounts | map(select(.mountpoint == $m and .detached)) | length == 1' <<<"$STATUS" >/dev/null; then
    pass "ferry status --json reports the dead mount as found and detached"
else
    fail "status JSON: $(jq -c '.daemon.dead_mounts' <<<"$STATUS" 2>/dev/null)"
fi
TABLE=$(timeout 20 "$FERRY" status --socket "$SOCK" || true)
if grep -q "cleaned at start: dead mount $M " <<<"$TABLE"; then
    pass "ferry status shows it: $(grep 'cleaned at start' <<<"$TABLE" | head -1)"
else
    fail "status table:"; say "$TABLE"
fi
if grep -q "detached a dead ferry mount" "$E2E_TMP/daemon.log"; then
    pass "the daemon logged the cleanup"
else
    fail "no cleanup line in the daemon log"
fi
if [[ $(mounts_at "$OTHER") == 1 && $(cat "$OTHER/app/hello.txt" 2>/dev/null) == "$WANT" ]]; then
    pass "the live foreground mount (not the daemon's) was left alone and serves"
else
    fail "the foreground mount after the daemon's start: $(mounts_at "$OTHER") mounts"
fi
fy "$E2E_TMP/m2.out" "$E2E_TMP/m2.err" mount --socket "$SOCK" "$IMAGE" "$M"
if [[ $RC == 0 && $(cat "$M/app/hello.txt" 2>/dev/null) == "$WANT" ]]; then
    pass "ferry mount at the cleaned mount point works again"
else
    fail "ferry mount after cleanup: exit $RC"; show "$E2E_TMP/m2.err"
fi

timeout 60 "$FERRY" umount --socket "$SOCK" "$M" >/dev/null 2>&1 || true
kill "$FG" 2>/dev/null || true
kill "$DAEMON" 2>/dev/null || true
wait "$DAEMON" 2>/dev/null || true
e2e_summary
