#!/usr/bin/env bash
# The harness's skip accounting: a script that skips exits 77, and scripts/e2e-run
# counts it as a skip (not a pass), prints its reason, and fails the run unless the
# script is allowed to skip on this machine.
source "$(dirname "$0")/lib.sh"
e2e_init
cat >"$E2E_TMP/passes.sh" <<EOS
source "$E2E_DIR/lib.sh"
pass "nothing to do"
e2e_summary
EOS
cat >"$E2E_TMP/skips.sh" <<EOS
source "$E2E_DIR/lib.sh"
skip "forced skip for the harness test"
EOS
cat >"$E2E_TMP/fails.sh" <<EOS
exit 3
EOS

rc=0
(unset E2E_SKIP_RC; bash "$E2E_TMP/skips.sh") >/dev/null || rc=$?
if [[ $rc == 77 ]]; then pass "skip exits 77"; else fail "skip exited $rc"; fi

run() { E2E_ALLOW_SKIP=$1 bash "$FERRY_ROOT/scripts/e2e-run" t "${@:2}" >"$E2E_TMP/out" 2>&1; }
if run "" "$E2E_TMP/passes.sh" "$E2E_TMP/skips.sh"; then
    fail "a skip that is not allowed passed the run"
else
    pass "a skip that is not allowed fails the run"
fi
if grep -qx 't: 1 passed, 0 failed, 1 skipped' "$E2E_TMP/out" \
    && grep -qx '1 skipped: skips.sh (forced skip for the harness test)' "$E2E_TMP/out"; then
    pass "skips are counted and printed with their reason"
else
    fail "summary: $(tail -n3 "$E2E_TMP/out")"
fi
if run "skips.sh" "$E2E_TMP/passes.sh" "$E2E_TMP/skips.sh" \
    && grep -q '^1 skipped: skips.sh' "$E2E_TMP/out"; then
    pass "an allowed skip passes the run and is still printed"
else
    fail "allowed skip: $(tail -n3 "$E2E_TMP/out")"
fi
if run "all" "$E2E_TMP/fails.sh" "$E2E_TMP/skips.sh"; then
    fail "a failure passed the run"
elif grep -qx 't: 0 passed, 1 failed, 1 skipped' "$E2E_TMP/out"; then
    pass "a failure is a failure even when skips are allowed"
else
    fail "failure summary: $(tail -n3 "$E2E_TMP/out")"
fi
e2e_summary
