# tests/security/lib.sh — helpers for the attack tests (source it after tests/e2e/lib.sh).
#
# Every script here starts the real `ferry registry serve` (the binary in $FERRY) on
# loopback and attacks it over HTTP, the way an outsider or a user with some rights
# would. Attackers connect from 127.0.0.2 where the source address matters (per-client
# limits), so the legitimate client on 127.0.0.1 is a different client to the server.
#
#   (users: make_htpasswd FILE USER PASS... from tests/e2e/lib.sh)
#   sec_token USER PASS SCOPE...     a bearer token from $R/token (prints it)
#   sec_push_blob REPO FILE [CREDS]  monolithic POST ?digest= (prints the HTTP status)
#   sha_of FILE                      sha256:<hex> of FILE
#   basic USER PASS                  the Authorization header value for Basic
#
# For the attacks of a local user on a node:
#   sec_attacker PREFIX              makes the account PREFIX$$ for the run (removed at
#                                    exit): ATTACKER, ATT_UID, ATT_GID
#   as_attacker CMD...               CMD as the attacker (no groups): output in OUT,
#                                    exit status in RC
#   sec_dropto OUT                   builds OUT, a static `dropto CMD ARGS...` that runs
#                                    CMD as uid/gid 1000 (ctr run has no --user)

# shellcheck shell=bash
sha_of() { echo "sha256:$(sha256sum <"$1" | cut -d' ' -f1)"; }
basic() { printf 'Basic %s' "$(printf '%s:%s' "$1" "$2" | base64 -w0)"; }

sec_token() {
    local user=$1 pass=$2 q="service=ferry-registry"
    shift 2
    local s
    for s in "$@"; do q+="&scope=$s"; done
    curl -sS --noproxy '*' --max-time 20 -u "$user:$pass" "$R/token?$q" | jq -r .token
}

sec_push_blob() {
    local repo=$1 file=$2
    shift 2
    curl -sS --noproxy '*' --max-time 30 -o /dev/null -w '%{http_code}' -X POST \
        -H 'Content-Type: application/octet-stream' --data-binary "@$file" "$@" \
        "$R/v2/$repo/blobs/uploads/?digest=$(sha_of "$file")" || echo 000
}

sec_attacker() {
    ATTACKER=$1$$
    useradd --no-create-home --shell /usr/sbin/nologin "$ATTACKER" >/dev/null
    e2e_defer "userdel $ATTACKER"
    ATT_UID=$(id -u "$ATTACKER")
    ATT_GID=$(id -g "$ATTACKER")
}

# env runs CMD so that the attacker's own rights decide whether it can start.
as_attacker() {
    set +e
    OUT=$(cd / && timeout 30 setpriv --reuid "$ATT_UID" --regid "$ATT_GID" --clear-groups -- env -- "$@" 2>&1)
    RC=$?
    set -e
}

sec_dropto() {
    cat >"$E2E_TMP/dropto.c" <<'EOF'
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    if (argc < 2 || setgid(1000) != 0 || setuid(1000) != 0) {
        perror("dropto");
        return 1;
    }
    execv(argv[1], argv + 1);
    perror("exec");
    return 1;
}
EOF
    gcc -static -O1 -o "$1" "$E2E_TMP/dropto.c"
}
