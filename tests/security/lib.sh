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
