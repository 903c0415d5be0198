#!/usr/bin/env bash
# tests/e2e/mount_programs.sh — real programs run from a lazily mounted real image
# (through chroot, the way a container runtime uses it) and print exactly what they
# print from the same image extracted normally.
#
#   bash tests/e2e/mount_programs.sh
#
# Image: the medium Debian image (bench/make-image.sh --medium, cached in
# $OUT/medium; ~420 MB uncompressed, 150 MB gzip): minbase, gcc + libc6-dev,
# python3 + numpy, an app layer with a C source, a hard-linked pair, a user.* xattr, a
# whiteout (/etc/motd) and an opaque directory (/usr/share/doc/base-files).
#
# Setup: the image indexed with `ferry index`, pushed with its index to a ferry
# registry by `ferry copy`, mounted with `ferry mount REGISTRY/e2e/medium:v1 MNT` from
# an empty store — through a private `ferry daemon` (warm-up off, so the counters
# show what the programs fetched) when the build has one, else a standalone mount.
# Both roots get the same treatment: an overlayfs (lower = the ferry mount, resp. the
# layers extracted with tar in order with whiteouts and xattrs; upper and work in a
# temp dir) with proc and a small /dev, and every program runs as
# `chroot ROOT /usr/bin/env -i … PROGRAM`. Each check's output from the mount must
# equal its output from the extracted tree, and must contain what it is meant to show
# (so two empty outputs never pass).
#
# Checks: python3 importing numpy and ~25 stdlib modules and printing computed
# results + sys.version; gcc compiling /app/hello.c and the program's output (and the
# binary's sha256); the lower mount unchanged by the container's writes; stat/readlink
# of symlink chains and hard links (same inode, nlink 2); the user.* xattr; sendfile(2)
# to a pipe and to a file and mmap(2) of large shared objects against read(2); a large
# directory; the whiteout and the opaque directory; a walk of the whole tree (type,
# mode, owner, size, nlink, mtime, link targets) and sha256sum of every regular file
# under /usr/lib/python3*. Bytes fetched vs the image size are reported after the
# programs and after the walk (daemon: `ferry status --json`; standalone: the mount's
# --stats-file).
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry),
#      OUT (default tests/e2e/out; the image is $OUT/medium:medium),
#      FERRY_TIMEOUT (seconds per ferry call and per check, 300), E2E_KEEP=1 / E2E_VERBOSE=1,
#      E2E_TMPFS=0 (keep the big trees on disk under the temp dir instead of a tmpfs),
#      FERRY_MOUNT_MODE=daemon|standalone (default: daemon if `ferry daemon --config` exists).
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "FUSE and overlay mounts, chroot"
need_cmd jq curl tar gzip chroot timeout mountpoint mknod
[[ -e /dev/fuse ]] || skip "no /dev/fuse"

OUT=$(realpath -m "${OUT:-$FERRY_ROOT/tests/e2e/out}")
MEDIUM=$OUT/medium
FT=${FERRY_TIMEOUT:-300}
find_ferry
e2e_init
T_START=$SECONDS

# Scratch space for the big trees (image copy, registry data, store, reference tree,
# overlay uppers: ~850 MB): a tmpfs when it takes user.* xattrs (Linux 6.6+), because
# deleting that much from a busy disk at exit takes longer than the test itself.
WORK=$E2E_TMP
if [[ ${E2E_TMPFS:-1} == 1 ]]; then
    mkdir -p "$E2E_TMP/work"
    if mount -t tmpfs -o size=4g,mode=755 ferry-e2e-work "$E2E_TMP/work" 2>/dev/null &&
        touch "$E2E_TMP/work/.probe" &&
        python3 -c 'import os, sys; os.setxattr(sys.argv[1], "user.probe", b"1")' "$E2E_TMP/work/.probe" 2>/dev/null; then
        WORK=$E2E_TMP/work
        rm -f "$WORK/.probe"
    else
        umount "$E2E_TMP/work" 2>/dev/null || true
    fi
fi
e2e_log "scratch: $WORK"

if [[ ! -f $MEDIUM/index.json ]]; then
    need_cmd debootstrap
    e2e_log "building the medium image (bench/make-image.sh --medium, a few minutes)"
    MEDIUM_OUT=$MEDIUM "$FERRY_ROOT/bench/make-image.sh" --medium >"$E2E_TMP/make-image.log" 2>&1 ||
        { tail -20 "$E2E_TMP/make-image.log"; e2e_die "bench/make-image.sh --medium failed"; }
    e2e_log "medium image built in $((SECONDS - T_START)) s"
fi
require_ferry mount

# ---------------------------------------------------------------- helpers
showdiff() { { diff "$1" "$2" | grep '^[<>]' | sed 's/^</-/; s/^>/+/' | show /dev/stdin 20; } || true; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }


# container_root NAME LOWER: overlayfs over LOWER at $WORK/NAME/root with proc and
# a minimal /dev (tmpfs + null, zero, random, urandom); prints the root
container_root() {
    local d=$WORK/$1 lower=$2
    mkdir -p "$d/upper" "$d/work" "$d/root"
    mount -t overlay overlay -o "lowerdir=$lower,upperdir=$d/upper,workdir=$d/work,index=off,xino=off" "$d/root"
    mount -t proc proc "$d/root/proc"
    mount -t tmpfs -o mode=755,size=1m devtmp "$d/root/dev"
    mknod -m 666 "$d/root/dev/null" c 1 3
    mknod -m 666 "$d/root/dev/zero" c 1 5
    mknod -m 666 "$d/root/dev/random" c 1 8
    mknod -m 666 "$d/root/dev/urandom" c 1 9
    mkdir -p "$d/root/tmp/checks"
    cp "$E2E_TMP"/checks/* "$d/root/tmp/checks/"
    echo "$d/root"
}

# in_root ROOT OUTFILE CMD...: run CMD chrooted into ROOT with a clean environment
in_root() {
    local root=$1 out=$2
    shift 2
    timeout "$FT" chroot "$root" /usr/bin/env -i HOME=/root LC_ALL=C TMPDIR=/tmp \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@" >"$out" 2>&1
}

# check NAME EXPECT_REGEX CMD...: run CMD in the reference root and in the mounted
# root; pass when both succeed, the outputs are identical and match EXPECT_REGEX
check() {
    local name=$1 expect=$2 want got rcw=0 rcg=0
    shift 2
    want=$E2E_TMP/out/$name.want
    got=$E2E_TMP/out/$name.got
    mkdir -p "$E2E_TMP/out"
    local t0=$SECONDS
    in_root "$REF_ROOT" "$want" "$@" || rcw=$?
    local t1=$SECONDS
    in_root "$MNT_ROOT" "$got" "$@" || rcg=$?
    local t2=$SECONDS
    if [[ $rcw != 0 ]]; then
        fail "$name: exit $rcw in the extracted tree (the check itself is broken)"
        show "$want"
    elif [[ $rcg != 0 ]]; then
        fail "$name: exit $rcg in the ferry mount (extracted: 0)"
        show "$got"
    elif ! cmp -s "$want" "$got"; then
        fail "$name: output differs (- extracted, + ferry mount)"
        showdiff "$want" "$got"
    elif ! grep -Eq -- "$expect" "$got"; then
        fail "$name: identical output but it lacks /$expect/"
        show "$got"
    else
        pass "$name: identical output, $(wc -l <"$got") lines ($((t1 - t0)) s extracted, $((t2 - t1)) s mounted)"
    fi
}

# fetched_report WHEN: bytes fetched so far vs the image size (daemon mode: the
# mount's counters from `ferry status --json`; standalone: its --stats-file)
fetched_report() {
    local f="" t=""
    if [[ $MOUNT_MODE == daemon ]]; then
        if "$FERRY" status --config "$DAEMON_CONFIG" --json >"$E2E_TMP/status.json" 2>"$E2E_TMP/status.err"; then
            f=$(jq --arg m "$MNT" '[.mounts[] | select(.mountpoint == $m) | .stats.bytes_fetched] | first // empty' "$E2E_TMP/status.json")
            t=$(jq --arg m "$MNT" '[.mounts[] | select(.mountpoint == $m) | .stats.bytes_total] | first // empty' "$E2E_TMP/status.json")
        fi
        if [[ -z $f || -z $t ]]; then
            e2e_log "no counters ($1) for $MNT in ferry status --json"
            show "$E2E_TMP/status.err"
            return 0
        fi
    elif [[ -s ${STATS:-} ]]; then
        f=$(jq -r .bytes_fetched "$STATS")
        t=$(jq -r .bytes_total "$STATS")
    else
        e2e_log "no counters ($1): neither ferry status --json nor a stats file"
        return 0
    fi
    echo "# fetched $1: $f bytes ($(mib "$f")) of $t ($(mib "$t")) in the image's layers," \
        "uncompressed image $UIMG bytes ($(mib "$UIMG"))"
    FETCHED_LAST=$f
    TOTAL_LAST=$t
}

# ---------------------------------------------------------------- the programs
mkdir -p "$E2E_TMP/checks"
cat >"$E2E_TMP/checks/python.py" <<'PY'
import hashlib
import importlib
import sys

STDLIB = """json sqlite3 decimal fractions statistics hashlib zlib bz2 lzma ctypes ssl
email.mime.text xml.etree.ElementTree asyncio concurrent.futures multiprocessing
unittest http.client urllib.request csv pickle uuid argparse logging datetime
""".split()
for name in STDLIB:
    importlib.import_module(name)
import numpy as np

a = np.arange(1, 10001, dtype=np.float64).reshape(100, 100)
print("numpy", np.__version__)
print("matmul-sum", float((a @ a.T / 1e6).sum()))
print("slogdet", [round(float(x), 9) for x in np.linalg.slogdet(np.eye(50) + 0.01)])
print("eigvalsh", np.round(np.linalg.eigvalsh(np.eye(4) * 2 + 1), 6).tolist())
print("fft", np.round(np.abs(np.fft.fft(np.arange(8))), 6).tolist())
rng = np.random.default_rng(42)
print("random", hashlib.sha256(rng.random(1000).tobytes()).hexdigest())
import sqlite3
db = sqlite3.connect(":memory:")
db.execute("create table t(x)")
db.executemany("insert into t values (?)", [(i,) for i in range(1000)])
print("sqlite", sqlite3.sqlite_version, db.execute("select sum(x) from t").fetchone()[0])
import ssl
print("ssl", ssl.OPENSSL_VERSION)
import decimal
decimal.getcontext().prec = 40
print("decimal", decimal.Decimal(355) / decimal.Decimal(113))
import zlib, lzma, bz2
blob = bytes(range(256)) * 1000
print("codecs", len(zlib.compress(blob)), len(lzma.compress(blob)), len(bz2.compress(blob)))
print("stdlib-modules", len(STDLIB), "loaded", len(sys.modules))
print("version", sys.version.replace("\n", " "))
PY

cat >"$E2E_TMP/checks/io.py" <<'PY'
# sendfile(2) to a pipe and to a file, mmap(2) and read(2) of big files: same bytes
import glob
import hashlib
import mmap
import os
import sys
import threading

paths = sorted(glob.glob("/usr/lib/python3/dist-packages/numpy/core/_multiarray_umath*.so"))
paths += ["/usr/lib/gcc/x86_64-linux-gnu/12/cc1", "/usr/bin/python3.11"]
for path in paths:
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        by_read = hashlib.sha256(f.read()).hexdigest()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        by_mmap = hashlib.sha256(m).hexdigest()
    # sendfile into a pipe, drained by a thread
    r, w = os.pipe()
    h = hashlib.sha256()
    def drain():
        while True:
            b = os.read(r, 1 << 16)
            if not b:
                break
            h.update(b)
    t = threading.Thread(target=drain)
    t.start()
    with open(path, "rb") as f:
        off = 0
        while off < size:
            n = os.sendfile(w, f.fileno(), off, size - off)
            if n == 0:
                break
            off += n
    os.close(w)
    t.join()
    os.close(r)
    by_pipe = h.hexdigest()
    # sendfile into a regular file (on the overlay's upper layer)
    dst = "/tmp/sendfile.out"
    with open(path, "rb") as f, open(dst, "wb") as o:
        off = 0
        while off < size:
            n = os.sendfile(o.fileno(), f.fileno(), off, size - off)
            if n == 0:
                break
            off += n
    with open(dst, "rb") as o:
        by_file = hashlib.sha256(o.read()).hexdigest()
    os.unlink(dst)
    same = by_read == by_mmap == by_pipe == by_file
    print(path, size, by_read, "read=mmap=sendfile(pipe)=sendfile(file)" if same else
          f"MISMATCH mmap={by_mmap} pipe={by_pipe} file={by_file}")
    if not same:
        sys.exit(1)
PY

cat >"$E2E_TMP/checks/xattr.py" <<'PY'
import os
p = "/app/data/xattr.txt"
print("listxattr", sorted(n for n in os.listxattr(p) if n.startswith("user.")))
print("getxattr", os.getxattr(p, "user.ferry.test").decode())
PY

cat >"$E2E_TMP/checks/gcc.sh" <<'SH'
set -e
gcc -O2 -o /tmp/hello /app/hello.c
/tmp/hello
sha256sum /tmp/hello
cat >/tmp/prog.c <<'EOC'
#include <math.h>
#include <stdio.h>
#include <sys/stat.h>
int main(void) {
    struct stat st;
    if (stat("/usr/lib/gcc/x86_64-linux-gnu/12/cc1", &st) != 0) return 1;
    printf("cc1 %lld bytes, sqrt %.6f\n", (long long)st.st_size, sqrt((double)st.st_size));
    return 0;
}
EOC
gcc -O1 -o /tmp/prog /tmp/prog.c -lm
/tmp/prog
gcc --version | head -1
SH

cat >"$E2E_TMP/checks/stat.sh" <<'SH'
set -e
cd /
stat -c '%n %F %a %u:%g %s %h %Y' /usr/bin/python3 /usr/bin/gcc /usr/bin/cc /etc/passwd \
    /usr/lib/gcc/x86_64-linux-gnu/12/cc1 /app/data/numbers.txt /app/data/numbers-hardlink.txt /app/hello.c
readlink /usr/bin/python3 /usr/bin/gcc /usr/bin/cc
readlink -f /usr/bin/python3 /usr/bin/gcc /usr/bin/cc /lib64/ld-linux-x86-64.so.2
a=$(stat -c %i /app/data/numbers.txt)
b=$(stat -c %i /app/data/numbers-hardlink.txt)
[ "$a" = "$b" ] && echo "hardlink: same inode, nlink $(stat -c %h /app/data/numbers.txt)" ||
    echo "hardlink: DIFFERENT inodes"
cmp /app/data/numbers.txt /app/data/numbers-hardlink.txt && echo "hardlink: same content"
# whiteout and opaque directory from the app layer
[ -e /etc/motd ] && echo "whiteout: /etc/motd PRESENT" || echo "whiteout: /etc/motd gone"
ls -A /usr/share/doc/base-files | tr '\n' ' '; echo "(opaque dir)"
# a large directory
echo "doc entries $(ls /usr/share/doc | wc -l) $(ls /usr/share/doc | md5sum)"
# ls -l of the non-directories (a directory's size and st_blocks are filesystem artefacts)
echo "x86_64 lib entries $(ls -A /usr/lib/x86_64-linux-gnu | wc -l)" \
    "$(ls -lA --time-style=+%s /usr/lib/x86_64-linux-gnu | awk '$1 != "total" && $1 !~ /^d/' | md5sum)"
SH

cat >"$E2E_TMP/checks/walk.sh" <<'SH'
set -e
cd /
# type, mode and owner of directories and special files; link targets; regular files
# with size, link count and mtime (directory sizes/nlink are filesystem artefacts)
find / -xdev \( -path /proc -o -path /dev -o -path /tmp \) -prune -o \
    ! -type f ! -type l -printf '%p %y %m %U:%G\n' | sort
find / -xdev \( -path /proc -o -path /dev -o -path /tmp \) -prune -o -type l -printf '%p -> %l\n' | sort
find / -xdev \( -path /proc -o -path /dev -o -path /tmp \) -prune -o \
    -type f -printf '%p %m %U:%G %s %n %Ts\n' | sort
find /usr/lib/python3* -type f -print0 | sort -z | xargs -0 sha256sum
echo "walked $(find / -xdev \( -path /proc -o -path /dev -o -path /tmp \) -prune -o -print | wc -l) paths," \
    "$(find /usr/lib/python3* -type f | wc -l) python files hashed"
SH

# ---------------------------------------------------------------- setup
echo "# setup: index, push, mount; reference tree"
UIMG=$(oci_manifest "$MEDIUM" medium | jq -r '.layers[].digest' | while read -r l; do
    gzip -dc "$MEDIUM/blobs/sha256/${l#sha256:}" | wc -c; done | awk '{ s += $1 } END { print s }')
CIMG=$(oci_manifest "$MEDIUM" medium | jq '[.layers[].size] | add')
IMG=$WORK/img
cp -a "$MEDIUM" "$IMG"
t0=$SECONDS
fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index "oci:$IMG:medium"
if [[ $RC == 0 ]]; then pass "ferry index oci:IMG:medium ($((SECONDS - t0)) s)"; else
    fail "ferry index: exit $RC"; show "$E2E_TMP/index.err"; e2e_summary || exit 1; fi

: >"$E2E_TMP/reg.toml"
REG_NAME=reg
[[ $WORK == "$E2E_TMP" ]] || REG_NAME=work/reg # its data under the scratch tmpfs
start_ferry_registry "$REG_NAME" "$E2E_TMP/reg.toml" || { fail "start ferry registry"; e2e_summary || exit 1; }
REF_IMAGE=$REG_ADDR/e2e/medium:v1
fy "$E2E_TMP/cp.out" "$E2E_TMP/cp.err" copy "oci:$IMG:medium" "$REF_IMAGE"
if [[ $RC == 0 ]]; then pass "ferry copy the indexed image to $REF_IMAGE"; else
    fail "ferry copy: exit $RC"; show "$E2E_TMP/cp.err"; e2e_summary || exit 1; fi

t0=$SECONDS
REF=$WORK/ref
oci_extract "$MEDIUM" medium "$REF" --xattrs --xattrs-include='user.*'
e2e_log "reference tree extracted in $((SECONDS - t0)) s"

MNT=$WORK/mnt
mkdir -p "$MNT"
# Through a private node daemon when this build has one (what `ferry mount` does on a
# node), else a standalone mount process with a stats file. Warm-up is off in the
# daemon so the bytes fetched are what the programs pulled in, not background fill.
STATS=""
MOUNT_MODE=${FERRY_MOUNT_MODE:-auto}
if [[ $MOUNT_MODE == auto ]]; then
    MOUNT_MODE=standalone
    "$FERRY" daemon --help 2>/dev/null | grep -- '--config' >/dev/null && MOUNT_MODE=daemon
fi
DAEMON_CONFIG=$E2E_TMP/daemon.toml
if [[ $MOUNT_MODE == daemon ]]; then
    cat >"$DAEMON_CONFIG" <<EOF
[store]
path = "$WORK/store"

[control]
socket = "$E2E_TMP/run/daemon.sock"

[warm]
prefetch = false
background_fill = false

[snapshotter]
enabled = false
EOF
    mkdir -p "$E2E_TMP/run"
    "$FERRY" daemon --config "$DAEMON_CONFIG" >"$E2E_TMP/daemon.log" 2>&1 &
    DAEMON_PID=$!
    E2E_PIDS+=("$DAEMON_PID")
    if ! wait_for 30 "ferry daemon" test -S "$E2E_TMP/run/daemon.sock"; then
        fail "ferry daemon did not come up"
        show "$E2E_TMP/daemon.log"
        e2e_summary || exit 1
    fi
    mount_args=(mount --config "$DAEMON_CONFIG" "$REF_IMAGE" "$MNT")
    umount_args=(umount --config "$DAEMON_CONFIG" "$MNT")
else
    mount_args=(mount "$REF_IMAGE" "$MNT" --store "$WORK/store")
    umount_args=(umount "$MNT")
    if "$FERRY" mount --help | grep -- '--stats-file' >/dev/null; then
        STATS=$E2E_TMP/mount.stats.json
        mount_args+=(--stats-file "$STATS")
    fi
fi
e2e_log "mount mode: $MOUNT_MODE"
t0=$SECONDS
fy "$E2E_TMP/mount.out" "$E2E_TMP/mount.err" "${mount_args[@]}"
if [[ $RC == 0 ]] && mountpoint -q "$MNT"; then
    pass "ferry mount $REF_IMAGE ($MOUNT_MODE) returns with the mount in place ($((SECONDS - t0)) s)"
else
    fail "ferry mount $REF_IMAGE: exit $RC, mounted: $(mountpoint -q "$MNT" && echo yes || echo no)"
    show "$E2E_TMP/mount.err"
    e2e_summary || exit 1
fi
e2e_defer "$FERRY ${umount_args[*]}"
fetched_report "after mounting"

REF_ROOT=$(container_root ref-ctr "$REF")
if MNT_ROOT=$(container_root mnt-ctr "$MNT" 2>"$E2E_TMP/ovl.err"); then
    pass "overlayfs with the ferry mount as its lower layer, proc and /dev mounted"
else
    fail "overlayfs over the ferry mount"
    show "$E2E_TMP/ovl.err"
    e2e_summary || exit 1
fi

# ---------------------------------------------------------------- checks
echo "# programs"
check python 'numpy [0-9].*' /usr/bin/python3 /tmp/checks/python.py
grep -q '^version 3\.' "$E2E_TMP/out/python.got" 2>/dev/null && e2e_log "python: $(grep -E '^(numpy|version|stdlib)' "$E2E_TMP/out/python.got" | tr '\n' ';')"
check gcc '^hello from gcc 12\.[0-9]+, sum [0-9]+$' /bin/sh /tmp/checks/gcc.sh
if [[ ! -e $MNT/tmp/hello && ! -e $REF/tmp/hello && -e $MNT_ROOT/tmp/hello ]]; then
    pass "the compiled program lives in the overlay's upper dir; the ferry mount is untouched"
else
    fail "writes leaked: $MNT/tmp/hello exists: $([[ -e $MNT/tmp/hello ]] && echo yes || echo no)"
fi
fetched_report "after python+numpy and gcc"
FETCHED_PROGRAMS=${FETCHED_LAST:-}
check io 'read=mmap=sendfile\(pipe\)=sendfile\(file\)' /usr/bin/python3 /tmp/checks/io.py
fetched_report "after the I/O checks (whole cc1, python3.11, numpy core read)"

echo "# metadata"
check stat 'hardlink: same inode, nlink 2' /bin/sh /tmp/checks/stat.sh
for want in 'whiteout: /etc/motd gone' 'README.ferry (opaque dir)'; do
    if grep -qF "$want" "$E2E_TMP/out/stat.got" 2>/dev/null; then pass "stat: '$want'"; else fail "stat: no '$want'"; fi
done
check xattr "getxattr medium-image" /usr/bin/python3 /tmp/checks/xattr.py

echo "# the whole tree"
check walk '^walked [0-9]+ paths' /bin/sh /tmp/checks/walk.sh
[[ -f $E2E_TMP/out/walk.got ]] && e2e_log "walk: $(tail -1 "$E2E_TMP/out/walk.got")"
fetched_report "after the walk"

if [[ -n ${FETCHED_PROGRAMS:-} && -n ${TOTAL_LAST:-} ]]; then
    if ((FETCHED_PROGRAMS > 0 && FETCHED_PROGRAMS < CIMG)); then
        pass "running python+numpy and gcc fetched $(mib "$FETCHED_PROGRAMS") of $(mib "$CIMG") gzip layers ($(mib "$UIMG") uncompressed)"
    else
        fail "running python+numpy and gcc fetched $FETCHED_PROGRAMS bytes, image layers $CIMG bytes"
    fi
fi

# ---------------------------------------------------------------- teardown
t0=$SECONDS
e2e_umount_under "$WORK/mnt-ctr"
fy "$E2E_TMP/um.out" "$E2E_TMP/um.err" "${umount_args[@]}"
if [[ $RC == 0 ]] && ! mountpoint -q "$MNT"; then
    pass "ferry umount after the container's overlay is gone"
else
    fail "ferry umount: exit $RC"
    show "$E2E_TMP/um.err"
fi
e2e_log "total $((SECONDS - T_START)) s"
e2e_summary
