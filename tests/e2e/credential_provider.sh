#!/usr/bin/env bash
# tests/e2e/credential_provider.sh — kubelet credential provider plugins: ferry reads the
# kubelet's CredentialProviderConfig, runs the plugin on demand (exec protocol: a
# CredentialProviderRequest on stdin, a CredentialProviderResponse on stdout) and keeps
# its answer in memory only, until the cacheDuration it gives.
#
#   bash tests/e2e/credential_provider.sh
#
# Setup: the small image indexed, pushed to a private repository of ferry's registry
# with token auth (`mode = "token"`, token_ttl 2 s; `robot` may pull private/**, nobody
# anonymous); a test plugin (a shell script) answering robot's password with
# cacheDuration 3s and counting its runs; a YAML config in the kubelet's format.
# 1. Without the plugin: `ferry mount` of the private image fails, unauthorized.
# 2. With --image-credential-provider-config/-bin-dir: the mount works lazily; its
#    files equal the image's; the plugin got a CredentialProviderRequest for the image.
# 3. Mid-run expiry: after the plugin's answer (3 s) and the token (2 s) expired, a cold
#    file is read through the same mount: it works and the plugin was asked again.
# 4. Wrong credentials from the plugin: a new mount fails with an error naming the
#    credential provider, the plugin was asked exactly twice (once more after the
#    refusal), and nothing was fetched into the mount's store.
# 5. The node daemon with `[registry] credential_provider_config`: `ferry mount` through
#    it reads the private image.
# 6. Neither the password nor robot:password in base64 is anywhere under ferry's
#    directories, stores, stats files and logs (grep -r).
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), OUT,
#      FERRY_TIMEOUT (seconds per ferry call, 120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

mount_prologue base64
"$FERRY" mount --help | grep -q -- --image-credential-provider-config ||
    { fail "ferry mount has no --image-credential-provider-config"; e2e_summary || exit 1; }

IMG=$E2E_TMP/img
indexed_small "$IMG"
reference_tree "$IMG"

PW="plugin-pw-$RANDOM$RANDOM-only-in-memory"
PW_B64=$(printf 'robot:%s' "$PW" | base64 -w0)
make_htpasswd "$E2E_TMP/htpasswd" pusher pushpw robot "$PW" || e2e_die "no htpasswd"
token_auth_toml "$E2E_TMP/reg.toml" 2s "private/** pusher *" "private/** robot pull"
start_ferry_registry reg "$E2E_TMP/reg.toml" || e2e_die "ferry registry did not start"
REG=$REG_ADDR
IMAGE=$REG/private/app:v1
mkdir -p "$E2E_TMP/docker-pusher"
printf '{"auths":{"%s":{"auth":"%s"}}}\n' "$REG" "$(printf pusher:pushpw | base64 -w0)" \
    >"$E2E_TMP/docker-pusher/config.json"
DOCKER_CONFIG=$E2E_TMP/docker-pusher fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy --plain-http "oci:$IMG:small" "$IMAGE"
[[ $RC == 0 ]] || { show "$E2E_TMP/cp.err"; e2e_die "ferry copy to the private repository failed"; }

# The plugin and its password live apart (in $PLUG), outside everything grepped later.
PLUG=$E2E_TMP/plugin
mkdir -p "$PLUG/bin"
printf '%s' "$PW" >"$PLUG/password"
cat >"$PLUG/bin/ferry-test-provider" <<EOF
#!/bin/sh
# A kubelet credential provider: the request on stdin, the answer on stdout.
req=\$(cat)
echo "\$req" >> "$PLUG/requests"
echo run >> "$PLUG/runs"
pw=\$(cat "$PLUG/password")
printf '{"apiVersion":"credentialprovider.kubelet.k8s.io/v1","kind":"CredentialProviderResponse","cacheKeyType":"Registry","cacheDuration":"3s","auth":{"%s":{"username":"robot","password":"%s"}}}\n' "$REG" "\$pw"
EOF
chmod 755 "$PLUG/bin/ferry-test-provider"
runs() { [[ -f $PLUG/runs ]] && wc -l <"$PLUG/runs" || echo 0; }
cat >"$E2E_TMP/credprov.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1
kind: CredentialProviderConfig
providers:
  - name: ferry-test-provider
    matchImages:
      - "$REG"
    defaultCacheDuration: "10m"
    apiVersion: credentialprovider.kubelet.k8s.io/v1
EOF
KUBELET=(--image-credential-provider-config "$E2E_TMP/credprov.yaml"
    --image-credential-provider-bin-dir "$PLUG/bin")

# Isolated from the machine's own auth files.
export DOCKER_CONFIG=$E2E_TMP/no-docker REGISTRY_AUTH_FILE=$E2E_TMP/no-auth.json
unset XDG_RUNTIME_DIR || true

# mount_image N [ARGS...]: `ferry mount` (own detached process, store $E2E_TMP/storeN)
mount_image() {
    local n=$1
    shift
    mkdir -p "$E2E_TMP/mnt$n"
    fy "$E2E_TMP/m$n.out" "$E2E_TMP/m$n.err" mount "$IMAGE" "$E2E_TMP/mnt$n" --store "$E2E_TMP/store$n" \
        --stats-file "$E2E_TMP/stats$n.json" --registry-config-path "$E2E_TMP/no-certs.d" --timeout 20 "$@"
}
umount_image() { timeout 60 "$FERRY" umount "$E2E_TMP/mnt$1" >/dev/null 2>&1 || umount -l "$E2E_TMP/mnt$1" 2>/dev/null || true; }

# Two regular files of the image, read at different times.
mapfile -t FILES < <(cd "$REF" && find . -type f -size +1k | LC_ALL=C sort | head -40)
((${#FILES[@]} >= 2)) || e2e_die "the small image has too few files"
FIRST=${FILES[0]}
LAST=${FILES[-1]}

# 1. no plugin: refused
mount_image 1
if [[ $RC != 0 ]] && grep -qi "unauthorized\|credentials" "$E2E_TMP/m1.err"; then
    pass "without the plugin the private image is refused ($(grep -oi 'no credentials[^;]*' "$E2E_TMP/m1.err" | head -1))"
else
    fail "mount without credentials: exit $RC"
    show "$E2E_TMP/m1.err"
    umount_image 1
fi

# 2. with the plugin
mount_image 2 "${KUBELET[@]}"
if [[ $RC == 0 ]] && mountpoint -q "$E2E_TMP/mnt2" && same_as_ref "$E2E_TMP/mnt2" "$FIRST"; then
    pass "with the credential provider the private image mounts and $FIRST reads back equal (plugin runs: $(runs))"
else
    fail "mount with the credential provider: exit $RC"
    show "$E2E_TMP/m2.err"
fi
if [[ -s $PLUG/requests ]] && jq -e --arg img "$REG/private/app" \
    'select(.kind == "CredentialProviderRequest" and .apiVersion == "credentialprovider.kubelet.k8s.io/v1" and .image == $img)' \
    <(head -1 "$PLUG/requests" 2>/dev/null) >/dev/null 2>&1; then
    pass "the plugin got a CredentialProviderRequest for $REG/private/app"
else
    fail "the plugin's request: $(head -1 "$PLUG/requests" 2>/dev/null)"
fi

# 2b. --platform resolves the image through the same client: with the plugin's credentials
mount_image 6 "${KUBELET[@]}" --platform "linux/$(dpkg --print-architecture)"
if [[ $RC == 0 ]] && mountpoint -q "$E2E_TMP/mnt6" && same_as_ref "$E2E_TMP/mnt6" "$FIRST"; then
    pass "--platform with the credential provider: the private image resolves, mounts and reads back"
else
    fail "mount --platform with the credential provider: exit $RC"
    show "$E2E_TMP/m6.err"
fi
umount_image 6
# ferry trace asks the registry with the plugin's credentials too (the image has no trace)
fy "$E2E_TMP/t.out" "$E2E_TMP/t.err" trace show "$IMAGE" --registry-config-path "$E2E_TMP/no-certs.d" \
    "${KUBELET[@]}" --platform "linux/$(dpkg --print-architecture)"
if grep -qi "no .*trace" "$E2E_TMP/t.out" "$E2E_TMP/t.err" && ! grep -qi "unauthorized\|credentials" "$E2E_TMP/t.err"; then
    pass "ferry trace show with the credential provider reaches the private repository ($(grep -hi "trace" "$E2E_TMP/t.out" "$E2E_TMP/t.err" | head -1))"
else
    fail "ferry trace show with the credential provider: exit $RC"
    show "$E2E_TMP/t.err"
fi

# 3. expiry mid-run: the answer (3 s) and the token (2 s) expire; a cold file still reads
before=$(runs)
sleep 5
if mountpoint -q "$E2E_TMP/mnt2" && same_as_ref "$E2E_TMP/mnt2" "$LAST" && (($(runs) > before)); then
    pass "after the plugin's answer and the token expired, a cold file ($LAST) reads; the plugin was asked again ($before → $(runs) runs)"
else
    fail "cold read after expiry (runs $before → $(runs))"
    show "$E2E_TMP/m2.err"
fi
umount_image 2

# 4. wrong credentials from the plugin
printf 'wrong-%s' "$RANDOM" >"$PLUG/password"
before=$(runs)
mount_image 4 "${KUBELET[@]}"
after=$(runs)
if [[ $RC != 0 ]] && grep -q "credential provider" "$E2E_TMP/m4.err" && ((after - before == 2)); then
    pass "wrong credentials from the plugin: the mount fails naming the credential provider; the plugin was asked once more, not in a loop"
else
    fail "wrong credentials: exit $RC, plugin runs $before → $after"
    show "$E2E_TMP/m4.err"
    umount_image 4
fi
chunks=$({ find "$E2E_TMP/store4" -type f -size +0 2>/dev/null || true; } | { grep -v -e '\.lock$' -e 'meta' || true; } | wc -l)
if ((chunks == 0)); then
    pass "nothing was fetched into the store for the refused mount"
else
    fail "the refused mount left $chunks files in its store"
    find "$E2E_TMP/store4" -type f | head -5 | show /dev/stdin
fi
printf '%s' "$PW" >"$PLUG/password"

# 5. the daemon with [registry] credential_provider_config
CTL_SOCK=$E2E_TMP/run/daemon.sock
mkdir -p "$E2E_TMP/run"
cat >"$E2E_TMP/daemon.toml" <<EOF
[store]
path = "$E2E_TMP/dstore"
[control]
socket = "$CTL_SOCK"
[snapshotter]
enabled = false
[registry]
config_path = ""
credential_provider_config = "$E2E_TMP/credprov.yaml"
credential_provider_bin_dir = "$PLUG/bin"
EOF
"$FERRY" daemon --config "$E2E_TMP/daemon.toml" >"$E2E_TMP/daemon.log" 2>&1 &
DPID=$!
E2E_PIDS+=("$DPID")
for _ in $(seq 100); do [[ -S $CTL_SOCK ]] && break; sleep 0.1; done
mkdir -p "$E2E_TMP/mnt5"
fy "$E2E_TMP/m5.out" "$E2E_TMP/m5.err" mount "$IMAGE" "$E2E_TMP/mnt5" --socket "$CTL_SOCK"
if [[ $RC == 0 ]] && same_as_ref "$E2E_TMP/mnt5" "$FIRST" && same_as_ref "$E2E_TMP/mnt5" "$LAST"; then
    pass "the daemon with [registry] credential_provider_config mounts the private image"
else
    fail "daemon mount: exit $RC"
    show "$E2E_TMP/m5.err"
    show "$E2E_TMP/daemon.log"
fi
timeout 60 "$FERRY" umount "$E2E_TMP/mnt5" --socket "$CTL_SOCK" >/dev/null 2>&1 || umount -l "$E2E_TMP/mnt5" 2>/dev/null || true
kill "$DPID" 2>/dev/null || true
wait "$DPID" 2>/dev/null || true

# 6. the password is nowhere on disk or in a log (the plugin's own directory aside)
if leaks=$(grep -r -l -a -F -e "$PW" -e "$PW_B64" "$E2E_TMP" --exclude-dir=plugin 2>/dev/null); then
    fail "the password appears in: $leaks"
else
    pass "neither the password nor its base64 is in any file under ferry's stores, stats, registry data or logs"
fi

e2e_summary
