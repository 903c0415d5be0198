#!/usr/bin/env bash
# bench/make-image.sh — build OCI image layouts from Debian bookworm packages.
#
#   bench/make-image.sh            big multi-layer image (>= 800 MB uncompressed)
#                                  -> ${OUT:-bench/out/image}, tag ferry-bench
#   bench/make-image.sh --small    tiny 2-layer busybox image (a few MB, < 1 min,
#                                  no debootstrap) -> ${SMALL_OUT:-tests/e2e/out/small}, tag small
#   bench/make-image.sh --medium   4-layer Debian image for running real programs in
#                                  e2e tests (~420 MB uncompressed, 150 MB gzip, ~2 min)
#                                  -> ${MEDIUM_OUT:-tests/e2e/out/medium}, tag medium
#
# Env:
#   OUT / SMALL_OUT / MEDIUM_OUT        output OCI layout dir
#   BUILD / SMALL_BUILD / MEDIUM_BUILD  where the layer rootfs dirs are kept (cache;
#                     the medium one is removed once its layout is written unless
#                     MEDIUM_BUILD is set)
#   FORCE=1           rebuild everything (rootfs dirs and layout)
#   MIRROR            Debian mirror (default http://deb.debian.org/debian)
#
# Big image layers (each upper layer = overlayfs upperdir = exact diff):
#   1 base      debootstrap --variant=minbase bookworm
#   2 compiler  gcc g++ make libc6-dev
#   3 datasci   python3 python3-numpy python3-scipy python3-pandas
#               (compiler goes first: python3-scipy -> python3-pythran pulls
#               in g++, so a compiler layer above datasci would be ~empty)
#   4 java      default-jdk-headless
#   5 app       /app/start.sh (imports numpy, prints "ready <version>"), and the
#               cold-start workloads /app/pandas.sh (pandas + numpy + scipy.linalg),
#               /app/gcc.sh (compiles and runs /app/hello.c), /app/java.sh (java -version)
# Medium image layers (same method):
#   1 base      debootstrap --variant=minbase bookworm
#   2 compiler  gcc libc6-dev
#   3 python    python3 python3-numpy
#   4 app       /app (hello.c, start.sh, a hard-linked pair, a file with a user.*
#               xattr), /etc/motd deleted (whiteout), /usr/share/doc/base-files
#               replaced (opaque directory)
# Layers are `tar --numeric-owner --xattrs -C DIR -cf - . | gzip -6` (plain gzip).
# Needs root (debootstrap, chroot, overlayfs mounts). Safe to re-run: finished
# layers are cached under $BUILD (stamp files), the layout is skipped if it exists.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
cd "$ROOT"

MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
PY=(python3 "$HERE/oci-layout.py")

log() { printf '[make-image %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

need_root() { [[ $(id -u) == 0 ]] || die "must run as root ($1)"; }

# ---------------------------------------------------------------- small image
build_small() {
    local out=${SMALL_OUT:-tests/e2e/out/small}
    local build=${SMALL_BUILD:-$(dirname "$out")/build-small}
    if [[ -f $out/index.json && -z ${FORCE:-} ]]; then
        log "small image exists at $out (FORCE=1 to rebuild)"
        python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print("small: %d layers, uncompressed %d, gzip %d" % (len(s["layers"]), s["uncompressed_bytes"], s["compressed_bytes"]))' "$out/ferry-summary.json" 2>/dev/null || true
        return 0
    fi
    rm -rf "$build"
    mkdir -p "$build/debs" "$build/1-busybox" "$build/2-files"
    log "downloading busybox-static with apt-get download"
    ( cd "$build/debs" && apt-get download -q busybox-static >/dev/null 2>&1 ) || {
        # the host apt lists may be missing/stale: refresh once and retry
        apt-get update -q >/dev/null
        ( cd "$build/debs" && apt-get download -q busybox-static )
    }
    local deb
    deb=$(find "$build/debs" -name 'busybox-static_*.deb' | head -1)
    [[ -f $deb ]] || die "busybox-static download failed"

    # layer 1: busybox + a few files
    local l1=$build/1-busybox
    dpkg -x "$deb" "$l1"
    rm -rf "${l1:?}/usr"  # docs, man, initramfs/lintian hooks: not needed
    mkdir -p "$l1/bin" "$l1/etc" "$l1/tmp" "$l1/data/sub/dir" "$l1/proc" "$l1/sys" "$l1/dev"
    chmod 1777 "$l1/tmp"
    local a
    for a in sh ls cat echo sha256sum; do ln -sf busybox "$l1/bin/$a"; done
    printf 'root:x:0:0:root:/root:/bin/sh\n' >"$l1/etc/passwd"
    printf 'root:x:0:\n' >"$l1/etc/group"
    printf 'ferry small test image\nlayer 1\n' >"$l1/etc/motd"
    printf 'this file is deleted by layer 2\n' >"$l1/tmp/remove-me.txt"
    printf 'original version (layer 1)\n' >"$l1/data/overwritten.txt"
    # ~1 MiB of deterministic, partly compressible data in a subdir
    python3 -c '
import hashlib,sys
out=bytearray()
i=0
while len(out) < 1<<20:
    out += hashlib.sha256(str(i).encode()).hexdigest().encode() + b"\n"
    i += 1
sys.stdout.buffer.write(out)' >"$l1/data/sub/dir/numbers.txt"

    # layer 2: app files, an overwrite and a whiteout
    local l2=$build/2-files
    mkdir -p "$l2/app" "$l2/tmp" "$l2/data"
    chmod 1777 "$l2/tmp"
    cat >"$l2/app/start.sh" <<'EOF'
#!/bin/sh
echo "ready small"
EOF
    chmod 755 "$l2/app/start.sh"
    printf 'hello from the ferry small image\n' >"$l2/app/hello.txt"
    printf 'new version (layer 2)\n' >"$l2/data/overwritten.txt"
    : >"$l2/tmp/.wh.remove-me.txt"

    log "writing OCI layout $out"
    "${PY[@]}" write --out "$out" --tag small --cmd '["/app/start.sh"]' \
        --env PATH=/bin "$l1" "$l2"
}

# ---------------------------------------------------------------- big image
MOUNTS=()
cleanup_mounts() {
    local i
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        umount -R "${MOUNTS[i]}" 2>/dev/null || umount -l "${MOUNTS[i]}" 2>/dev/null || true
    done
    MOUNTS=()
}
trap cleanup_mounts EXIT

# run_in_layer NAME LOWERS(colon-separated, topmost first) SCRIPT
# Mount overlay(lower=LOWERS, upper=$BUILD/NAME) on $BUILD/merged, chroot and
# run SCRIPT there; $BUILD/NAME ends up holding exactly the diff.
run_in_layer() {
    local name=$1 lowers=$2 script=$3
    local up=$BUILD/$name work=$BUILD/work-$name m=$BUILD/merged
    rm -rf "$up" "$work"
    mkdir -p "$up" "$work" "$m"
    mount -t overlay overlay \
        -o "lowerdir=$lowers,upperdir=$up,workdir=$work,redirect_dir=off,index=off,metacopy=off,xino=off" "$m"
    MOUNTS+=("$m")
    mount -t proc proc "$m/proc"
    mount --rbind /dev "$m/dev"
    mount --make-rslave "$m/dev"
    mount -t sysfs sysfs "$m/sys"
    mount -t tmpfs tmpfs "$m/tmp"  # scratch, never part of the layer
    # host DNS for apt without writing resolv.conf into the layer
    [[ -e $m/etc/resolv.conf || -L $m/etc/resolv.conf ]] || die "$m/etc/resolv.conf missing"
    mount --bind /etc/resolv.conf "$m/etc/resolv.conf"
    chroot "$m" /usr/bin/env -i HOME=/root LC_ALL=C DEBIAN_FRONTEND=noninteractive \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        /bin/sh -euxc "$script"
    cleanup_mounts
    rm -rf "$work"
}

APT_CLEAN='apt-get clean; rm -rf /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/* /var/cache/apt/*.bin /var/lib/apt/lists/* /var/cache/debconf/*-old /var/lib/dpkg/*-old /var/log/apt/eipp.log.xz'
apt_layer_script() {
    echo "apt-get update -q; apt-get install -y -q --no-install-recommends $*; $APT_CLEAN"
}

# build_base_layer: layer 1 ($BUILD/1-base), debootstrap minbase, cached by a stamp
build_base_layer() {
    [[ ! -e $BUILD/.done-1-base ]] || return 0
    local t0=$SECONDS
    log "layer 1: debootstrap --variant=minbase $SUITE (this takes a few minutes)"
    rm -rf "$BUILD/1-base"
    debootstrap --variant=minbase "$SUITE" "$BUILD/1-base" "$MIRROR" >"$BUILD/debootstrap.log" 2>&1 \
        || { tail -30 "$BUILD/debootstrap.log" >&2; die "debootstrap failed (log: $BUILD/debootstrap.log)"; }
    local b=$BUILD/1-base
    rm -rf "${b:?}"/dev/* "$b"/var/cache/apt/archives/*.deb "$b"/var/lib/apt/lists/* \
        "$b"/var/cache/apt/*.bin "$b"/tmp/* "$b"/var/log/bootstrap.log
    # reproducible-ish, container-like base: no host resolv.conf/hostname baked in
    : >"$b/etc/resolv.conf"
    echo ferry >"$b/etc/hostname"
    touch "$BUILD/.done-1-base"
    log "layer 1 done ($((SECONDS - t0))s)"
}

# apt_layers SPEC...: each SPEC "NAME|SCRIPT" becomes an overlay diff $BUILD/NAME over
# the layers before it (cached by stamps); leaves $lowers (caller's local) updated.
apt_layers() {
    local spec name script
    for spec in "$@"; do
        name=${spec%%|*} script=${spec#*|}
        if [[ ! -e $BUILD/.done-$name ]]; then
            [[ ! -e $BUILD/.converted ]] || die "$BUILD already converted; rerun with FORCE=1"
            log "layer $name: $script"
            local t1=$SECONDS
            run_in_layer "$name" "$lowers" "$script" >"$BUILD/$name.log" 2>&1 \
                || { tail -30 "$BUILD/$name.log" >&2; die "layer $name failed (log: $BUILD/$name.log)"; }
            touch "$BUILD/.done-$name"
            log "layer $name done ($((SECONDS - t1))s)"
        fi
        lowers=$BUILD/$name:$lowers
    done
}

build_big() {
    need_root "debootstrap/chroot/overlayfs"
    local out=${OUT:-bench/out/image}
    BUILD=${BUILD:-bench/out/build}
    mkdir -p "$BUILD"
    BUILD=$(cd "$BUILD" && pwd)
    if [[ -f $out/index.json && -z ${FORCE:-} ]]; then
        log "image exists at $out (FORCE=1 to rebuild)"
        python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); [print("  layer %-10s uncompressed %12d gzip %12d %s" % (l["name"], l["usize"], l["csize"], l["digest"])) for l in s["layers"]]; print("  total: uncompressed %d, gzip %d" % (s["uncompressed_bytes"], s["compressed_bytes"]))' "$out/ferry-summary.json" 2>/dev/null || true
        return 0
    fi
    if [[ -n ${FORCE:-} ]]; then
        log "FORCE=1: removing $BUILD"
        rm -rf "$BUILD"
        mkdir -p "$BUILD"
    fi
    local t0=$SECONDS
    build_base_layer

    local lowers=$BUILD/1-base
    local name
    apt_layers \
        "2-compiler|$(apt_layer_script gcc g++ make libc6-dev)" \
        "3-datasci|$(apt_layer_script python3 python3-numpy python3-scipy python3-pandas)" \
        "4-java|$(apt_layer_script default-jdk-headless)"

    # layer 5: small app layer (written directly, no chroot needed)
    name=5-app
    if [[ ! -e $BUILD/.done-$name ]]; then
        rm -rf "${BUILD:?}/$name"
        mkdir -p "$BUILD/$name/app"
        cat >"$BUILD/$name/app/start.sh" <<'EOF'
#!/bin/sh
# ferry benchmark entrypoint: time-to-ready = time until this prints "ready"
exec python3 -c 'import numpy; print("ready", numpy.__version__)'
EOF
        # the cold-start workloads (bench/cold-start.sh WORKLOADS): each prints one line
        # when its work is done, so "first output" is the start's whole cost
        cat >"$BUILD/$name/app/pandas.sh" <<'EOF'
#!/bin/sh
exec python3 -c 'import pandas, numpy, scipy.linalg; print("ready pandas", pandas.__version__)'
EOF
        cat >"$BUILD/$name/app/hello.c" <<'EOF'
#include <stdio.h>
#include <math.h>
int main(void) { printf("ready gcc %.3f\n", sqrt(2.0)); return 0; }
EOF
        cat >"$BUILD/$name/app/gcc.sh" <<'EOF'
#!/bin/sh
set -e
gcc -O2 -o /tmp/hello /app/hello.c -lm
exec /tmp/hello
EOF
        cat >"$BUILD/$name/app/java.sh" <<'EOF'
#!/bin/sh
# java -version prints to stderr; the first line on stdout is the benchmark's signal
java -version 2>&1 | head -1 | sed 's/^/ready java /'
EOF
        chmod 755 "$BUILD/$name/app/start.sh" "$BUILD/$name/app/pandas.sh" \
            "$BUILD/$name/app/gcc.sh" "$BUILD/$name/app/java.sh"
        printf 'ferry-bench image, built %s from Debian %s\n' "$(date -u +%FT%TZ)" "$SUITE" \
            >"$BUILD/$name/app/README"
        touch "$BUILD/.done-$name"
    fi

    # overlay whiteouts -> OCI whiteouts (in place: the dirs are not used as
    # overlay lowers after this point)
    if [[ ! -e $BUILD/.converted ]]; then
        local -a below=("$BUILD/1-base")
        for name in 2-compiler 3-datasci 4-java; do
            "${PY[@]}" convert-whiteouts "$BUILD/$name" "${below[@]}"
            below+=("$BUILD/$name")
        done
        touch "$BUILD/.converted"
    fi

    log "writing OCI layout $out (tar | gzip -6 of each layer)"
    local t2=$SECONDS
    "${PY[@]}" write --out "$out" --tag ferry-bench --cmd '["/app/start.sh"]' \
        --min-bytes $((800 * 1000 * 1000)) \
        "$BUILD/1-base" "$BUILD/2-compiler" "$BUILD/3-datasci" "$BUILD/4-java" "$BUILD/5-app"
    log "layout written in $((SECONDS - t2))s; total build time $((SECONDS - t0))s"
    skopeo inspect "oci:$out:ferry-bench" >/dev/null && log "skopeo inspect oci:$out:ferry-bench OK"
}

# ---------------------------------------------------------------- medium image
# The app layer's script (run chrooted over the python layer): a C source, an entry
# point, a hard-linked pair, a user.* xattr, a whiteout and an opaque directory.
MEDIUM_APP_SCRIPT='
mkdir -p /app/data
cat >/app/hello.c <<"EOC"
#include <stdio.h>
#include <string.h>
int main(void) {
    unsigned long sum = 0;
    for (unsigned i = 1; i <= 1000000; i++) sum += i % 7 * i;
    printf("hello from gcc %d.%d, sum %lu\n", __GNUC__, __GNUC_MINOR__, sum);
    return 0;
}
EOC
cat >/app/start.sh <<"EOS"
#!/bin/sh
exec python3 -c "import numpy; print(\"ready\", numpy.__version__)"
EOS
chmod 755 /app/start.sh
seq 1 20000 >/app/data/numbers.txt
ln /app/data/numbers.txt /app/data/numbers-hardlink.txt
printf "xattr carrier\n" >/app/data/xattr.txt
python3 -c "import os; os.setxattr(\"/app/data/xattr.txt\", \"user.ferry.test\", b\"medium-image\")"
rm -f /etc/motd
rm -rf /usr/share/doc/base-files
mkdir /usr/share/doc/base-files
printf "replaced by the app layer (opaque dir)\n" >/usr/share/doc/base-files/README.ferry
'

build_medium() {
    need_root "debootstrap/chroot/overlayfs"
    local out=${MEDIUM_OUT:-tests/e2e/out/medium}
    BUILD=${MEDIUM_BUILD:-$(dirname "$out")/build-medium}
    mkdir -p "$BUILD"
    BUILD=$(cd "$BUILD" && pwd)
    if [[ -f $out/index.json && -z ${FORCE:-} ]]; then
        log "medium image exists at $out (FORCE=1 to rebuild)"
        return 0
    fi
    if [[ -n ${FORCE:-} ]]; then
        log "FORCE=1: removing $BUILD"
        rm -rf "$BUILD"
        mkdir -p "$BUILD"
    fi
    local t0=$SECONDS
    build_base_layer
    local lowers=$BUILD/1-base name
    apt_layers \
        "2-compiler|$(apt_layer_script gcc libc6-dev)" \
        "3-python|$(apt_layer_script python3 python3-numpy)" \
        "4-app|$MEDIUM_APP_SCRIPT"
    if [[ ! -e $BUILD/.converted ]]; then
        local -a below=("$BUILD/1-base")
        for name in 2-compiler 3-python 4-app; do
            "${PY[@]}" convert-whiteouts "$BUILD/$name" "${below[@]}"
            below+=("$BUILD/$name")
        done
        touch "$BUILD/.converted"
    fi
    log "writing OCI layout $out (tar | gzip -6 of each layer)"
    rm -rf "$out"
    "${PY[@]}" write --out "$out" --tag medium --cmd '["/app/start.sh"]' \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        "$BUILD/1-base" "$BUILD/2-compiler" "$BUILD/3-python" "$BUILD/4-app"
    log "medium image written; total build time $((SECONDS - t0))s"
    # The layout is what tests cache; the default build dir (~430 MB of rootfs diffs)
    # is only a cache for interrupted builds. An explicit MEDIUM_BUILD is kept.
    if [[ -z ${MEDIUM_BUILD:-} ]]; then
        rm -rf "$BUILD"
    fi
}

case ${1:-} in
    --small) build_small ;;
    --medium) build_medium ;;
    "") build_big ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | grep '^#' ;;
    *) die "usage: $0 [--small|--medium]" ;;
esac
