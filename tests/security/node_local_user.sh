#!/usr/bin/env bash
# tests/security/node_local_user.sh — a local user on a node attacks ferry's lazy mounts and node
# state (issue 11, findings 2 and 5); needs root, /dev/fuse, containerd and gcc.
#
#   bash tests/security/node_local_user.sh
#
# Setup: an attacker account made for the run (useradd, removed at exit); the temp dir
# opened to it (0755), as /var/lib is on a real node, so only ferry's own modes stand
# between it and ferry's state. An image with busybox plus /sec: a static setuid-root
# program that prints its effective uid and reads a root-only host file, a char device
# node 1:5 (/dev/zero) mode 0666, a file 0600 and a file 0644; indexed and pushed to
# ferry's registry. `ferry daemon` with the snapshotter, containerd with ferry as its
# proxy snapshotter.
#
# As the attacker (each check fails on ferry before issue 11's fix):
#  1. a `ferry mount` target it can reach (the user chose it): the setuid program runs
#     without euid 0 (mount nosuid), the device node cannot be opened (nodev);
#  2. the chunk store and the file cache: nothing under them can be listed or read (0700
#     directories, 0600 files), after root read the 0600 file through the mount;
#  3. the snapshotter's lazy layers (FUSE mounts under its root, after `ferry pull`): the
#     root cannot be entered, so neither the setuid program nor the device on a lazy
#     layer can be reached; every FUSE mount of ferry's is nosuid,nodev;
#  4. a store made 0755/0644 (as before) is tightened when the daemon opens it.
# For containers (these held before and must keep holding): a process of uid 1000 in a
# container started from the lazy layers (no_new_privs off, as Docker's and the CRI's
# default; ctr turns it on) runs the image's setuid program with euid 0 and reads the
# image's device node: its rootfs is containerd's overlayfs, whose own mount flags count.
#
# Env: FERRY, E2E_KEEP=1, E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "useradd, FUSE, private containerd"
need_cmd containerd ctr runc jq curl gcc useradd userdel setpriv timeout
[[ -e /dev/fuse ]] || skip "no /dev/fuse"
find_ferry
e2e_init
small_image
require_ferry pull

# The attacker: a fresh unprivileged account.
sec_attacker ferrysec
say() { sed 's/^/    | /' <<<"$1" | tail -"${2:-6}"; }
# As /var/lib on a node: the attacker may walk down to ferry's own directories.
chmod 0755 "$E2E_TMP"

# ---------------------------------------------------------------- the image
HOST_SECRET=$E2E_TMP/host-secret
echo "host-root-only-$$" >"$HOST_SECRET"
chmod 0600 "$HOST_SECRET"
TREE=$E2E_TMP/tree
oci_extract "$SMALL" small "$TREE"
SEC=$E2E_TMP/sec-layer
mkdir -p "$SEC/sec"
cat >"$E2E_TMP/whoami.c" <<'EOF'
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
/* Prints the effective uid, then tries to read argv[1] (a root-only file). */
int main(int argc, char **argv) {
    printf("euid=%d\n", (int)geteuid());
    if (argc > 1) {
        char buf[128];
        int fd = open(argv[1], O_RDONLY);
        ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof buf - 1);
        if (n > 0) {
            buf[n] = 0;
            printf("read: %s", buf);
        } else {
            printf("cannot read %s\n", argv[1]);
        }
    }
    return 0;
}
EOF
gcc -static -O1 -o "$SEC/sec/whoami" "$E2E_TMP/whoami.c"
sec_dropto "$SEC/sec/dropto"
chown 0:0 "$SEC/sec/whoami"
chmod 4755 "$SEC/sec/whoami"
mknod -m 0666 "$SEC/sec/zero" c 1 5
printf 'image-secret-0600-%s\n' "$$" >"$SEC/sec/secret.txt"
chmod 0600 "$SEC/sec/secret.txt"
printf 'image-public-0644\n' >"$SEC/sec/public.txt"
IMG=$E2E_TMP/secimg
python3 "$FERRY_ROOT/bench/oci-layout.py" write --out "$IMG" --tag sec \
    --cmd '["/sec/whoami"]' --env PATH=/bin "$TREE" "$SEC" >"$E2E_TMP/image.log" 2>&1 ||
    { cat "$E2E_TMP/image.log"; e2e_die "writing the image failed"; }
fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index --min-layer-size 0 --span 65536 "oci:$IMG:sec"
[[ $RC == 0 ]] || { show "$E2E_TMP/index.err"; e2e_die "ferry index failed"; }
: >"$E2E_TMP/reg.toml"
start_ferry_registry reg "$E2E_TMP/reg.toml" || e2e_die "ferry registry did not start"
REF=$REG_ADDR/sec/node:v1
fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy "oci:$IMG:sec" "$REF"
[[ $RC == 0 ]] || { show "$E2E_TMP/cp.err"; e2e_die "ferry copy failed"; }

# ---------------------------------------------------------------- the node
STORE=$E2E_TMP/store
# 4. an existing store as an earlier ferry left it (umask 022: 0755 dirs, 0644 files)
mkdir -p "$STORE/chunks/00" "$STORE/tmp"
printf 'old chunk' >"$STORE/chunks/00/00$(printf '%062d' 0)"
chmod 0755 "$STORE" "$STORE/chunks" "$STORE/chunks/00" "$STORE/tmp"
chmod 0644 "$STORE/chunks/00/00$(printf '%062d' 0)"
lazy_snapshotter_daemon
start_containerd_with_snapshotter ferry "$SNAP_SOCK"

# ---------------------------------------------------------------- 1. a ferry mount target
echo "# 1. a \`ferry mount\` target the attacker can reach"
PUBLIC=$E2E_TMP/public
MNT=$PUBLIC/mnt
mkdir -p "$MNT"
chmod 0755 "$PUBLIC" "$MNT"
fy "$E2E_TMP/mount.out" "$E2E_TMP/mount.err" mount --socket "$CTL_SOCK" "$REF" "$MNT"
if [[ $RC == 0 ]] && [[ -x $MNT/sec/whoami ]]; then
    pass "ferry mount through the daemon"
else
    fail "ferry mount: exit $RC"; show "$E2E_TMP/mount.err"
    e2e_summary || exit 1
fi
# Root reads the 0600 file through the mount (so its bytes reach the store and cache).
[[ $(cat "$MNT/sec/secret.txt") == "image-secret-0600-$$" ]] || fail "root cannot read the image's 0600 file"
as_attacker "$MNT/sec/whoami" "$HOST_SECRET"
if [[ $RC == 0 && $OUT == *"euid=$ATT_UID"* && $OUT != *"host-root-only"* ]]; then
    pass "setuid-root program on the mount runs as the attacker (euid $ATT_UID, host secret unread)"
else
    fail "setuid program on the mount: exit $RC"; say "$OUT"
fi
as_attacker dd if="$MNT/sec/zero" of=/dev/null bs=16 count=1
if [[ $RC != 0 && $OUT == *"ermission denied"* ]]; then
    pass "device node on the mount cannot be opened (nodev)"
else
    fail "device node on the mount opened: exit $RC"; say "$OUT"
fi
as_attacker cat "$MNT/sec/secret.txt"
if [[ $RC != 0 && $OUT != *image-secret* ]]; then
    pass "the image's 0600 file stays unreadable on the mount (the kernel checks modes)"
else
    fail "the image's 0600 file was read: $OUT"
fi
mp_opts=$(awk -v m="$MNT" '$5 == m { print $6 }' /proc/self/mountinfo)
if [[ ,$mp_opts, == *,nosuid,* && ,$mp_opts, == *,nodev,* ]]; then
    pass "the mount is nosuid,nodev ($mp_opts)"
else
    fail "mount options of $MNT: $mp_opts"
fi

# ---------------------------------------------------------------- 2. store and file cache
echo "# 2. the chunk store and the file cache"
# Whole files land in the file cache once their data is local: read them again.
for _ in 1 2 3; do cat "$MNT/sec/secret.txt" "$MNT/sec/public.txt" >/dev/null; done
sleep 1
n_files=$(find "$STORE" -type f | wc -l)
as_attacker find "$STORE" -type f -readable
if [[ $OUT != *"$STORE/"* ]] && ((n_files > 0)); then
    pass "none of the store's $n_files files is readable by the attacker"
else
    fail "the attacker can read store files:"; say "$OUT"
fi
as_attacker ls "$STORE/chunks"
if [[ $RC != 0 ]]; then
    pass "the store cannot be listed by the attacker"
else
    fail "the attacker lists the store: $(wc -l <<<"$OUT") entries"
fi
# The small-file pack keeps the small files read whole, the 0600 one among them.
pack=$(grep -rl --include='*.data' "image-secret-0600-$$" "$STORE" | head -1 || true)
if [[ $pack == */pack/*.data ]]; then
    as_attacker cat "$pack"
    if [[ $RC != 0 && $OUT != *"image-secret-0600-$$"* ]]; then
        pass "the small-file pack holds the 0600 file and the attacker cannot read it"
    else
        fail "the attacker reads the small-file pack $pack"
    fi
else
    fail "the 0600 file read whole through the mount is not in the small-file pack (found: ${pack:-nothing})"
fi
as_attacker grep -rl "image-secret-0600-$$" "$STORE"
if [[ $OUT != *"$STORE/"* ]]; then
    pass "no copy of the image's 0600 file is readable in the store or file cache"
else
    fail "the attacker found the 0600 file's bytes:"; say "$OUT"
fi
bad_modes=$(find "$STORE" \( -type d -perm /077 \) -o \( -type f -perm /077 \) | head -5 || true)
if [[ -z $bad_modes ]]; then
    pass "every store directory is 0700 and every store file 0600 (existing store tightened)"
else
    fail "store paths with group/other bits:"; say "$bad_modes"
fi

# ---------------------------------------------------------------- 3. the snapshotter
echo "# 3. lazy layers under containerd"
set +e
PULL_OUT=$(timeout 120 "$FERRY" pull --address "$CONTAINERD_SOCK" --namespace "$CTR_NAMESPACE" \
    --snapshotter ferry --snapshotter-root "$SNAP_ROOT" "$REF" 2>&1)
PULL_RC=$?
set -e
if [[ $PULL_RC == 0 && $PULL_OUT == *"2 layers (2 lazy"* ]]; then
    pass "ferry pull: every layer lazy"
else
    fail "ferry pull: exit $PULL_RC"; say "$PULL_OUT"
fi
mapfile -t LAZY < <(awk -v r="$SNAP_ROOT/" 'index($5, r) == 1 {
    for (i = 7; i <= NF; i++) if ($i == "-") { if ($(i + 1) ~ /^fuse/) print $5; break } }' /proc/self/mountinfo)
if ((${#LAZY[@]} == 2)); then
    pass "two lazy layers mounted under the snapshotter's root"
else
    fail "lazy layers under $SNAP_ROOT: ${#LAZY[@]}"
fi
as_attacker ls "$SNAP_ROOT/snapshots"
if [[ $RC != 0 ]]; then
    pass "the snapshotter's root cannot be entered by the attacker"
else
    fail "the attacker lists the snapshots:"; say "$OUT"
fi
reached=0
for l in "${LAZY[@]}"; do
    [[ -e $l/sec/whoami ]] || continue
    as_attacker "$l/sec/whoami" "$HOST_SECRET"
    if [[ $RC == 0 ]]; then
        reached=1
        fail "the attacker ran $l/sec/whoami: $OUT"
    fi
    as_attacker dd if="$l/sec/zero" of=/dev/null bs=16 count=1
    [[ $RC == 0 ]] && { reached=1; fail "the attacker opened $l/sec/zero"; }
done
((reached == 0)) && pass "neither the setuid program nor the device node on a lazy layer can be reached"
# (this run's mounts only: other runs on the machine may use another ferry)
bad=$(awk -v t="$E2E_TMP/" 'index($5, t) == 1 { for (i = 7; i <= NF; i++) if ($i == "-") { if ($(i + 1) ~ /^fuse/ && $(i + 2) ~ /^ferry/ && (","$6"," !~ /,nosuid,/ || ","$6"," !~ /,nodev,/)) print $5; break } }' /proc/self/mountinfo)
n_ours=$(awk -v t="$E2E_TMP/" 'index($5, t) == 1 && / - fuse[^ ]* ferry/' /proc/self/mountinfo | wc -l)
if [[ -z $bad ]] && ((n_ours >= 3)); then
    pass "every ferry FUSE mount of this run is nosuid,nodev ($n_ours mounts)"
else
    fail "ferry mounts without nosuid,nodev:"; say "$bad"
fi

# Containers keep what their image gives them.
set +e
OUT=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm --allow-new-privs --snapshotter ferry \
    "$REF" "suid-$$" /sec/dropto /sec/whoami /sec/secret.txt 2>&1)
RC=$?
set -e
if [[ $RC == 0 && $OUT == *"euid=0"* && $OUT == *"read: image-secret-0600-$$"* ]]; then
    pass "in a container (uid 1000) the image's setuid program runs with euid 0"
else
    fail "setuid program in a container: exit $RC"; say "$OUT"
fi
set +e
OUT=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm --allow-new-privs --snapshotter ferry \
    "$REF" "dev-$$" /sec/dropto /bin/busybox sh -c 'id -u; head -c 16 /sec/zero | wc -c' 2>&1)
RC=$?
set -e
if [[ $RC == 0 && $(tr -d ' ' <<<"$OUT" | tr '\n' ' ') == "1000 16 " ]]; then
    pass "in a container (uid 1000) the image's device node opens (16 bytes read)"
else
    fail "device node in a container: exit $RC"; say "$OUT"
fi

timeout 60 "$FERRY" umount --socket "$CTL_SOCK" "$MNT" >/dev/null 2>&1 || true
e2e_summary
