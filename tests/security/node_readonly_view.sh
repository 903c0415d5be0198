#!/usr/bin/env bash
# tests/security/node_readonly_view.sh — a local user on a node attacks a read-only view
# of a one-layer image that ferry's snapshotter hands to containerd (issue 11); needs
# root, /dev/fuse, containerd, runc and gcc.
#
#   bash tests/security/node_readonly_view.sh
#
# A view of one layer is not an overlay: the snapshotter returns the lazy layer itself as
# a bind mount, `ro,rbind,nosuid,nodev` (crates/snapshotter/src/snapshotter.rs, `mounts`).
# Whoever mounts it (containerd's shim, `ctr images mount`, a CRI's image volume) makes
# it read-only with a remount, and a remount of a bind sets exactly the flags it is given:
# without nosuid,nodev in the view's options the mount would run the image's setuid
# programs and open its device nodes again, though the FUSE layer under it is nosuid,nodev.
#
# Setup: an attacker account made for the run (useradd, removed at exit). A one-layer
# image: /sec/probe, a static setuid-root program that prints its effective uid and opens
# and reads each path it is given; /sec/dropto (runs a program as uid 1000); /sec/zero, a
# char device 1:5 (/dev/zero) mode 0666; /sec/public.txt 0644. Indexed, pushed to ferry's
# registry, pulled lazily with `ferry pull` through `ferry daemon`'s snapshotter.
#
# Checks:
#  1. A View snapshot of the layer, mounted with the command `ctr snapshots mounts`
#     prints (as containerd would mount it; `ctr images mount` cannot unpack into a
#     proxy snapshotter in ctr 1.6) at a path the attacker can reach: the view is ro,nosuid,nodev; the attacker reads the
#     0644 file through it (so the checks below are not passed by a view it cannot
#     reach), the setuid program runs with the attacker's euid and cannot read a
#     root-only host file, the device node cannot be opened.
#  2. Containers (no_new_privs off, as Docker's and the CRI's default; ctr turns it on):
#     a container's rootfs on the one-layer image is an overlay over the lazy layer whose
#     own flags count, so a process of uid 1000 in it runs the setuid program with euid 0
#     and reads the device node; a container run --read-only gets the view itself as its
#     root, nosuid,nodev (the cost snapshotter.rs documents): euid stays 1000.
# Breaking the view's options (dropping nosuid or nodev in snapshotter.rs) fails check 1.
#
# Env: FERRY, E2E_KEEP=1, E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../e2e/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "useradd, FUSE, private containerd"
need_cmd containerd ctr runc jq curl gcc useradd userdel setpriv timeout python3
[[ -e /dev/fuse ]] || skip "no /dev/fuse"
find_ferry
e2e_init
require_ferry pull

sec_attacker ferryview
# ctr_run ARGS...: `ctr run --rm --allow-new-privs --snapshotter ferry ARGS`, output in OUT,
# exit in RC
ctr_run() {
    set +e
    OUT=$(timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm --allow-new-privs \
        --snapshotter ferry "$@" 2>&1)
    RC=$?
    set -e
}
say() { sed 's/^/    | /' <<<"$1" | tail -"${2:-6}"; }
chmod 0755 "$E2E_TMP"

# ---------------------------------------------------------------- the image
HOST_SECRET=$E2E_TMP/host-secret
echo "host-root-only-$$" >"$HOST_SECRET"
chmod 0600 "$HOST_SECRET"
LAYER=$E2E_TMP/layer
mkdir -p "$LAYER/sec"
cat >"$E2E_TMP/probe.c" <<'EOF'
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
/* Prints the effective uid, then opens and reads each argument: "PATH: read N" (N bytes,
   up to 16) or "PATH: open: REASON". */
int main(int argc, char **argv) {
    printf("euid=%d\n", (int)geteuid());
    for (int i = 1; i < argc; i++) {
        char buf[16];
        int fd = open(argv[i], O_RDONLY);
        if (fd < 0) {
            printf("%s: open: %s\n", argv[i], strerror(errno));
            continue;
        }
        printf("%s: read %zd\n", argv[i], read(fd, buf, sizeof buf));
        close(fd);
    }
    return 0;
}
EOF
gcc -static -O1 -o "$LAYER/sec/probe" "$E2E_TMP/probe.c"
cat >"$E2E_TMP/hold.c" <<'EOF'
#include <unistd.h>
/* Keeps a container (and so its rootfs mount) alive until it is killed. */
int main(void) {
    for (;;)
        pause();
}
EOF
gcc -static -O1 -o "$LAYER/sec/hold" "$E2E_TMP/hold.c"
sec_dropto "$LAYER/sec/dropto"
chown 0:0 "$LAYER/sec/probe"
chmod 4755 "$LAYER/sec/probe"
mknod -m 0666 "$LAYER/sec/zero" c 1 5
printf 'image-public-0644\n' >"$LAYER/sec/public.txt"
IMG=$E2E_TMP/viewimg
python3 "$FERRY_ROOT/bench/oci-layout.py" write --out "$IMG" --tag view \
    --cmd '["/sec/probe"]' "$LAYER" >"$E2E_TMP/image.log" 2>&1 ||
    { cat "$E2E_TMP/image.log"; e2e_die "writing the image failed"; }
fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index --min-layer-size 0 --span 65536 "oci:$IMG:view"
[[ $RC == 0 ]] || { show "$E2E_TMP/index.err"; e2e_die "ferry index failed"; }
: >"$E2E_TMP/reg.toml"
start_ferry_registry reg "$E2E_TMP/reg.toml" || e2e_die "ferry registry did not start"
REF=$REG_ADDR/sec/view:v1
fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy "oci:$IMG:view" "$REF"
[[ $RC == 0 ]] || { show "$E2E_TMP/cp.err"; e2e_die "ferry copy failed"; }

# ---------------------------------------------------------------- the node
lazy_snapshotter_daemon
start_containerd_with_snapshotter ferry "$SNAP_SOCK"
set +e
PULL_OUT=$(timeout 120 "$FERRY" pull --address "$CONTAINERD_SOCK" --namespace "$CTR_NAMESPACE" \
    --snapshotter ferry --snapshotter-root "$SNAP_ROOT" "$REF" 2>&1)
PULL_RC=$?
set -e
if [[ $PULL_RC == 0 && $PULL_OUT == *"(1 lazy"* ]]; then
    pass "ferry pull: the one layer is lazy"
else
    fail "ferry pull: exit $PULL_RC"; say "$PULL_OUT"
    e2e_summary || exit 1
fi

# ---------------------------------------------------------------- 1. the view
echo "# 1. a read-only view of the one-layer image, where the attacker can reach it"
# A View snapshot of the image's one committed layer (its chain ID is the layer's diff
# ID), mounted the way ctr says to: `ctr snapshots mounts` prints the mount command,
# with the options ferry returned; mount(8) binds, then remounts read-only with exactly
# those flags (as containerd's own mount code does).
CHAIN=$(jq -r '.manifests[0].digest' "$IMG/index.json")
CHAIN=$(jq -r '.config.digest' "$IMG/blobs/sha256/${CHAIN#sha256:}")
CHAIN=$(jq -r '.rootfs.diff_ids[0]' "$IMG/blobs/sha256/${CHAIN#sha256:}")
PUBLIC=$E2E_TMP/public
VIEW=$PUBLIC/view
mkdir -p "$VIEW"
chmod 0755 "$PUBLIC" "$VIEW"
set +e
timeout 60 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" snapshots --snapshotter ferry \
    view "view-$$" "$CHAIN" >"$E2E_TMP/view.out" 2>&1 &&
    MOUNT_OUT=$(timeout 60 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" snapshots \
        --snapshotter ferry mounts "$VIEW" "view-$$" 2>&1)
MOUNT_RC=$?
set -e
[[ $MOUNT_RC == 0 ]] || MOUNT_OUT=$(cat "$E2E_TMP/view.out")
e2e_defer "ctr -a '$CONTAINERD_SOCK' -n '$CTR_NAMESPACE' snapshots --snapshotter ferry rm 'view-$$'"
read -r -a MOUNT_CMD <<<"$MOUNT_OUT"
if [[ $MOUNT_RC == 0 && ${MOUNT_CMD[0]:-} == mount && ${MOUNT_CMD[2]:-} == bind ]] &&
    timeout 30 "${MOUNT_CMD[@]}" && [[ -u $VIEW/sec/probe && -c $VIEW/sec/zero ]]; then
    e2e_defer "umount '$VIEW'"
    pass "the view ($MOUNT_OUT) shows the setuid program and the device node"
else
    fail "view of $CHAIN: exit $MOUNT_RC"; say "$MOUNT_OUT"
    e2e_summary || exit 1
fi
# The view is the bind of the lazy layer (not an overlay) with the options ferry gave.
view_fs=$(awk -v m="$VIEW" '$5 == m { for (i = 7; i <= NF; i++) if ($i == "-") { print $(i + 1); break } }' /proc/self/mountinfo)
view_opts=$(awk -v m="$VIEW" '$5 == m { print $6 }' /proc/self/mountinfo)
if [[ $view_fs == fuse* && ,$view_opts, == *,ro,* && ,$view_opts, == *,nosuid,* && ,$view_opts, == *,nodev,* ]]; then
    pass "the view is the lazy layer itself, $view_opts"
else
    fail "the view at $VIEW: type ${view_fs:-none}, options ${view_opts:-none}"
fi
as_attacker cat "$VIEW/sec/public.txt"
if [[ $RC == 0 && $OUT == image-public-0644 ]]; then
    pass "the attacker reads the image's 0644 file through the view"
else
    fail "the attacker cannot use the view at all (exit $RC), so the checks below prove nothing"; say "$OUT"
fi
as_attacker "$VIEW/sec/probe" "$HOST_SECRET"
if [[ $RC == 0 && $OUT == *"euid=$ATT_UID"* && $OUT == *"$HOST_SECRET: open: Permission denied"* ]]; then
    pass "the setuid-root program on the view runs as the attacker (euid $ATT_UID, host secret unread)"
else
    fail "the setuid-root program on the view: exit $RC"; say "$OUT"
fi
as_attacker dd if="$VIEW/sec/zero" of=/dev/null bs=16 count=1
if [[ $RC != 0 && $OUT == *"ermission denied"* ]]; then
    pass "the device node on the view cannot be opened (nodev)"
else
    fail "the device node on the view opened: exit $RC"; say "$OUT"
fi

# ---------------------------------------------------------------- 2. containers
echo "# 2. containers on the one-layer image"
ctr_run "$REF" "suid-$$" /sec/dropto /sec/probe /sec/zero
if [[ $RC == 0 && $OUT == *"euid=0"* && $OUT == *"/sec/zero: read 16"* ]]; then
    pass "in a container (uid 1000) the setuid program runs with euid 0 and the device node reads"
else
    fail "setuid program and device node in a container: exit $RC"; say "$OUT"
fi
ctr_run --read-only "$REF" "ro-$$" /sec/dropto /sec/probe /sec/zero
if [[ $RC == 0 && $OUT == *"euid=0"* && $OUT == *"/sec/zero: read 16"* ]]; then
    pass "in a read-only container (an overlay the runtime makes read-only) the same holds"
else
    fail "setuid program and device node in a read-only container: exit $RC"; say "$OUT"
fi

e2e_summary
