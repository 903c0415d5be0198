#!/usr/bin/env bash
# tests/e2e/p2p_gossip.sh — membership by gossip (docs/p2p.md): 4 `ferry daemon`s, each
# in its own network namespace, with no static peers and no DNS, each given one seed,
# find each other; a death is noticed; a daemon with another token is never admitted.
#
#   flock /tmp/ferry-e2e.lock nice -n 19 bash tests/e2e/p2p_gossip.sh
#
# Network as in p2p_fleet.sh: a bridge (10.R.0.1/24), namespaces 10.R.0.11 … .15. Daemons
# 1-4 share one token; daemon i's only seed is daemon i-1's gossip address (daemon 1's
# is daemon 4's): a ring, so no daemon is told of all the others. Daemon 5 (the
# intruder) has another token and daemon 1 as its seed.
#
# 1. Within GOSSIP_WAIT seconds (default 60), every one of daemons 1-4 lists all 4 in
#    `ferry status --json` (.p2p.members, the membership reads are scheduled with).
# 2. The intruder is in no one's membership; its own lists only itself; daemon 1
#    counted its datagrams as unauthenticated (.p2p.gossip.dropped_unauthenticated).
# 3. Daemon 4 gets kill -9 and its veth goes down; within GOSSIP_WAIT seconds daemons
#    1-3 list exactly 1-3.
#
# Env: FERRY, GOSSIP_WAIT, E2E_KEEP=1 / E2E_VERBOSE=1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "network namespaces"
need_cmd ip nsenter jq timeout

N=4
INTRUDER=5
WAIT=${GOSSIP_WAIT:-60}
find_ferry
e2e_init
require_ferry daemon
T0=$SECONDS

# ---------------------------------------------------------------- network
netns_fleet fg "$INTRUDER"

# ---------------------------------------------------------------- daemons
head -c 32 /dev/urandom | sha256sum | cut -d' ' -f1 >"$E2E_TMP/p2p-token"
head -c 32 /dev/urandom | sha256sum | cut -d' ' -f1 >"$E2E_TMP/other-token"
chmod 600 "$E2E_TMP/p2p-token" "$E2E_TMP/other-token"
declare -A DPID
sock() { echo "$E2E_TMP/n$1/daemon.sock"; }
start_daemon() {
    local i=$1 seed=$2 token=$3
    mkdir -p "$E2E_TMP/n$i"
    cat >"$E2E_TMP/n$i/daemon.toml" <<EOF
[store]
path = "$E2E_TMP/n$i/store"
[fuse]
keep_connections = false
[warm]
prefetch = false
background_fill = false
[file_cache]
enabled = false
[control]
socket = "$(sock "$i")"
[snapshotter]
enabled = false
[trace]
auto_record = false
[registry]
config_path = ""
[p2p]
enabled = true
listen = "$(node_ip "$i"):7050"
token_file = "$token"
gossip = true
gossip_listen = "$(node_ip "$i"):7946"
gossip_seeds = ["$(node_ip "$seed"):7946"]
gossip_probe_period = "500ms"
gossip_suspect_after = "3s"
EOF
    in_ns "$i" "$FERRY" --log info daemon --config "$E2E_TMP/n$i/daemon.toml" >"$E2E_TMP/n$i.log" 2>&1 &
    DPID[$i]=$!
    E2E_PIDS+=("${DPID[$i]}")
}
for ((i = 1; i <= N; i++)); do
    start_daemon "$i" $(((i + N - 2) % N + 1)) "$E2E_TMP/p2p-token"
done
start_daemon "$INTRUDER" 1 "$E2E_TMP/other-token"

status_json() { timeout 10 "$FERRY" status --socket "$(sock "$1")" --json 2>/dev/null || true; }
# members I: daemon I's membership, sorted, one line, space-separated
members() { status_json "$1" | jq -r '(.p2p.members // []) | sort | join(" ")' 2>/dev/null || true; }
want() {
    local i out=()
    for i in "$@"; do out+=("$(node_ip "$i"):7050"); done
    printf '%s\n' "${out[@]}" | sort | paste -sd' '
}
# all_list I... : every daemon I lists exactly I...
all_list() {
    local w i
    w=$(want "$@")
    for i in "$@"; do [[ $(members "$i") == "$w" ]] || return 1; done
}
up() { timeout 5 "$FERRY" status --socket "$(sock "$1")" >/dev/null 2>&1; }
all_up() { local i; for ((i = 1; i <= INTRUDER; i++)); do up "$i" || return 1; done; }
if ! wait_for 60 "daemons" all_up; then
    for ((i = 1; i <= INTRUDER; i++)); do up "$i" || { e2e_log "daemon $i down:"; tail -5 "$E2E_TMP/n$i.log" >&2; }; done
    fail "not every daemon came up"
    e2e_summary || exit 1
fi
T_UP=$SECONDS

# ---------------------------------------------------------------- 1. convergence
if wait_for "$WAIT" "all 4 list all 4" all_list 1 2 3 4; then
    pass "daemons 1-4, one seed each, all list the 4 members ($((SECONDS - T_UP))s after all were up)"
else
    for ((i = 1; i <= N; i++)); do e2e_log "daemon $i: $(members "$i")"; done
    fail "daemons 1-4 did not all list the 4 members within ${WAIT}s"
fi

# ---------------------------------------------------------------- 2. the intruder
BADNAME="$(node_ip "$INTRUDER"):7050"
admitted=0
for ((i = 1; i <= N; i++)); do
    [[ " $(members "$i") " == *" $BADNAME "* ]] && admitted=1
done
if ((admitted == 0)) && [[ $(members "$INTRUDER") == "$BADNAME" ]]; then
    pass "the daemon with another token is in no membership, and knows only itself"
else
    fail "the intruder was admitted somewhere: $(for ((i = 1; i <= INTRUDER; i++)); do echo -n "[$i: $(members "$i")] "; done)"
fi
UNAUTH=$(status_json 1 | jq -r '.p2p.gossip.dropped_unauthenticated // 0')
if ((UNAUTH > 0)); then
    pass "daemon 1 dropped $UNAUTH unauthenticated datagrams (the intruder's)"
else
    fail "daemon 1 counted no unauthenticated datagram"
fi

# ---------------------------------------------------------------- 3. a death
{ kill -9 "${DPID[$N]}" && wait "${DPID[$N]}"; } 2>/dev/null || true
ip netns pids "$(ns "$N")" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
ip link set "${TAG}h$N" down
T_KILL=$SECONDS
if wait_for "$WAIT" "1-3 list 1-3" all_list 1 2 3; then
    pass "daemon $N killed: daemons 1-3 list exactly 1-3 ($((SECONDS - T_KILL))s after the kill; suspicion 3s)"
else
    for ((i = 1; i < N; i++)); do e2e_log "daemon $i: $(members "$i")"; done
    fail "daemon $N was not removed within ${WAIT}s"
fi
for ((i = 1; i < N; i++)); do
    g=$(status_json "$i" | jq -c '.p2p.gossip')
    e2e_log "daemon $i gossip: $g"
done

e2e_log "elapsed $((SECONDS - T0))s"
e2e_summary
