#!/usr/bin/env bash
# tests/e2e/registry_clients.sh — real registry clients against `ferry registry serve`.
#
#   bash tests/e2e/registry_clients.sh
#   REGISTRY_UNDER_TEST=docker-registry bash tests/e2e/registry_clients.sh  # check the checks
#
# Three registries are started (loopback, plain HTTP, state in the temp dir):
#   open   no auth
#   basic  htpasswd (bcrypt) users: alice (pull+push everywhere), bob (pull only);
#          no anonymous access
#   token  same users, Docker token protocol (Bearer challenge -> /token -> JWT),
#          anonymous pull allowed
# Checks:
#  1. skopeo (open): copy oci -> registry -> oci; manifest/config/layer digests equal the
#     source and every pulled blob hashes to its name; inspect (raw digest, layers);
#     list-tags; a docker v2s2 copy under another tag, `skopeo delete` of it (the OCI tag
#     survives, the deleted one is gone).
#  2. skopeo with auth: push as alice / pull as bob (basic and token), digests equal;
#     token: anonymous pull works, the challenge is `Bearer realm=...,service=...`.
#  3. auth negatives: wrong password -> 401 (curl + skopeo), anonymous push -> 401 with a
#     WWW-Authenticate challenge, bob (pull-only) push -> 403 DENIED (basic) / refused
#     (token), skopeo push as bob fails; carol (push to carol/** only) cannot read or
#     cross-repo mount a layer of auth/small; a pull-only token cannot push and a token
#     with a flipped signature byte is refused.
#  4. podman (basic, --creds, --tls-verify=false, private storage): pull -> image inspect
#     digest == registry digest; push under a new name; the pushed config digest equals
#     the source's and a pull back gives the same image id.
#  5. containerd (basic): `ctr image pull --plain-http --user bob:...`, `ctr run` prints
#     "ready small" and /app/hello.txt; wrong password refused; token mode: ctr pull as
#     bob, ctr push as alice (manifest unchanged), ctr push as bob refused.
#  6. ctr-remote (open): pull, `image optimize --no-optimize --oci`, `ctr image push
#     --plain-http` back, skopeo pull again: every layer has the stargz toc.digest
#     annotation and the blobs hash to their names.
#  7. ferry copy: oci -> registry -> oci round trip, byte-identical manifest and blobs;
#     with --creds through token auth (bob's push refused); an image indexed by
#     `ferry index` carries its index artifacts as referrers there and back.
#  8. referrers (open): two artifacts with `subject` pushed with curl (OCI-Subject header
#     on the PUT), GET /v2/<name>/referrers/<digest> lists both with their
#     artifactType, `?artifactType=` filters (OCI-Filters-Applied), unknown subject ->
#     empty index.
# Checks that docker-registry (distribution 2.8) cannot do (per-repo rules, token server,
# referrers) print "SKIP (docker-registry): ..." in baseline mode.
#
# Env: FERRY (binary), REGISTRY_UNDER_TEST=ferry|docker-registry, OUT (tests/e2e/out),
#      E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "private containerd"
need_cmd containerd ctr ctr-remote runc skopeo podman jq curl sha256sum python3 timeout

TARGET=${REGISTRY_UNDER_TEST:-ferry}
find_ferry
e2e_init
small_image

ALICE=alice:alice-secret-pw
BOB=bob:bob-secret-pw
CAROL=carol:carol-secret-pw
make_htpasswd "$E2E_TMP/htpasswd" alice alice-secret-pw bob bob-secret-pw carol carol-secret-pw ||
    e2e_die "cannot write a bcrypt htpasswd file"

SRC_DIGEST=$(jq -r '.manifests[0].digest' "$SMALL/index.json")
SRC_MANIFEST=$(oci_manifest "$SMALL" small)
SRC_CONFIG=$(jq -r .config.digest <<<"$SRC_MANIFEST")
SRC_LAYERS=$(jq -r '[.layers[].digest] | join(" ")' <<<"$SRC_MANIFEST")
SRC_SIZE=$(stat -c %s "$SMALL/blobs/sha256/${SRC_DIGEST#sha256:}")

# ---------------------------------------------------------------- helpers
show() { sed 's/^/    | /' "$1" | tail -"${2:-8}" || true; }
# run LOG CMD...: CMD with a 180 s timeout, output to LOG; returns its status
# (the lib.sh wrappers skopeo_, ctr_, ctr_remote are expanded: timeout needs a program)
POLICY=$E2E_TMP/policy.json
echo '{"default":[{"type":"insecureAcceptAnything"}]}' >"$POLICY"
run() {
    local log=$1
    shift
    case $1 in
        skopeo_) shift; set -- skopeo --policy "$POLICY" "$@" ;;
        ctr_) shift; set -- ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" "$@" ;;
        ctr_remote) shift; set -- ctr-remote -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" "$@" ;;
    esac
    timeout 180 "$@" >"$log" 2>&1
}
# baseline_skip NAME: in docker-registry mode, print a skip line and return 0
baseline_skip() {
    if [[ $TARGET == docker-registry ]]; then
        echo "SKIP (docker-registry): $*"
        return 0
    fi
    return 1
}

# ferry_config MODE FILE: registry config for MODE = open | basic | token
# (storage comes from --root; see crates/registry/src/server/config.rs, auth/config.rs)
ferry_config() {
    local mode=$1 f=$2
    case $mode in
        open) : >"$f" ;;
        basic | token)
            cat >"$f" <<EOF
[auth]
mode = "$mode"
htpasswd = "$E2E_TMP/htpasswd"
secret = "ferry-e2e-token-signing-secret-not-for-production"
anonymous_pull = $([[ $mode == token ]] && echo true || echo false)

[[auth.rules]]
repository = "**"
users = ["alice"]
actions = ["*"]

[[auth.rules]]
repository = "**"
users = ["bob"]
actions = ["pull"]

[[auth.rules]]
repository = "carol/**"
users = ["carol"]
actions = ["*"]
EOF
            ;;
    esac
}

# serve NAME MODE: start the registry under test; sets REG_ADDR etc. (see lib.sh)
serve() {
    local name=$1 mode=$2
    if [[ $TARGET == docker-registry ]]; then
        case $mode in
            open) start_docker_registry "$name" ;;
            basic) start_docker_registry "$name" "$E2E_TMP/htpasswd" ;;
            token) return 2 ;;
        esac
    else
        ferry_config "$mode" "$E2E_TMP/$name.toml"
        start_ferry_registry "$name" "$E2E_TMP/$name.toml"
    fi
}

# check_layout NAME DIR TAG [MANIFEST_DIGEST]: pulled layout has the source's manifest
# digest (or MANIFEST_DIGEST), config and layers, and every blob hashes to its name
check_layout() {
    local name=$1 dir=$2 tag=$3 want=${4:-$SRC_DIGEST} got m cfg layers bad=0 b
    got=$(jq -r --arg t "$tag" '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $t) | .digest' "$dir/index.json" 2>/dev/null | head -1)
    m=$(oci_manifest "$dir" "$tag" 2>/dev/null) || m='{}'
    cfg=$(jq -r '.config.digest // ""' <<<"$m")
    layers=$(jq -r '[.layers[]?.digest] | join(" ")' <<<"$m")
    for b in "$dir"/blobs/sha256/*; do
        [[ $(sha256sum <"$b" | cut -d' ' -f1) == "$(basename "$b")" ]] || bad=$((bad + 1))
    done
    if [[ $got == "$want" && $cfg == "$SRC_CONFIG" && $layers == "$SRC_LAYERS" && $bad == 0 ]]; then
        pass "$name: manifest $got, config and $(wc -w <<<"$layers") layer digests equal the source, blobs verified"
    else
        fail "$name: manifest $got (want $want), config $cfg (want $SRC_CONFIG), layers '$layers' (want '$SRC_LAYERS'), $bad blobs not matching their digest"
    fi
}

# registry_token ADDR USER:PASS|"" SCOPE: token from the realm of ADDR's Bearer challenge
registry_token() {
    local addr=$1 creds=$2 scope=$3 chal realm service auth=()
    http_req GET "http://$addr/v2/"
    chal=$(http_header www-authenticate)
    realm=$(sed -n 's/.*realm="\([^"]*\)".*/\1/p' <<<"$chal")
    service=$(sed -n 's/.*service="\([^"]*\)".*/\1/p' <<<"$chal")
    [[ -n $realm ]] || return 1
    [[ -n $creds ]] && auth=(-u "$creds")
    http_req GET "$realm" -G --data-urlencode "service=$service" --data-urlencode "scope=$scope" "${auth[@]}"
    [[ $HTTP_CODE == 200 ]] || return 1
    jq -er '.token // .access_token' "$HTTP_BODY"
}

# error_codes: the .errors[].code of the last http_req, space separated ("" if not JSON)
error_codes() { jq -r '[.errors[]?.code] | join(" ")' "$HTTP_BODY" 2>/dev/null || true; }

# ---------------------------------------------------------------- registries
serve open open || { fail "start $TARGET registry (open)"; e2e_summary || exit 1; }
OPEN=$REG_ADDR
serve basic basic || { fail "start $TARGET registry (htpasswd)"; e2e_summary || exit 1; }
BASIC=$REG_ADDR
TOKEN=""
if serve token token; then
    TOKEN=$REG_ADDR
elif [[ $? == 2 ]]; then
    echo "SKIP (docker-registry): token-mode registry (needs a separate token server)"
else
    fail "start $TARGET registry (token mode)"
fi
e2e_log "target $TARGET: open $OPEN, basic $BASIC, token ${TOKEN:-none}"

# ================================================================ 1. skopeo, no auth
if run "$E2E_TMP/s1.log" skopeo_ copy --dest-tls-verify=false "oci:$SMALL:small" "docker://$OPEN/skopeo/small:v1"; then
    pass "skopeo copy oci -> docker://$OPEN/skopeo/small:v1 (no auth)"
else
    fail "skopeo push (no auth)"; show "$E2E_TMP/s1.log"
fi
rm -rf "$E2E_TMP/pull1"
if run "$E2E_TMP/s2.log" skopeo_ copy --src-tls-verify=false "docker://$OPEN/skopeo/small:v1" "oci:$E2E_TMP/pull1:v1"; then
    check_layout "skopeo pull (no auth)" "$E2E_TMP/pull1" v1
else
    fail "skopeo pull (no auth)"; show "$E2E_TMP/s2.log"
fi
if run "$E2E_TMP/raw.json" skopeo_ inspect --raw --tls-verify=false "docker://$OPEN/skopeo/small:v1" &&
    [[ sha256:$(sha256sum <"$E2E_TMP/raw.json" | cut -d' ' -f1) == "$SRC_DIGEST" ]]; then
    pass "skopeo inspect --raw: manifest bytes hash to the source digest"
else
    fail "skopeo inspect --raw: bytes do not hash to $SRC_DIGEST"; show "$E2E_TMP/raw.json"
fi
if run "$E2E_TMP/insp.json" skopeo_ inspect --tls-verify=false "docker://$OPEN/skopeo/small:v1" &&
    [[ $(jq -r .Digest "$E2E_TMP/insp.json") == "$SRC_DIGEST" &&
        $(jq -r '.Layers | join(" ")' "$E2E_TMP/insp.json") == "$SRC_LAYERS" ]]; then
    pass "skopeo inspect: Digest and Layers match the source"
else
    fail "skopeo inspect"; show "$E2E_TMP/insp.json"
fi
# same image as docker v2s2 under another tag (a different manifest digest)
if run "$E2E_TMP/s3.log" skopeo_ copy --format v2s2 --dest-tls-verify=false "oci:$SMALL:small" "docker://$OPEN/skopeo/small:docker" &&
    run "$E2E_TMP/s3b.log" skopeo_ copy --dest-tls-verify=false "oci:$SMALL:small" "docker://$OPEN/skopeo/small:v2"; then
    pass "skopeo copy --format v2s2 (docker media types) -> :docker, and :v2"
else
    fail "skopeo copy --format v2s2 / :v2"; show "$E2E_TMP/s3.log"; show "$E2E_TMP/s3b.log"
fi
if run "$E2E_TMP/tags.json" skopeo_ list-tags --tls-verify=false "docker://$OPEN/skopeo/small" &&
    [[ $(jq -r '.Tags | sort | join(",")' "$E2E_TMP/tags.json") == "docker,v1,v2" ]]; then
    pass "skopeo list-tags: docker, v1, v2"
else
    fail "skopeo list-tags"; show "$E2E_TMP/tags.json"
fi
if run "$E2E_TMP/del.log" skopeo_ delete --tls-verify=false "docker://$OPEN/skopeo/small:docker"; then
    if ! run "$E2E_TMP/del2.log" skopeo_ inspect --raw --tls-verify=false "docker://$OPEN/skopeo/small:docker" &&
        run "$E2E_TMP/del3.log" skopeo_ inspect --raw --tls-verify=false "docker://$OPEN/skopeo/small:v1"; then
        pass "skopeo delete :docker (manifest delete): gone, :v1 still served"
    else
        fail "skopeo delete: :docker still served or :v1 lost"; show "$E2E_TMP/del2.log"; show "$E2E_TMP/del3.log"
    fi
else
    fail "skopeo delete"; show "$E2E_TMP/del.log"
fi

# ================================================================ 2. skopeo with auth
if run "$E2E_TMP/a1.log" skopeo_ copy --dest-tls-verify=false --dest-creds "$ALICE" "oci:$SMALL:small" "docker://$BASIC/auth/small:v1"; then
    pass "skopeo push with htpasswd creds (alice)"
else
    fail "skopeo push with htpasswd creds"; show "$E2E_TMP/a1.log"
fi
rm -rf "$E2E_TMP/pull2"
if run "$E2E_TMP/a2.log" skopeo_ copy --src-tls-verify=false --src-creds "$BOB" "docker://$BASIC/auth/small:v1" "oci:$E2E_TMP/pull2:v1"; then
    check_layout "skopeo pull with htpasswd creds (bob)" "$E2E_TMP/pull2" v1
else
    fail "skopeo pull with htpasswd creds (bob)"; show "$E2E_TMP/a2.log"
fi
if [[ -n $TOKEN ]]; then
    http_req GET "http://$TOKEN/v2/"
    chal=$(http_header www-authenticate)
    if [[ $HTTP_CODE == 401 && $chal == Bearer* && $chal == *realm=\"http* && $chal == *service=* ]]; then
        pass "token mode: GET /v2/ -> 401 $chal"
    else
        fail "token mode: GET /v2/ -> $HTTP_CODE, WWW-Authenticate '$chal' (want Bearer realm=...,service=...)"
    fi
    if run "$E2E_TMP/t1.log" skopeo_ copy --dest-tls-verify=false --dest-creds "$ALICE" "oci:$SMALL:small" "docker://$TOKEN/tok/small:v1"; then
        pass "skopeo push in token mode (alice; Bearer challenge followed)"
    else
        fail "skopeo push in token mode"; show "$E2E_TMP/t1.log"
    fi
    rm -rf "$E2E_TMP/pull3"
    if run "$E2E_TMP/t2.log" skopeo_ copy --src-tls-verify=false --src-creds "$BOB" "docker://$TOKEN/tok/small:v1" "oci:$E2E_TMP/pull3:v1"; then
        check_layout "skopeo pull in token mode (bob)" "$E2E_TMP/pull3" v1
    else
        fail "skopeo pull in token mode (bob)"; show "$E2E_TMP/t2.log"
    fi
    rm -rf "$E2E_TMP/pull4"
    if run "$E2E_TMP/t3.log" skopeo_ copy --src-tls-verify=false --src-no-creds "docker://$TOKEN/tok/small:v1" "oci:$E2E_TMP/pull4:v1"; then
        check_layout "skopeo anonymous pull in token mode (anonymous_pull = true)" "$E2E_TMP/pull4" v1
    else
        fail "skopeo anonymous pull in token mode"; show "$E2E_TMP/t3.log"
    fi
fi

# ================================================================ 3. auth negatives
http_req GET "http://$BASIC/v2/auth/small/manifests/v1" -u alice:wrong-password
if [[ $HTTP_CODE == 401 && $(error_codes) == *UNAUTHORIZED* ]]; then
    pass "basic: wrong password -> 401 UNAUTHORIZED"
else
    fail "basic: wrong password -> $HTTP_CODE '$(error_codes)' (want 401 UNAUTHORIZED)"
fi
if ! run "$E2E_TMP/n1.log" skopeo_ inspect --raw --tls-verify=false --creds alice:wrong-password "docker://$BASIC/auth/small:v1"; then
    pass "basic: skopeo with a wrong password is refused ($(grep -o 'unauthorized[^"]*' "$E2E_TMP/n1.log" | head -1 | cut -c1-80))"
else
    fail "basic: skopeo with a wrong password was served"
fi
http_req POST "http://$BASIC/v2/auth/anon/blobs/uploads/"
if [[ $HTTP_CODE == 401 && -n $(http_header www-authenticate) ]]; then
    pass "basic: anonymous push (POST uploads) -> 401, WWW-Authenticate: $(http_header www-authenticate)"
else
    fail "basic: anonymous push -> $HTTP_CODE, WWW-Authenticate '$(http_header www-authenticate)'"
fi
http_req GET "http://$BASIC/v2/auth/small/manifests/v1"
if [[ $HTTP_CODE == 401 ]]; then
    pass "basic: anonymous pull refused (anonymous_pull = false) -> 401"
else
    fail "basic: anonymous pull -> $HTTP_CODE (want 401)"
fi
if ! run "$E2E_TMP/n2.log" skopeo_ copy --dest-tls-verify=false --dest-no-creds "oci:$SMALL:small" "docker://$BASIC/auth/anon:v1"; then
    pass "basic: anonymous skopeo push is refused"
else
    fail "basic: anonymous skopeo push succeeded"
fi
if ! baseline_skip "per-repository rules (bob pull-only)"; then
    http_req POST "http://$BASIC/v2/auth/bob/blobs/uploads/" -u "$BOB"
    if [[ $HTTP_CODE == 403 && $(error_codes) == *DENIED* ]]; then
        pass "basic: pull-only bob push (POST uploads) -> 403 DENIED"
    else
        fail "basic: pull-only bob push -> $HTTP_CODE '$(error_codes)' (want 403 DENIED)"
    fi
    if ! run "$E2E_TMP/n3.log" skopeo_ copy --dest-tls-verify=false --dest-creds "$BOB" "oci:$SMALL:small" "docker://$BASIC/auth/bob:v1"; then
        pass "basic: skopeo push as pull-only bob is refused"
    else
        fail "basic: skopeo push as pull-only bob succeeded"
    fi
    # carol may push only to carol/**: she cannot read auth/small, nor mount its layers
    layer=${SRC_LAYERS%% *}
    http_req GET "http://$BASIC/v2/auth/small/blobs/$layer" -u "$CAROL"
    c1=$HTTP_CODE
    http_req POST "http://$BASIC/v2/carol/x/blobs/uploads/?mount=$layer&from=auth/small" -u "$CAROL"
    c2=$HTTP_CODE
    http_req HEAD "http://$BASIC/v2/carol/x/blobs/$layer" -u "$CAROL"
    c3=$HTTP_CODE
    if [[ $c1 == 403 && $c2 != 201 && $c3 == 404 ]]; then
        pass "basic: carol (push to carol/** only): GET auth/small blob -> 403, mount from auth/small -> $c2 (no mount), blob absent in carol/x"
    else
        fail "basic: carol: GET auth/small blob -> $c1 (want 403), mount from auth/small -> $c2 (want 202/403, not 201), HEAD carol/x blob -> $c3 (want 404)"
    fi
fi
if [[ -n $TOKEN ]]; then
    registry_token "$TOKEN" alice:wrong-password "repository:tok/small:pull" >/dev/null || true
    if [[ $HTTP_CODE == 401 ]]; then
        pass "token: /token with a wrong password -> 401"
    else
        fail "token: /token with a wrong password -> $HTTP_CODE (want 401)"
    fi
    tok=$(registry_token "$TOKEN" "$BOB" "repository:tok/bob:pull,push") || tok=""
    if [[ -n $tok ]]; then
        http_req POST "http://$TOKEN/v2/tok/bob/blobs/uploads/" -H "Authorization: Bearer $tok"
        if [[ $HTTP_CODE == 401 || $HTTP_CODE == 403 ]] && [[ $(error_codes) == *DENIED* || $(error_codes) == *UNAUTHORIZED* ]]; then
            pass "token: bob's token (pull only granted) cannot push -> $HTTP_CODE $(error_codes)"
        else
            fail "token: bob's token push -> $HTTP_CODE '$(error_codes)' (want 401/403)"
        fi
    else
        fail "token: no token for bob with scope pull,push (HTTP $HTTP_CODE; a token with the granted subset is expected)"
    fi
    tok=$(registry_token "$TOKEN" "" "repository:tok/small:pull,push") || tok=""
    http_req POST "http://$TOKEN/v2/tok/anon/blobs/uploads/" ${tok:+-H "Authorization: Bearer $tok"}
    if [[ $HTTP_CODE == 401 || $HTTP_CODE == 403 ]]; then
        pass "token: anonymous push refused -> $HTTP_CODE $(error_codes)"
    else
        fail "token: anonymous push -> $HTTP_CODE (want 401/403)"
    fi
    # a token is good only for the actions it grants, and only unaltered
    tok=$(registry_token "$TOKEN" "$ALICE" "repository:tok/small:pull") || tok=""
    http_req GET "http://$TOKEN/v2/tok/small/manifests/v1" -H "Authorization: Bearer $tok" \
        -H "Accept: application/vnd.oci.image.manifest.v1+json"
    c1=$HTTP_CODE
    http_req POST "http://$TOKEN/v2/tok/small/blobs/uploads/" -H "Authorization: Bearer $tok"
    c2=$HTTP_CODE
    # flip one character in the middle of the signature (the last may only carry padding bits)
    sig=${tok##*.}
    i=$((${#sig} / 2))
    ch=${sig:i:1}
    if [[ $ch == A ]]; then ch=B; else ch=A; fi
    bad_tok=${tok%.*}.${sig:0:i}$ch${sig:i+1}
    http_req GET "http://$TOKEN/v2/tok/small/manifests/v1" -H "Authorization: Bearer $bad_tok"
    c3=$HTTP_CODE
    if [[ -n $tok && $c1 == 200 && ($c2 == 401 || $c2 == 403) && $c3 == 401 ]]; then
        pass "token: alice's pull-only token: pull 200, push $c2; same token with a flipped signature byte -> 401"
    else
        fail "token scoping: pull $c1 (want 200), push with a pull-only token $c2 (want 401/403), tampered token $c3 (want 401)"
    fi
    if run "$E2E_TMP/n4.log" skopeo_ copy --dest-tls-verify=false --dest-creds "$BOB" "oci:$SMALL:small" "docker://$TOKEN/tok/bob:v1"; then
        fail "token: skopeo push as pull-only bob succeeded"
    else
        pass "token: skopeo push as pull-only bob is refused"
    fi
fi

# ================================================================ 4. podman
P=$E2E_TMP/podman
mkdir -p "$P"
echo 'unqualified-search-registries = []' >"$P/registries.conf"
podman_() {
    CONTAINERS_REGISTRIES_CONF=$P/registries.conf timeout 180 podman --root "$P/root" --runroot "$P/run" \
        --storage-driver vfs --cgroup-manager cgroupfs --events-backend file "$@"
}
e2e_defer "e2e_umount_under '$P'"  # vfs: normally nothing is mounted; the temp dir removal does the rest
if podman_ pull --tls-verify=false --creds "$BOB" --signature-policy "$POLICY" \
    "docker://$BASIC/auth/small:v1" >"$E2E_TMP/p1.log" 2>&1; then
    pass "podman pull --creds bob --tls-verify=false"
    dig=$(podman_ image inspect --format '{{.Digest}}' "$BASIC/auth/small:v1" 2>"$E2E_TMP/p2.log") || dig=""
    if [[ $dig == "$SRC_DIGEST" ]]; then
        pass "podman image inspect: Digest $dig == registry digest"
    else
        fail "podman image inspect: Digest '$dig', want $SRC_DIGEST"; show "$E2E_TMP/p2.log"
    fi
    id1=$(podman_ image inspect --format '{{.Id}}' "$BASIC/auth/small:v1" 2>/dev/null) || id1=""
    if podman_ push --tls-verify=false --creds "$ALICE" --signature-policy "$POLICY" \
        "$BASIC/auth/small:v1" "docker://$BASIC/podman/small:pushed" >"$E2E_TMP/p3.log" 2>&1; then
        pass "podman push --creds alice -> $BASIC/podman/small:pushed"
        cfg=$(skopeo_ inspect --raw --tls-verify=false --creds "$BOB" "docker://$BASIC/podman/small:pushed" 2>/dev/null | jq -r .config.digest) || cfg=""
        podman_ rmi -f "$BASIC/auth/small:v1" >/dev/null 2>&1 || true
        podman_ pull --tls-verify=false --creds "$BOB" --signature-policy "$POLICY" \
            "docker://$BASIC/podman/small:pushed" >"$E2E_TMP/p4.log" 2>&1 || true
        id2=$(podman_ image inspect --format '{{.Id}}' "$BASIC/podman/small:pushed" 2>/dev/null) || id2=""
        if [[ $cfg == "$SRC_CONFIG" && -n $id1 && $id2 == "$id1" ]]; then
            pass "podman push: config digest == source, pulled back image id ${id2:0:12} == original"
        else
            fail "podman push: config '$cfg' (want $SRC_CONFIG), image id '$id2' (want '$id1')"; show "$E2E_TMP/p4.log"
        fi
    else
        fail "podman push"; show "$E2E_TMP/p3.log"
    fi
else
    fail "podman pull"; show "$E2E_TMP/p1.log"
fi

# ================================================================ 5. containerd
start_containerd
REF=$BASIC/auth/small:v1
if run "$E2E_TMP/c1.log" ctr_ image pull --plain-http --user "$BOB" "$REF"; then
    pass "ctr image pull --plain-http --user bob (pull + overlayfs unpack)"
    set +e
    out=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm "$REF" "rc-$$-1" 2>&1)
    rc=$?
    out2=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm "$REF" "rc-$$-2" /bin/busybox cat /app/hello.txt 2>&1)
    rc2=$?
    set -e
    if [[ $rc == 0 && $out == "ready small" && $rc2 == 0 && $out2 == "hello from the ferry small image" ]]; then
        pass "ctr run: '$out', cat /app/hello.txt: '$out2'"
    else
        fail "ctr run: exit $rc '$out' (want 'ready small'); cat: exit $rc2 '$out2'"
    fi
else
    fail "ctr image pull --plain-http --user bob"; show "$E2E_TMP/c1.log"
fi
if ! run "$E2E_TMP/c2.log" ctr_ image pull --plain-http --user alice:wrong-password "$BASIC/auth/small:v1"; then
    pass "ctr image pull with a wrong password fails"
else
    fail "ctr image pull with a wrong password succeeded"
fi

# token mode: containerd's resolver follows the Bearer challenge (it POSTs an oauth2
# password grant to the realm first, falling back to GET)
if [[ -n $TOKEN ]]; then
    TREF=$TOKEN/tok/small:v1
    if run "$E2E_TMP/c3.log" ctr_ image pull --plain-http --user "$BOB" "$TREF"; then
        pass "ctr image pull --plain-http --user bob in token mode"
    else
        fail "ctr image pull in token mode"; show "$E2E_TMP/c3.log"
    fi
    if run "$E2E_TMP/c4.log" ctr_ image tag "$TREF" "$TOKEN/tok/ctr:pushed" &&
        run "$E2E_TMP/c5.log" ctr_ image push --plain-http --user "$ALICE" "$TOKEN/tok/ctr:pushed" &&
        run "$E2E_TMP/raw3.json" skopeo_ inspect --raw --tls-verify=false --creds "$BOB" "docker://$TOKEN/tok/ctr:pushed" &&
        [[ sha256:$(sha256sum <"$E2E_TMP/raw3.json" | cut -d' ' -f1) == "$SRC_DIGEST" ]]; then
        pass "ctr image push --plain-http --user alice in token mode; the pushed manifest is the source's"
    else
        fail "ctr image push in token mode"; show "$E2E_TMP/c4.log"; show "$E2E_TMP/c5.log"; show "$E2E_TMP/raw3.json"
    fi
    # (a new repository: ctr skips pushing what the registry already has under that name)
    run "$E2E_TMP/c6t.log" ctr_ image tag "$TREF" "$TOKEN/tok/ctr-bob:v1" || true
    if ! run "$E2E_TMP/c6.log" ctr_ image push --plain-http --user "$BOB" "$TOKEN/tok/ctr-bob:v1"; then
        pass "ctr image push as pull-only bob in token mode is refused"
    else
        fail "ctr image push as pull-only bob in token mode succeeded"
    fi
fi

# ================================================================ 6. ctr-remote eStargz
SRC=$OPEN/skopeo/small:v1
DST=$OPEN/esgz/small:esgz
if run "$E2E_TMP/r1.log" ctr_remote image pull --plain-http "$SRC" &&
    run "$E2E_TMP/r2.log" ctr_remote image optimize --no-optimize --oci "$SRC" "$DST"; then
    pass "ctr-remote pull from the registry + image optimize --no-optimize --oci"
    if run "$E2E_TMP/r3.log" ctr_ image push --plain-http "$DST"; then
        pass "ctr image push --plain-http of the eStargz image"
        rm -rf "$E2E_TMP/esgz"
        if run "$E2E_TMP/r4.log" skopeo_ copy --src-tls-verify=false "docker://$DST" "oci:$E2E_TMP/esgz:esgz"; then
            m=$(oci_manifest "$E2E_TMP/esgz" esgz)
            n=$(jq '.layers | length' <<<"$m")
            ntoc=$(jq '[.layers[] | select(.annotations["containerd.io/snapshot/stargz/toc.digest"] // "" | startswith("sha256:"))] | length' <<<"$m")
            bad=0
            for b in "$E2E_TMP"/esgz/blobs/sha256/*; do
                [[ $(sha256sum <"$b" | cut -d' ' -f1) == "$(basename "$b")" ]] || bad=$((bad + 1))
            done
            if [[ $n -gt 0 && $ntoc == "$n" && $bad == 0 ]]; then
                pass "eStargz pulled back: $ntoc/$n layers carry the toc.digest annotation, blobs verified"
            else
                fail "eStargz pulled back: $ntoc/$n layers with toc.digest, $bad blobs not matching"
            fi
        else
            fail "skopeo pull of the eStargz image"; show "$E2E_TMP/r4.log"
        fi
    else
        fail "ctr image push --plain-http (eStargz)"; show "$E2E_TMP/r3.log"
    fi
else
    fail "ctr-remote pull/optimize"; show "$E2E_TMP/r1.log"; show "$E2E_TMP/r2.log"
fi

# ================================================================ 7. ferry copy
if ! baseline_skip "ferry copy round trip (run against ferry only)"; then
    rm -rf "$E2E_TMP/fcopy"
    if run "$E2E_TMP/f1.log" "$FERRY" copy "oci:$SMALL:small" "$OPEN/fcopy/small:v1" &&
        run "$E2E_TMP/f2.log" "$FERRY" copy "$OPEN/fcopy/small:v1" "oci:$E2E_TMP/fcopy:v1"; then
        check_layout "ferry copy oci -> registry -> oci" "$E2E_TMP/fcopy" v1
        if run "$E2E_TMP/raw2.json" skopeo_ inspect --raw --tls-verify=false "docker://$OPEN/fcopy/small:v1" &&
            [[ sha256:$(sha256sum <"$E2E_TMP/raw2.json" | cut -d' ' -f1) == "$SRC_DIGEST" ]]; then
            pass "ferry copy pushed the manifest byte-identical (skopeo reads it)"
        else
            fail "ferry copy: manifest in the registry differs from the source"
        fi
    else
        fail "ferry copy round trip"; show "$E2E_TMP/f1.log"; show "$E2E_TMP/f2.log"
    fi
    # with credentials: push as alice through the Bearer challenge, pull back as bob
    if [[ -n $TOKEN ]]; then
        rm -rf "$E2E_TMP/fcopy-tok"
        if run "$E2E_TMP/f3.log" "$FERRY" copy --creds "$ALICE" "oci:$SMALL:small" "$TOKEN/fcopy/small:v1" &&
            run "$E2E_TMP/f4.log" "$FERRY" copy --creds "$BOB" "$TOKEN/fcopy/small:v1" "oci:$E2E_TMP/fcopy-tok:v1"; then
            check_layout "ferry copy --creds through token auth (push alice, pull bob)" "$E2E_TMP/fcopy-tok" v1
        else
            fail "ferry copy --creds in token mode"; show "$E2E_TMP/f3.log"; show "$E2E_TMP/f4.log"
        fi
        if ! run "$E2E_TMP/f5.log" "$FERRY" copy --creds "$BOB" "oci:$SMALL:small" "$TOKEN/fcopy/bob:v1"; then
            pass "ferry copy push as pull-only bob fails ($(grep -m1 -io 'denied[^"]*\|unauthori[^"]*' "$E2E_TMP/f5.log" | cut -c1-80))"
        else
            fail "ferry copy push as pull-only bob succeeded"
        fi
    fi
    # an indexed image: ferry's index artifacts travel as referrers of the image manifest
    IDX=$E2E_TMP/indexed
    rm -rf "$IDX" "$E2E_TMP/indexed-back"
    cp -r "$SMALL" "$IDX"
    hex=${SRC_DIGEST#sha256:}
    if run "$E2E_TMP/f6.log" "$FERRY" index --min-layer-size 0 "oci:$IDX:small" &&
        run "$E2E_TMP/f7.log" "$FERRY" copy "oci:$IDX:small" "$OPEN/fidx/small:v1" &&
        run "$E2E_TMP/f8.log" "$FERRY" copy "$OPEN/fidx/small:v1" "oci:$E2E_TMP/indexed-back:v1"; then
        want=$(oci_manifest "$IDX" "sha256-$hex" | jq -r '[.manifests[].digest] | sort | join(" ")')
        http_req GET "http://$OPEN/v2/fidx/small/referrers/$SRC_DIGEST?artifactType=application/vnd.ferry.index.v1"
        got=$(jq -r '[.manifests[].digest] | sort | join(" ")' "$HTTP_BODY" 2>/dev/null) || got=""
        back=$(oci_manifest "$E2E_TMP/indexed-back" "sha256-$hex" 2>/dev/null | jq -r '[.manifests[].digest] | sort | join(" ")') || back=""
        if [[ -n $want && $got == "$want" && $back == "$want" ]]; then
            pass "ferry copy of an indexed image: referrers API lists its index artifact(s) ($want), copied back into the layout"
        else
            fail "indexed image referrers: layout '$want', registry (artifactType filter) '$got', copied back '$back'"
        fi
        check_layout "ferry copy of an indexed image back to oci" "$E2E_TMP/indexed-back" v1
    else
        fail "ferry index / copy of the indexed image"; show "$E2E_TMP/f6.log"; show "$E2E_TMP/f7.log"; show "$E2E_TMP/f8.log"
    fi
fi

# ================================================================ 8. referrers
# push_blob ADDR REPO FILE: POST + PUT ?digest= (monolithic in two steps)
push_blob() {
    local addr=$1 repo=$2 file=$3 d loc sep
    d=sha256:$(sha256sum <"$file" | cut -d' ' -f1)
    http_req POST "http://$addr/v2/$repo/blobs/uploads/"
    [[ $HTTP_CODE == 202 ]] || return 1
    loc=$(http_header location)
    [[ $loc == http* ]] || loc=http://$addr$loc
    sep='?'
    [[ $loc == *\?* ]] && sep='&'
    http_req PUT "$loc${sep}digest=$d" -H 'Content-Type: application/octet-stream' --data-binary "@$file"
    [[ $HTTP_CODE == 201 ]]
}
# artifact_manifest FILE ARTIFACT_TYPE LAYER_FILE: manifest with subject = small:v1
artifact_manifest() {
    jq -cn --arg at "$2" --arg sd "$SRC_DIGEST" --argjson ss "$SRC_SIZE" \
        --arg ld "sha256:$(sha256sum <"$3" | cut -d' ' -f1)" --argjson ls "$(stat -c %s "$3")" '{
        schemaVersion: 2, mediaType: "application/vnd.oci.image.manifest.v1+json", artifactType: $at,
        config: {mediaType: "application/vnd.oci.empty.v1+json", size: 2,
                 digest: "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"},
        layers: [{mediaType: "application/octet-stream", digest: $ld, size: $ls}],
        subject: {mediaType: "application/vnd.oci.image.manifest.v1+json", digest: $sd, size: $ss},
        annotations: {"org.opencontainers.image.created": "2026-01-01T00:00:00Z"}}' >"$1"
}
if ! baseline_skip "referrers API (distribution 2.8 has none)"; then
    printf '{}' >"$E2E_TMP/empty.json"
    echo "signature bytes $$" >"$E2E_TMP/sig.bin"
    echo "sbom bytes $$" >"$E2E_TMP/sbom.bin"
    ok=1
    for f in empty.json sig.bin sbom.bin; do
        push_blob "$OPEN" skopeo/small "$E2E_TMP/$f" || { ok=0; fail "referrers: blob push $f -> $HTTP_CODE $(error_codes)"; }
    done
    declare -A ART
    for t in sig sbom; do
        artifact_manifest "$E2E_TMP/$t.manifest.json" "application/vnd.ferry.e2e.$t" "$E2E_TMP/$t.bin"
        ART[$t]=sha256:$(sha256sum <"$E2E_TMP/$t.manifest.json" | cut -d' ' -f1)
        http_req PUT "http://$OPEN/v2/skopeo/small/manifests/${ART[$t]}" \
            -H 'Content-Type: application/vnd.oci.image.manifest.v1+json' --data-binary "@$E2E_TMP/$t.manifest.json"
        if [[ $HTTP_CODE == 201 && $(http_header oci-subject) == "$SRC_DIGEST" ]]; then
            :
        else
            ok=0
            fail "referrers: PUT $t artifact -> $HTTP_CODE '$(error_codes)', OCI-Subject '$(http_header oci-subject)' (want 201 + $SRC_DIGEST)"
        fi
    done
    [[ $ok == 1 ]] && pass "referrers: 2 artifacts with subject pushed (201, OCI-Subject: $SRC_DIGEST)"
    http_req GET "http://$OPEN/v2/skopeo/small/referrers/$SRC_DIGEST"
    got=$(jq -r '[.manifests[] | "\(.digest)=\(.artifactType)"] | sort | join(" ")' "$HTTP_BODY" 2>/dev/null) || got=""
    want=$(printf '%s\n' "${ART[sbom]}=application/vnd.ferry.e2e.sbom" "${ART[sig]}=application/vnd.ferry.e2e.sig" | sort | tr '\n' ' ')
    ct=$(http_header content-type)
    if [[ $HTTP_CODE == 200 && "$got " == "$want" && $ct == application/vnd.oci.image.index.v1+json* &&
        $(jq -r .mediaType "$HTTP_BODY") == application/vnd.oci.image.index.v1+json ]]; then
        pass "referrers: GET lists both artifacts with artifactType ($ct)"
    else
        fail "referrers: GET -> $HTTP_CODE, content-type '$ct', got '$got' want '$want'"; show "$HTTP_BODY"
    fi
    http_req GET "http://$OPEN/v2/skopeo/small/referrers/$SRC_DIGEST?artifactType=application/vnd.ferry.e2e.sig"
    got=$(jq -r '[.manifests[].digest] | join(" ")' "$HTTP_BODY" 2>/dev/null) || got=""
    if [[ $HTTP_CODE == 200 && $got == "${ART[sig]}" && $(http_header oci-filters-applied) == *artifactType* ]]; then
        pass "referrers: ?artifactType= filter returns only the signature (OCI-Filters-Applied: artifactType)"
    else
        fail "referrers: filter -> $HTTP_CODE, got '$got' want '${ART[sig]}', OCI-Filters-Applied '$(http_header oci-filters-applied)'"
    fi
    http_req GET "http://$OPEN/v2/skopeo/small/referrers/sha256:$(printf x | sha256sum | cut -d' ' -f1)"
    if [[ $HTTP_CODE == 200 && $(jq -r '.manifests | length' "$HTTP_BODY" 2>/dev/null) == 0 ]]; then
        pass "referrers: unknown subject -> 200 with an empty index"
    else
        fail "referrers: unknown subject -> $HTTP_CODE"; show "$HTTP_BODY"
    fi
fi

e2e_summary
