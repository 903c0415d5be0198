#!/usr/bin/env bash
# tests/security/registry_catalog_rules.sh — issue 11 #8: the catalog lists only the
# repositories the caller's access rules give it something on.
#
# Token auth, catalog open to every authenticated user; alice has alice/**, bob bob/**,
# both may pull shared/**. Each pushes a blob into their repository (shared/base by alice).
#  1. alice's catalog: alice/one and shared/base, not bob/two (Basic and Bearer)
#  2. bob's catalog: bob/two and shared/base
#  3. paginated (n=1) alice never sees bob's repository on any page
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
need_cmd curl jq python3 sha256sum base64
find_ferry
e2e_init
make_htpasswd "$E2E_TMP/htpasswd" alice alice-pw bob bob-pw
cat >"$E2E_TMP/reg.toml" <<TOML
[auth]
htpasswd = "$E2E_TMP/htpasswd"
secret = "security-test-secret-not-for-production"
catalog = ["*"]
[[auth.rules]]
repository = "alice/**"
users = ["alice"]
actions = ["*"]
[[auth.rules]]
repository = "bob/**"
users = ["bob"]
actions = ["*"]
[[auth.rules]]
repository = "shared/**"
users = ["alice"]
actions = ["pull", "push"]
[[auth.rules]]
repository = "shared/**"
users = ["*"]
actions = ["pull"]
TOML
start_ferry_registry reg "$E2E_TMP/reg.toml" || { fail "start ferry registry"; e2e_summary; exit 1; }
R=http://$REG_ADDR
echo a >"$E2E_TMP/a"; echo b >"$E2E_TMP/b"; echo s >"$E2E_TMP/s"
c1=$(sec_push_blob alice/one "$E2E_TMP/a" -u alice:alice-pw)
c2=$(sec_push_blob bob/two "$E2E_TMP/b" -u bob:bob-pw)
c3=$(sec_push_blob shared/base "$E2E_TMP/s" -u alice:alice-pw)
[[ $c1$c2$c3 == 201201201 ]] && pass "setup: alice/one, bob/two, shared/base pushed" || fail "setup: pushes $c1 $c2 $c3"

list() { curl -sS --noproxy '*' --max-time 10 "$@" | jq -r '.repositories | join(",")'; }
got=$(list -u alice:alice-pw "$R/v2/_catalog")
[[ $got == alice/one,shared/base ]] && pass "1. alice's catalog (Basic): $got" || fail "1. alice's catalog (Basic): '$got' (want alice/one,shared/base)"
tok=$(sec_token alice alice-pw "registry:catalog:*")
got=$(list -H "Authorization: Bearer $tok" "$R/v2/_catalog")
[[ $got == alice/one,shared/base ]] && pass "1. alice's catalog (Bearer): $got" || fail "1. alice's catalog (Bearer): '$got'"
got=$(list -u bob:bob-pw "$R/v2/_catalog")
[[ $got == bob/two,shared/base ]] && pass "2. bob's catalog: $got" || fail "2. bob's catalog: '$got' (want bob/two,shared/base)"
seen="" next="/v2/_catalog?n=1"
for _ in 1 2 3 4 5; do
    http_req GET "$R$next" -u alice:alice-pw
    seen+=$(jq -r '.repositories | join(",")' "$HTTP_BODY"),
    next=$(http_header link | sed -n 's/^<\([^>]*\)>.*/\1/p')
    [[ -n $next ]] || break
done
[[ $seen != *bob* ]] && pass "3. alice's pages (n=1): $seen" || fail "3. alice's pages list bob's repository: $seen"
e2e_summary
