#!/usr/bin/env bash
# tests/security/registry_config_secrets.sh — issue 11 #9: `ferry registry config` never
# prints a secret.
#
# A config with an upstream password, an inline token secret and S3 credentials (a
# secret key and a session token): the printed config contains none of the four secret
# values, shows "<redacted>" for each, keeps the non-secret fields (upstream username, S3
# access key id), and is still a config `ferry registry config` accepts.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
find_ferry
e2e_init
cat >"$E2E_TMP/reg.toml" <<'TOML'
[storage]
type = "s3"
bucket = "b"
access_key_id = "AKIAVISIBLE"
secret_access_key = "s3-secret-key-value-x1"
session_token = "s3-session-token-value-x2"
[auth]
secret = "token-signing-secret-value-x3"
[upstream]
url = "https://upstream.invalid"
username = "robot-visible"
password = "upstream-password-value-x4"
TOML
if "$FERRY" registry config --config "$E2E_TMP/reg.toml" >"$E2E_TMP/printed.toml" 2>"$E2E_TMP/err"; then
    pass "ferry registry config ran"
else
    fail "ferry registry config: $(cat "$E2E_TMP/err")"
fi
leaked=$(grep -oE 's3-secret-key-value-x1|s3-session-token-value-x2|token-signing-secret-value-x3|upstream-password-value-x4' "$E2E_TMP/printed.toml" | tr '\n' ' ' || true)
[[ -z $leaked ]] && pass "no secret value printed" || fail "secrets printed: $leaked"
n=$(grep -c '"<redacted>"' "$E2E_TMP/printed.toml" || true)
[[ $n == 4 ]] && pass "four secrets shown as <redacted>" || fail "<redacted> shown $n times (want 4)"
grep -q AKIAVISIBLE "$E2E_TMP/printed.toml" && grep -q robot-visible "$E2E_TMP/printed.toml" &&
    pass "non-secret fields kept (access key id, upstream username)" || fail "non-secret fields missing"
"$FERRY" registry config --config "$E2E_TMP/printed.toml" >/dev/null 2>&1 &&
    pass "the printed config parses again" || fail "the printed config does not parse"
e2e_summary
