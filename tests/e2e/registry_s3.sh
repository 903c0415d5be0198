#!/usr/bin/env bash
# tests/e2e/registry_s3.sh — `ferry registry serve` on S3 storage (`[storage] type = "s3"`)
# against a real S3-protocol server (moto's, started by scripts/s3-server.sh on a private
# port, one key prefix per run), with several replicas sharing the bucket.
#
#   bash tests/e2e/registry_s3.sh
#
# Replicas: A and B (proxying blob bytes) and R (`redirect = true`), all on the same bucket
# and prefix, each on its own port, no state of their own.
# Checks:
#  1. skopeo push of the small image to A, skopeo pull from B: manifest, config and layer
#     digests equal the source, blobs verified.
#  2. A chunked upload of a 12 MiB blob (multipart on S3) started on A and finished on B:
#     POST on A, PATCH (6 MiB) on A, an out-of-order PATCH on B -> 416 (B sees A's
#     progress), PUT with the last 6 MiB + digest on B -> 201; A and B both serve it, the
#     bytes hash to the digest; no upload parts are left in the bucket.
#  3. R answers a blob GET with 307 to a presigned URL on the S3 endpoint; `curl -L`
#     through it gets the right bytes; a Range GET through it too; skopeo pulls the image
#     from R with the right digests.
#  4. `ferry registry gc --grace 0`: an image whose manifest was DELETEd loses its
#     unreferenced blobs from the bucket (checked by listing the bucket); an image made
#     untagged by pushing over its tag goes with `--delete-untagged`; blobs the tagged
#     image shares are kept, and the tagged image still pulls from B.
# Env: FERRY (binary), OUT (tests/e2e/out), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_cmd skopeo jq curl sha256sum python3 timeout
python3 -c 'import boto3' 2>/dev/null || skip "python3 boto3 missing (comes with moto: pip install 'moto[server]')"

find_ferry
e2e_init
[[ -x $FERRY ]] || e2e_die "ferry binary not found: $FERRY"
small_image

SRC_DIGEST=$(jq -r '.manifests[0].digest' "$SMALL/index.json")
SRC_MANIFEST=$(oci_manifest "$SMALL" small)
SRC_CONFIG=$(jq -r .config.digest <<<"$SRC_MANIFEST")
SRC_LAYERS=$(jq -r '[.layers[].digest] | join(" ")' <<<"$SRC_MANIFEST")
POLICY=$E2E_TMP/policy.json
echo '{"default":[{"type":"insecureAcceptAnything"}]}' >"$POLICY"
show() { sed 's/^/    | /' "$1" | tail -"${2:-8}" || true; }
run() { # LOG CMD...: CMD with a 120 s timeout, output to LOG (`sk` = skopeo with the policy)
    local log=$1
    shift
    [[ $1 == sk ]] && { shift; set -- skopeo --policy "$POLICY" "$@"; }
    timeout 120 "$@" >"$log" 2>&1
}
error_codes() { jq -r '[.errors[]?.code] | join(" ")' "$HTTP_BODY" 2>/dev/null || true; }
sha() { sha256sum <"$1" | cut -d' ' -f1; }

# ---------------------------------------------------------------- S3 server (private)
export FERRY_S3_PORT FERRY_S3_STATE=$E2E_TMP/s3 FERRY_S3_BUCKET=ferry-e2e
FERRY_S3_PORT=$(free_port)
s3_env=$(bash "$FERRY_ROOT/scripts/s3-server.sh" 2>"$E2E_TMP/s3-server.log") ||
    { show "$E2E_TMP/s3-server.log"; e2e_die "scripts/s3-server.sh failed"; }
e2e_defer "FERRY_S3_STATE=$FERRY_S3_STATE bash '$FERRY_ROOT/scripts/s3-server.sh' stop"
eval "$s3_env"
PREFIX=e2e-$(date +%s)-$$
e2e_log "moto on $FERRY_TEST_S3_ENDPOINT, bucket $FERRY_TEST_S3_BUCKET, prefix $PREFIX/"

# s3_keys SUBPREFIX: every key under $PREFIX/SUBPREFIX (one per line, prefix stripped)
s3_keys() {
    python3 - "$1" <<'PY'
import os, sys, boto3
s3 = boto3.client("s3", endpoint_url=os.environ["FERRY_TEST_S3_ENDPOINT"],
                  region_name=os.environ["FERRY_TEST_S3_REGION"],
                  aws_access_key_id=os.environ["FERRY_TEST_S3_ACCESS_KEY_ID"],
                  aws_secret_access_key=os.environ["FERRY_TEST_S3_SECRET_ACCESS_KEY"])
root = os.environ["S3_PREFIX"] + "/"
for page in s3.get_paginator("list_objects_v2").paginate(Bucket=os.environ["FERRY_TEST_S3_BUCKET"], Prefix=root + sys.argv[1]):
    for o in page.get("Contents", []):
        print(o["Key"][len(root):])
PY
}
export S3_PREFIX=$PREFIX FERRY_TEST_S3_ENDPOINT FERRY_TEST_S3_REGION FERRY_TEST_S3_BUCKET \
    FERRY_TEST_S3_ACCESS_KEY_ID FERRY_TEST_S3_SECRET_ACCESS_KEY
blob_in_bucket() { # DIGEST -> 0 if blobs/sha256/<ab>/<hex> exists
    local h=${1#sha256:}
    [[ -n $(s3_keys "blobs/sha256/${h:0:2}/$h") ]]
}

CACHE_TTL_SECS=1
s3_config() { # FILE REDIRECT(true|false)
    cat >"$1" <<EOF
[storage]
type = "s3"
bucket = "$FERRY_TEST_S3_BUCKET"
region = "$FERRY_TEST_S3_REGION"
endpoint = "$FERRY_TEST_S3_ENDPOINT"
access_key_id = "$FERRY_TEST_S3_ACCESS_KEY_ID"
secret_access_key = "$FERRY_TEST_S3_SECRET_ACCESS_KEY"
prefix = "$PREFIX/"
allow_http = true
redirect = $2
redirect_expiry_secs = 300

# Replicas cache tags and links for this long; a retag on one replica is seen by the
# others within it (docs/registry.md). Short here so the cross-replica checks can wait it out.
[memory_cache]
ttl = "${CACHE_TTL_SECS}s"
EOF
}
# start_replica NAME CONFIG: like lib.sh's start_ferry_registry but without --root (which
# would switch storage to the filesystem); sets REG_ADDR, REG_PID, REG_LOG
start_replica() {
    local port
    port=$(free_port)
    REG_ADDR=127.0.0.1:$port
    REG_LOG=$E2E_TMP/$1.log
    # shellcheck disable=SC2034 # read by lib.sh's _wait_registry_up
    REG_DATA="s3://$FERRY_TEST_S3_BUCKET/$PREFIX/"
    "$FERRY" registry serve --config "$2" --addr "$REG_ADDR" >"$REG_LOG" 2>&1 &
    REG_PID=$!
    E2E_PIDS+=("$REG_PID")
    _wait_registry_up "ferry replica $1"
}
s3_config "$E2E_TMP/s3.toml" false
s3_config "$E2E_TMP/s3-redirect.toml" true
start_replica a "$E2E_TMP/s3.toml" || { fail "start replica A"; e2e_summary || exit 1; }
A=$REG_ADDR
start_replica b "$E2E_TMP/s3.toml" || { fail "start replica B"; e2e_summary || exit 1; }
B=$REG_ADDR
start_replica r "$E2E_TMP/s3-redirect.toml" || { fail "start replica R (redirect)"; e2e_summary || exit 1; }
R=$REG_ADDR

check_layout() { # NAME DIR TAG
    local name=$1 dir=$2 tag=$3 got m bad=0 b
    got=$(jq -r '.manifests[0].digest' "$dir/index.json" 2>/dev/null) || got=""
    m=$(oci_manifest "$dir" "$tag" 2>/dev/null) || m='{}'
    for b in "$dir"/blobs/sha256/*; do
        [[ -f $b && $(sha "$b") == "$(basename "$b")" ]] || bad=$((bad + 1))
    done
    if [[ $got == "$SRC_DIGEST" && $(jq -r '.config.digest // ""' <<<"$m") == "$SRC_CONFIG" &&
        $(jq -r '[.layers[]?.digest] | join(" ")' <<<"$m") == "$SRC_LAYERS" && $bad == 0 ]]; then
        pass "$name: manifest $got, config and layer digests equal the source, blobs verified"
    else
        fail "$name: manifest '$got' (want $SRC_DIGEST), $bad blobs not matching"
    fi
}

# ================================================================ 1. push to A, pull from B
if run "$E2E_TMP/push.log" sk copy --dest-tls-verify=false "oci:$SMALL:small" "docker://$A/app/small:v1"; then
    pass "skopeo push to replica A ($A)"
    if run "$E2E_TMP/pullb.log" sk copy --src-tls-verify=false "docker://$B/app/small:v1" "oci:$E2E_TMP/fromb:v1"; then
        check_layout "skopeo pull from replica B ($B)" "$E2E_TMP/fromb" v1
    else
        fail "skopeo pull from replica B"; show "$E2E_TMP/pullb.log"
    fi
else
    fail "skopeo push to replica A"; show "$E2E_TMP/push.log"
fi
n=$(s3_keys "blobs/" | wc -l)
[[ $n -ge 3 ]] && pass "the bucket holds $n blob objects (config, layer, manifest) under $PREFIX/blobs/" || fail "bucket listing under $PREFIX/blobs/: $n keys"

# ================================================================ 2. chunked upload across replicas
head -c $((6 << 20)) /dev/urandom >"$E2E_TMP/part1"
head -c $((6 << 20)) /dev/urandom >"$E2E_TMP/part2"
cat "$E2E_TMP/part1" "$E2E_TMP/part2" >"$E2E_TMP/whole"
WHOLE=sha256:$(sha "$E2E_TMP/whole")
N1=$(stat -c %s "$E2E_TMP/part1")
NW=$(stat -c %s "$E2E_TMP/whole")
url_on() { # ADDR LOCATION -> absolute URL of LOCATION's path on ADDR
    local p=$2
    [[ $p == http* ]] && p=/${p#http*://*/}
    echo "http://$1$p"
}
http_req POST "http://$A/v2/app/chunked/blobs/uploads/"
loc=$(http_header location)
post=$HTTP_CODE
http_req PATCH "$(url_on "$A" "$loc")" -H 'Content-Type: application/octet-stream' \
    -H "Content-Range: 0-$((N1 - 1))" --data-binary "@$E2E_TMP/part1"
patch="$HTTP_CODE $(http_header range)"
loc=$(http_header location)
if [[ $post == 202 && $patch == "202 0-$((N1 - 1))" ]]; then
    pass "chunked upload: POST on A -> 202, PATCH of $N1 bytes on A -> 202 Range: 0-$((N1 - 1))"
else
    fail "chunked upload on A: POST $post, PATCH '$patch'"
fi
http_req PATCH "$(url_on "$B" "$loc")" -H 'Content-Type: application/octet-stream' \
    -H "Content-Range: 0-$((N1 - 1))" --data-binary "@$E2E_TMP/part2"
if [[ $HTTP_CODE == 416 ]]; then
    pass "B refuses an out-of-order chunk of A's session (416): it sees A's progress"
else
    fail "out-of-order PATCH on B -> $HTTP_CODE $(error_codes) (want 416)"
fi
http_req GET "$(url_on "$B" "$loc")"
status_b="$HTTP_CODE $(http_header range)"
sep='?'
[[ $loc == *\?* ]] && sep='&'
http_req PUT "$(url_on "$B" "$loc")${sep}digest=$WHOLE" -H 'Content-Type: application/octet-stream' \
    --data-binary "@$E2E_TMP/part2"
put="$HTTP_CODE $(http_header docker-content-digest)"
if [[ $put == "201 $WHOLE" ]]; then
    pass "PUT with the last $((NW - N1)) bytes + digest on B -> 201 ($WHOLE); upload status on B was '$status_b'"
else
    fail "PUT on B -> '$put' $(error_codes) (want 201 $WHOLE); status on B '$status_b'"
fi
ok=0
for addr in "$A" "$B"; do
    http_req GET "http://$addr/v2/app/chunked/blobs/$WHOLE"
    [[ $HTTP_CODE == 200 && $(sha "$HTTP_BODY") == "${WHOLE#sha256:}" ]] && ok=$((ok + 1))
done
: >"$HTTP_BODY"
[[ $ok == 2 ]] && pass "the 12 MiB blob is served by A and by B, bytes hash to its digest" ||
    fail "the cross-replica blob: $ok/2 replicas serve it correctly"
left=$(s3_keys "uploads/" | wc -l)
[[ $left == 0 ]] && pass "no upload objects left in the bucket after completion" ||
    fail "$left upload objects left under $PREFIX/uploads/"

# ================================================================ 3. redirects to presigned URLs
LAYER=${SRC_LAYERS%% *}
http_req GET "http://$R/v2/app/small/blobs/$LAYER"
loc=$(http_header location)
if [[ $HTTP_CODE == 307 && $loc == "$FERRY_TEST_S3_ENDPOINT"/* && $loc == *X-Amz-Signature=* ]]; then
    pass "R: blob GET -> 307 to a presigned URL on the S3 endpoint (${loc%%\?*}?…)"
else
    fail "R: blob GET -> $HTTP_CODE, Location '${loc:0:120}'"
fi
http_req GET "http://$R/v2/app/small/blobs/$LAYER" -L
if [[ $HTTP_CODE == 200 && $(sha "$HTTP_BODY") == "${LAYER#sha256:}" ]]; then
    pass "curl -L through the redirect gets the layer ($(stat -c %s "$HTTP_BODY") bytes, digest verified)"
else
    fail "curl -L through the redirect -> $HTTP_CODE"
fi
http_req GET "http://$R/v2/app/small/blobs/$LAYER" -L -H 'Range: bytes=100-199'
if [[ $HTTP_CODE == 206 && $(stat -c %s "$HTTP_BODY") == 100 &&
    $(sha "$HTTP_BODY") == $(tail -c +101 "$SMALL/blobs/sha256/${LAYER#sha256:}" | head -c 100 | sha256sum | cut -d' ' -f1) ]]; then
    pass "Range GET through the redirect -> 206 with the right 100 bytes"
else
    fail "Range GET through the redirect -> $HTTP_CODE, $(stat -c %s "$HTTP_BODY") bytes"
fi
: >"$HTTP_BODY"
http_req GET "http://$R/v2/app/small/blobs/$WHOLE"
[[ $HTTP_CODE == 404 ]] && pass "R: a blob not linked to the repository is 404, not a redirect" ||
    fail "R: unlinked blob -> $HTTP_CODE (Location '$(http_header location | cut -c1-60)')"
if run "$E2E_TMP/pullr.log" sk copy --src-tls-verify=false "docker://$R/app/small:v1" "oci:$E2E_TMP/fromr:v1"; then
    check_layout "skopeo pull from R through the redirects" "$E2E_TMP/fromr" v1
else
    fail "skopeo pull from R (redirect)"; show "$E2E_TMP/pullr.log"
fi

# ================================================================ 4. garbage collection
# random_image DIR TAG: a one-layer image of fresh random data (unique blobs)
random_image() {
    python3 - "$1" "$2" <<'PY'
import gzip, hashlib, io, json, os, sys, tarfile
out, tag = sys.argv[1], sys.argv[2]
os.makedirs(f"{out}/blobs/sha256", exist_ok=True)
def put(data):
    d = hashlib.sha256(data).hexdigest()
    open(f"{out}/blobs/sha256/{d}", "wb").write(data)
    return f"sha256:{d}", len(data)
raw = io.BytesIO()
with tarfile.open(fileobj=raw, mode="w") as t:
    data = os.urandom(256 << 10)
    info = tarfile.TarInfo("data.bin"); info.size = len(data)
    t.addfile(info, io.BytesIO(data))
tar = raw.getvalue()
ld, ln = put(gzip.compress(tar, 1))
cfg = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers",
      "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]}, "nonce": os.urandom(8).hex()}).encode()
cd, cn = put(cfg)
m = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": ld, "size": ln}]}).encode()
md, mn = put(m)
json.dump({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
    "digest": md, "size": mn, "annotations": {"org.opencontainers.image.ref.name": tag}}]}, open(f"{out}/index.json", "w"))
open(f"{out}/oci-layout", "w").write('{"imageLayoutVersion":"1.0.0"}')
PY
}
image_blobs() { # DIR TAG -> config + layer digests
    oci_manifest "$1" "$2" | jq -r '.config.digest, .layers[].digest'
}
random_image "$E2E_TMP/gone" v1
random_image "$E2E_TMP/old" v1
random_image "$E2E_TMP/new" v1
GONE_M=$(jq -r '.manifests[0].digest' "$E2E_TMP/gone/index.json")
OLD_M=$(jq -r '.manifests[0].digest' "$E2E_TMP/old/index.json")
ok=1
run "$E2E_TMP/g1.log" sk copy --dest-tls-verify=false "oci:$E2E_TMP/gone:v1" "docker://$A/gc/gone:v1" || ok=0
run "$E2E_TMP/g2.log" sk copy --dest-tls-verify=false "oci:$E2E_TMP/old:v1" "docker://$A/gc/retag:v1" || ok=0
run "$E2E_TMP/g3.log" sk copy --dest-tls-verify=false "oci:$E2E_TMP/new:v1" "docker://$B/gc/retag:v1" || ok=0
http_req DELETE "http://$A/v2/gc/gone/manifests/$GONE_M"
del=$HTTP_CODE
if [[ $ok == 1 && $del == 202 ]]; then
    pass "gc setup: gc/gone pushed and its manifest DELETEd (202); gc/retag:v1 pushed over on B (old manifest untagged)"
else
    fail "gc setup: pushes ok=$ok, DELETE -> $del $(error_codes)"
fi
present() { # DIGESTS... -> how many are in the bucket
    local d n=0
    for d in "$@"; do blob_in_bucket "$d" && n=$((n + 1)); done
    echo $n
}
mapfile -t GONE_B < <(image_blobs "$E2E_TMP/gone" v1)
mapfile -t OLD_B < <(image_blobs "$E2E_TMP/old" v1)
mapfile -t NEW_B < <(image_blobs "$E2E_TMP/new" v1)
# (the chunked-upload blob is linked to app/chunked but no manifest references it: garbage too)
read -ra KEEP_B <<<"$SRC_CONFIG $SRC_LAYERS"
before="gone $(present "${GONE_B[@]}")/${#GONE_B[@]}, untagged $(present "${OLD_B[@]}")/${#OLD_B[@]}"
if run "$E2E_TMP/gc1.log" "$FERRY" registry gc --config "$E2E_TMP/s3.toml" --grace 0; then
    g=$(present "${GONE_B[@]}") o=$(present "${OLD_B[@]}") k=$(present "${KEEP_B[@]}" "${NEW_B[@]}")
    if [[ $g == 0 && $o == "${#OLD_B[@]}" && $k == $((${#KEEP_B[@]} + ${#NEW_B[@]})) ]]; then
        pass "gc --grace 0 removed the DELETEd image's ${#GONE_B[@]} blobs from the bucket (before: $before), kept the untagged and tagged ones ($(head -1 "$E2E_TMP/gc1.log"))"
    else
        fail "gc --grace 0: deleted image's blobs left $g/${#GONE_B[@]}, untagged kept $o/${#OLD_B[@]} (without --delete-untagged), referenced kept $k/$((${#KEEP_B[@]} + ${#NEW_B[@]}))"; show "$E2E_TMP/gc1.log"
    fi
else
    fail "ferry registry gc"; show "$E2E_TMP/gc1.log"
fi
if run "$E2E_TMP/gc2.log" "$FERRY" registry gc --config "$E2E_TMP/s3.toml" --grace 0 --delete-untagged; then
    o=$(present "${OLD_B[@]}") k=$(present "${KEEP_B[@]}" "${NEW_B[@]}")
    m=$(s3_keys "repositories/gc/retag/_manifests/revisions/sha256/${OLD_M#sha256:}" | wc -l)
    if [[ $o == 0 && $m == 0 && $k == $((${#KEEP_B[@]} + ${#NEW_B[@]})) ]]; then
        pass "gc --grace 0 --delete-untagged removed the untagged manifest and its ${#OLD_B[@]} blobs, kept every referenced blob ($(head -1 "$E2E_TMP/gc2.log"))"
    else
        fail "gc --delete-untagged: untagged blobs left $o/${#OLD_B[@]}, its manifest revision objects $m, referenced kept $k/$((${#KEEP_B[@]} + ${#NEW_B[@]}))"; show "$E2E_TMP/gc2.log"
    fi
else
    fail "ferry registry gc --delete-untagged"; show "$E2E_TMP/gc2.log"
fi
rm -rf "$E2E_TMP/fromb"
if run "$E2E_TMP/pullb2.log" sk copy --src-tls-verify=false "docker://$B/app/small:v1" "oci:$E2E_TMP/fromb:v1"; then
    check_layout "after gc: the tagged image still pulls from B" "$E2E_TMP/fromb" v1
else
    fail "after gc: pull of the tagged image from B"; show "$E2E_TMP/pullb2.log"
fi
rm -rf "$E2E_TMP/newback"
# A may have cached gc/retag:v1 -> the old manifest when it was pushed there; the retag on
# B reaches A within the cache TTL, and gc has since deleted the old manifest's blobs.
sleep $((CACHE_TTL_SECS + 1))
if run "$E2E_TMP/pulln.log" sk copy --src-tls-verify=false "docker://$A/gc/retag:v1" "oci:$E2E_TMP/newback:v1" &&
    [[ $(jq -r '.manifests[0].digest' "$E2E_TMP/newback/index.json") == $(jq -r '.manifests[0].digest' "$E2E_TMP/new/index.json") ]]; then
    pass "after gc: gc/retag:v1 (the new manifest) pulls from A once its ${CACHE_TTL_SECS}s tag cache expired"
else
    fail "after gc: gc/retag:v1 pull from A"; show "$E2E_TMP/pulln.log"
fi

# ---------------------------------------------------------------- leave the bucket clean
python3 - <<'PY' || true
import os, boto3
s3 = boto3.client("s3", endpoint_url=os.environ["FERRY_TEST_S3_ENDPOINT"], region_name=os.environ["FERRY_TEST_S3_REGION"],
                  aws_access_key_id=os.environ["FERRY_TEST_S3_ACCESS_KEY_ID"], aws_secret_access_key=os.environ["FERRY_TEST_S3_SECRET_ACCESS_KEY"])
b = os.environ["FERRY_TEST_S3_BUCKET"]
for page in s3.get_paginator("list_objects_v2").paginate(Bucket=b, Prefix=os.environ["S3_PREFIX"] + "/"):
    keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
    if keys:
        s3.delete_objects(Bucket=b, Delete={"Objects": keys})
PY
e2e_summary
