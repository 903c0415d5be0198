#!/usr/bin/env bash
# Installs containerd 2.x from Debian unstable *beside* the system's containerd (1.6 on
# Debian 12), for the e2e tests that run on both (tests/e2e/lib.sh, containerd_flavours).
# Called by scripts/deps.sh as root; idempotent: a second run with the stamp in place
# does nothing and needs no network.
#
#   bash scripts/containerd2.sh            install if missing, print the version
#
# Nothing is installed through dpkg: the package is verified and its three binaries
# (containerd, containerd-shim-runc-v2, ctr) are extracted with `dpkg-deb -x` into
# $CONTAINERD2_DIR/bin (default /opt/ferry-ci/containerd2), so the system containerd
# stays what it is. Verification, as apt does it:
#   1. dists/unstable/InRelease is checked with gpgv against Debian's archive keyring
#      (bookworm's debian-archive-keyring holds the keys unstable is signed with); only
#      the signed text gpgv writes out is used afterwards;
#   2. main/binary-amd64/Packages.xz (fetched by hash, Acquire-By-Hash) must have the
#      SHA256 and size InRelease lists;
#   3. the containerd .deb must have the SHA256 and size the Packages entry lists.
# No version is pinned: whatever unstable carries now (2.x) is taken and printed; a 1.x
# or 3.x there is refused. An expired Valid-Until (a mirror that stopped syncing) is a
# warning, not a failure: the signature still binds the bytes to Debian's key, but the
# index may be old (CONTAINERD2_STRICT=1 makes it a failure).
#
# Env: DEBIAN_MIRROR (default http://deb.debian.org/debian), CONTAINERD2_DIR.
set -euo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEST=${CONTAINERD2_DIR:-/opt/ferry-ci/containerd2}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
STAMP=$DEST/VERSION
BINS=(containerd containerd-shim-runc-v2 ctr)

log() { echo "containerd2: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

have_all() {
    local b
    [[ -s $STAMP ]] || return 1
    for b in "${BINS[@]}"; do [[ -x $DEST/bin/$b ]] || return 1; done
}
if have_all; then
    log "present: $(head -1 "$STAMP") in $DEST/bin"
    exit 0
fi

for c in curl gpgv xz dpkg-deb sha256sum; do
    command -v "$c" >/dev/null || die "missing $c (scripts/deps.sh installs curl, gpgv, xz-utils)"
done
[[ -f $KEYRING ]] || die "missing $KEYRING (package debian-archive-keyring)"

work=$(mktemp -d /tmp/ferry-containerd2.XXXXXX)
trap 'rm -rf "$work"' EXIT

fetch() { # fetch URL FILE
    curl -fsSL --connect-timeout 20 --max-time 600 --retry 4 --retry-delay 3 --retry-all-errors \
        -o "$2" "$1" || die "download failed: $1"
}
# check FILE SHA256 SIZE
check() {
    local got size
    got=$(sha256sum "$1" | cut -d' ' -f1)
    size=$(stat -c %s "$1")
    [[ $got == "$2" && $size == "$3" ]] ||
        die "$(basename "$1"): sha256 $got size $size, expected $2 size $3"
}

# 1. the signed release file
fetch "$MIRROR/dists/unstable/InRelease" "$work/InRelease"
gpgv --quiet --keyring "$KEYRING" --output "$work/Release" "$work/InRelease" 2>"$work/gpgv.log" ||
    { cat "$work/gpgv.log" >&2; die "InRelease of unstable: bad or unknown signature (keyring $KEYRING)"; }
log "InRelease signature good: $(grep -o 'Good signature from "[^"]*"' "$work/gpgv.log" | head -1)"
until=$(sed -n 's/^Valid-Until: //p' "$work/Release")
if [[ -n $until ]] && (($(date -d "$until" +%s) < $(date +%s))); then
    msg="unstable's Release expired at $until (the mirror has not synced since $(sed -n 's/^Date: //p' "$work/Release"))"
    [[ ${CONTAINERD2_STRICT:-0} == 1 ]] && die "$msg"
    log "WARNING: $msg; using its signed hashes anyway"
fi

# 2. the package index, by the hash the signed Release lists
read -r pk_sha pk_size < <(awk '/^SHA256:/ { s = 1; next } /^[^ ]/ { s = 0 }
    s && $3 == "main/binary-amd64/Packages.xz" { print $1, $2; exit }' "$work/Release")
[[ -n ${pk_sha:-} ]] || die "InRelease lists no SHA256 for main/binary-amd64/Packages.xz"
fetch "$MIRROR/dists/unstable/main/binary-amd64/by-hash/SHA256/$pk_sha" "$work/Packages.xz"
check "$work/Packages.xz" "$pk_sha" "$pk_size"

# 3. the containerd package
xz -dc "$work/Packages.xz" | awk -v RS= '/(^|\n)Package: containerd\n/' >"$work/entry"
field() { sed -n "s/^$1: //p" "$work/entry" | head -1; }
version=$(field Version) filename=$(field Filename) deb_sha=$(field SHA256) deb_size=$(field Size)
[[ -n $version && -n $filename && -n $deb_sha && -n $deb_size ]] ||
    die "no complete containerd entry in unstable's Packages"
[[ $version == 2.* ]] || die "unstable carries containerd $version, not 2.x"
[[ $filename == pool/* && $filename != *..* ]] || die "odd Filename: $filename"
log "unstable carries containerd $version ($filename)"
fetch "$MIRROR/$filename" "$work/containerd.deb"
check "$work/containerd.deb" "$deb_sha" "$deb_size"

# 4. its binaries, beside (not instead of) the system's containerd
dpkg-deb -x "$work/containerd.deb" "$work/x"
mkdir -p "$DEST/bin"
for b in "${BINS[@]}"; do
    [[ -x $work/x/usr/bin/$b ]] || die "the package has no usr/bin/$b"
    install -m 755 "$work/x/usr/bin/$b" "$DEST/bin/$b.new"
    mv -f "$DEST/bin/$b.new" "$DEST/bin/$b"
done
"$DEST/bin/containerd" --version >/dev/null || die "the extracted containerd does not run"
printf '%s\n%s %s\n' "$version" "$deb_sha" "$filename" >"$STAMP.new"
mv -f "$STAMP.new" "$STAMP"
log "installed containerd $version in $DEST/bin ($("$DEST/bin/containerd" --version))"
