#!/usr/bin/env bash
# tests/e2e/ferry_formats.sh — the three ways ferry makes an image lazy-loadable
# (index in place, eStargz conversion, pack from a directory) checked against
# tar/gzip and containerd's ordinary (overlayfs) unpack, plus bad input.
#
#   bash tests/e2e/ferry_formats.sh
#
# 1. index: copy of the small image (bench/make-image.sh --small), `ferry index
#    --min-layer-size 0`; manifest digest and every existing blob unchanged,
#    every blob hashes to its name, `inspect --json` says gzip+ferry-index for
#    every layer, `ferry cat` == oci_extract of the original for a text file,
#    /bin/busybox, a symlink, the overwritten file and a nested file, the
#    whited-out path fails, --stats reads fewer bytes than the layers hold;
#    indexing again (same layout, fresh copy) gives byte-identical artifacts.
# 2. eStargz: `ferry convert --estargz --priority`; every layer passes gzip -t
#    and tar -tzf, ends with stargz.index.json, has .prefetch.landmark right
#    after the priority files, toc.digest == sha256(stargz.index.json),
#    uncompressed-size and config diff_ids match gzip -dc; oci_extract gives
#    the original tree; `ferry cat` gives the original files; containerd
#    (ctr pull --plain-http + ctr run) shows the same files as the original.
# 3. pack: a directory (nested dirs, 5 MiB random file, symlink, hardlink,
#    empty file, >100-char name, busybox) -> `ferry pack`; one gzip+ferry-index
#    layer; `ferry cat` and tar -xzf give back the tree (hardlink = one inode);
#    skopeo push + ctr pull unpacks it; ctr run busybox sha256sum inside it.
# 4. bad input: a byte flipped in the middle of the biggest layer of an indexed
#    copy -> `ferry cat` of the file there fails with "digest mismatch" and
#    prints no wrong bytes; a truncated index.json -> clear error, exit != 0.
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry),
#      OUT (default tests/e2e/out; the small image is $OUT/small:small),
#      FERRY_TIMEOUT (seconds per ferry call, 120), E2E_KEEP=1 / E2E_VERBOSE=1.
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "private containerd"
need_cmd containerd ctr runc docker-registry skopeo jq curl tar gzip sha256sum cmp python3 timeout

FT=${FERRY_TIMEOUT:-120}
find_ferry
e2e_init

small_image
require_ferry

# ---------------------------------------------------------------- helpers
sha() { sha256sum <"$1" | cut -d' ' -f1; }
# showdiff WANT_FILE GOT_FILE: print the differing lines as "- want" / "+ got"
showdiff() { { diff "$1" "$2" | grep '^[<>]' | sed 's/^</-/; s/^>/+/' | show /dev/stdin 20; } || true; }
# manifest_digest DIR TAG
manifest_digest() {
    jq -r --arg t "$2" '.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $t) | .digest' "$1/index.json" | head -1
}
blob() { echo "$1/blobs/sha256/${2#sha256:}"; }
# tree_list DIR: one line per entry (path, type, mode, sha256 or link target),
# without the eStargz metadata files at the root
tree_list() {
    (
        cd "$1"
        find . -mindepth 1 ! -path ./stargz.index.json ! -path ./.prefetch.landmark \
            ! -path ./.no.prefetch.landmark -printf '%p\t%y\t%m\t%l\n' | LC_ALL=C sort |
            while IFS=$'\t' read -r p y m l; do
                case $y in
                    f) echo "$p file $m $(sha "$p")" ;;
                    l) echo "$p symlink -> $l" ;;
                    *) echo "$p $y $m" ;;
                esac
            done
    )
}
# compare_trees NAME WANT_DIR GOT_DIR
compare_trees() {
    tree_list "$2" >"$E2E_TMP/want.tree"
    tree_list "$3" >"$E2E_TMP/got.tree"
    if [[ -s $E2E_TMP/want.tree ]] && cmp -s "$E2E_TMP/want.tree" "$E2E_TMP/got.tree"; then
        pass "$1 ($(wc -l <"$E2E_TMP/want.tree") entries: types, modes, sha256, link targets)"
    else
        fail "$1: trees differ (- want, + got)"
        showdiff "$E2E_TMP/want.tree" "$E2E_TMP/got.tree"
    fi
}
# cat_eq IMAGE PATH WANT_FILE [LABEL]: ferry cat IMAGE PATH == WANT_FILE
cat_eq() {
    local img=$1 p=$2 want_f=$3 want got
    want=$(sha "$want_f")
    fy "$E2E_TMP/cat.out" "$E2E_TMP/cat.err" cat "$img" "$p"
    got=$(sha "$E2E_TMP/cat.out")
    if [[ $RC == 0 && $got == "$want" ]]; then
        pass "${4:-ferry cat} $p ($(stat -c %s "$E2E_TMP/cat.out") bytes)"
    else
        fail "${4:-ferry cat} $p: exit $RC, sha256 $got, want $want ($(stat -L -c %s "$want_f") bytes)"
        show "$E2E_TMP/cat.err"
    fi
}
# cat_fails IMAGE PATH LABEL: ferry cat must fail (not time out) and print nothing
cat_fails() {
    fy "$E2E_TMP/cat.out" "$E2E_TMP/cat.err" cat "$1" "$2"
    if [[ $RC != 0 && $RC != 124 && ! -s $E2E_TMP/cat.out ]]; then
        pass "$3: ferry cat $2 fails (exit $RC: $(head -c 160 "$E2E_TMP/cat.err"))"
    else
        fail "$3: ferry cat $2: exit $RC, printed $(stat -c %s "$E2E_TMP/cat.out") bytes"
    fi
}
# layer_formats IMAGE -> "fmt fmt ..." from inspect --json
layer_formats() {
    fy "$E2E_TMP/inspect.json" "$E2E_TMP/inspect.err" inspect --json "$1"
    [[ $RC == 0 ]] || { show "$E2E_TMP/inspect.err"; return 1; }
    jq -r '[.layers[].format] | join(" ")' "$E2E_TMP/inspect.json"
}
SERVICES=0
services_up() {
    [[ $SERVICES == 1 ]] && return 0
    start_containerd
    start_registry
    SERVICES=1
}
# ctr_run REF CMD: `ctr run --rm REF ID /bin/busybox sh -c CMD`, stdout+stderr
# to $E2E_TMP/ctr.out; sets RC
CTR_N=0
ctr_run() {
    CTR_N=$((CTR_N + 1))
    set +e
    timeout 120 ctr -a "$CONTAINERD_SOCK" -n "$CTR_NAMESPACE" run --rm "$1" "ferry-formats-$$-$CTR_N" \
        /bin/busybox sh -c "$2" >"$E2E_TMP/ctr.out" 2>&1
    RC=$?
    set -e
}
# ctr_pull NAME REF: ctr image pull --plain-http (fetch + overlayfs unpack)
ctr_pull() {
    local t0=$SECONDS
    if ctr_ image pull --plain-http "$2" >"$E2E_TMP/pull.log" 2>&1; then
        pass "$1: ctr image pull --plain-http $2 (pull + unpack $((SECONDS - t0))s)"
    else
        fail "$1: ctr image pull --plain-http $2"
        show "$E2E_TMP/pull.log"
        return 1
    fi
}

# reference tree: the original image applied with tar -xzf + whiteouts
REF=$E2E_TMP/reference
oci_extract "$SMALL" small "$REF"
[[ ! -e $REF/tmp/remove-me.txt ]] || e2e_die "reference tree still has whited-out /tmp/remove-me.txt (oci_extract bug)"
PATHS=(/etc/motd /app/hello.txt /bin/busybox /bin/sh /data/overwritten.txt /data/sub/dir/numbers.txt)
WHITEOUT=/tmp/remove-me.txt

# ================================================================ 1. index
echo "# 1. ferry index (no conversion)"
IDX=$E2E_TMP/indexed
cp -r "$SMALL" "$IDX"
IMG=oci:$IDX:small
mdig=$(manifest_digest "$IDX" small)
( cd "$IDX/blobs/sha256" && sha256sum -- * ) | LC_ALL=C sort >"$E2E_TMP/blobs.before"
nlayers=$(jq '.layers | length' "$(blob "$IDX" "$mdig")")
layers_total=$(jq '[.layers[].size] | add' "$(blob "$IDX" "$mdig")")

fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index --min-layer-size 0 "$IMG"
if [[ $RC == 0 ]]; then pass "ferry index --min-layer-size 0 $IMG"; else fail "ferry index: exit $RC"; show "$E2E_TMP/index.err"; fi

mdig2=$(manifest_digest "$IDX" small)
if [[ $mdig2 == "$mdig" ]]; then
    pass "index.json still tags small -> $mdig"
else
    fail "manifest digest changed by ferry index: $mdig -> $mdig2"
fi
changed=$(
    while read -r sum name; do
        [[ -f $IDX/blobs/sha256/$name && $(sha "$IDX/blobs/sha256/$name") == "$sum" ]] || echo "$name"
    done <"$E2E_TMP/blobs.before"
)
if [[ -z $changed ]]; then
    pass "all $(wc -l <"$E2E_TMP/blobs.before") pre-existing blobs (manifest, config, $nlayers layers) byte-identical"
else
    fail "blobs changed or removed by ferry index: ${changed//$'\n'/ }"
fi
bad=$(cd "$IDX/blobs/sha256" && for f in *; do [[ $(sha "$f") == "$f" ]] || echo "$f"; done)
if [[ -z $bad ]]; then
    pass "every blob in the indexed layout hashes to its name ($(ls "$IDX/blobs/sha256" | wc -l) blobs)"
else
    fail "blobs whose content does not match their name: ${bad//$'\n'/ }"
fi
REFTAG=sha256-${mdig#sha256:}
refdig=$(manifest_digest "$IDX" "$REFTAG")
artdig=""
if [[ -n $refdig && -f $(blob "$IDX" "$refdig") ]]; then
    artdig=$(jq -r '.manifests[0].digest' "$(blob "$IDX" "$refdig")")
    subj=$(jq -r '.subject.digest' "$(blob "$IDX" "$artdig")" 2>/dev/null || true)
    if [[ $subj == "$mdig" ]]; then
        pass "referrers tag $REFTAG -> $refdig -> artifact $artdig (subject = image manifest)"
    else
        fail "artifact $artdig subject is '$subj', want $mdig"
    fi
else
    fail "no referrers tag $REFTAG in index.json"
fi
fmts=$(layer_formats "$IMG" || true)
want_fmts=$(printf 'gzip+ferry-index %.0s' $(seq "$nlayers"))
if [[ "$fmts " == "$want_fmts" ]]; then
    pass "ferry inspect --json: $nlayers layers, all gzip+ferry-index"
else
    fail "ferry inspect --json formats: '$fmts', want $nlayers x gzip+ferry-index"
fi
for p in "${PATHS[@]}"; do cat_eq "$IMG" "$p" "$REF$p" "indexed: ferry cat"; done
cat_fails "$IMG" "$WHITEOUT" "indexed: whited-out path"
p=/etc/motd
fy "$E2E_TMP/cat.out" "$E2E_TMP/cat.err" cat --stats "$IMG" "$p"
n=$(sed -n 's/.*compressed_bytes_read=\([0-9][0-9]*\).*/\1/p' "$E2E_TMP/cat.err" | tail -1)
if [[ $RC == 0 && $(sha "$E2E_TMP/cat.out") == "$(sha "$REF$p")" && -n $n ]] && ((n > 0 && n < layers_total)); then
    pass "indexed: ferry cat --stats $p: compressed_bytes_read=$n < $layers_total layer bytes"
else
    fail "indexed: ferry cat --stats $p: exit $RC, compressed_bytes_read='$n', layers hold $layers_total bytes"
    show "$E2E_TMP/cat.err"
fi

# determinism: re-index in place, and index a fresh copy
fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index --min-layer-size 0 "$IMG"
refdig_b=$(manifest_digest "$IDX" "$REFTAG")
nref=$(jq --arg t "$REFTAG" '[.manifests[] | select(.annotations["org.opencontainers.image.ref.name"] == $t)] | length' "$IDX/index.json")
if [[ $RC == 0 && $refdig_b == "$refdig" && $nref == 1 ]]; then
    pass "ferry index again (same layout): same referrers index $refdig, one $REFTAG entry"
else
    fail "ferry index again: exit $RC, referrers index $refdig -> $refdig_b, $nref $REFTAG entries"
fi
IDX2=$E2E_TMP/indexed2
cp -r "$SMALL" "$IDX2"
fy "$E2E_TMP/index.out" "$E2E_TMP/index.err" index --min-layer-size 0 "oci:$IDX2:small"
refdig_c=$(manifest_digest "$IDX2" "$REFTAG")
same=1
if [[ -n $artdig ]]; then
    for d in "$artdig" $(jq -r '.config.digest, .layers[].digest' "$(blob "$IDX" "$artdig")"); do
        cmp -s "$(blob "$IDX" "$d")" "$(blob "$IDX2" "$d")" || same=0
    done
else
    same=0
fi
if [[ $RC == 0 && -n $refdig && $refdig_c == "$refdig" && $same == 1 ]]; then
    pass "ferry index of a fresh copy: byte-identical referrers index, artifact manifest and layer indexes"
else
    fail "ferry index of a fresh copy: exit $RC, referrers index $refdig_c (first run $refdig), blobs identical=$same"
fi

# ================================================================ 2. eStargz
echo "# 2. ferry convert --estargz"
PLAIN=$E2E_TMP/plain
cp -r "$SMALL" "$PLAIN"
ES=$E2E_TMP/esgz
PRIO=(/app/start.sh /etc/motd)
printf '%s\n' "${PRIO[@]}" >"$E2E_TMP/priority.txt"
EIMG=oci:$ES:esgz
fy "$E2E_TMP/convert.out" "$E2E_TMP/convert.err" convert --estargz "oci:$PLAIN:small" "$EIMG" --priority "$E2E_TMP/priority.txt"
if [[ $RC == 0 ]]; then
    pass "ferry convert --estargz --priority (${PRIO[*]}) -> $EIMG"
else
    fail "ferry convert --estargz: exit $RC"
    show "$E2E_TMP/convert.err"
fi
emdig=$(manifest_digest "$ES" esgz 2>/dev/null || true)
if [[ -n $emdig && -f $(blob "$ES" "$emdig") ]]; then
    EMAN=$(blob "$ES" "$emdig")
    econf=$(blob "$ES" "$(jq -r .config.digest "$EMAN")")
    enl=$(jq '.layers | length' "$EMAN")
    if [[ $enl == "$nlayers" ]]; then
        pass "converted image has $enl layers like the original"
    else
        fail "converted image has $enl layers, original $nlayers"
    fi
    fmts=$(layer_formats "$EIMG" || true)
    if [[ "$fmts " == "$(printf 'estargz %.0s' $(seq "$enl"))" ]]; then
        pass "ferry inspect: all converted layers are estargz"
    else
        fail "ferry inspect formats of the converted image: '$fmts'"
    fi
    i=0
    for d in $(jq -r '.layers[].digest' "$EMAN"); do
        b=$(blob "$ES" "$d")
        L="esgz layer $i (${d:7:12})"
        if gzip -t "$b" 2>"$E2E_TMP/gz.err"; then pass "$L: gzip -t"; else fail "$L: gzip -t"; show "$E2E_TMP/gz.err"; fi
        if tar -tzf "$b" >"$E2E_TMP/list" 2>"$E2E_TMP/tar.err"; then pass "$L: tar -tzf ($(wc -l <"$E2E_TMP/list") entries)"; else fail "$L: tar -tzf"; show "$E2E_TMP/tar.err"; fi
        last=$(tail -1 "$E2E_TMP/list")
        if [[ $last == stargz.index.json ]]; then pass "$L: last entry is stargz.index.json"; else fail "$L: last entry is '$last'"; fi
        # regular (non-dir) entries before the landmark must be exactly the
        # priority files this layer has, in priority order
        got_prio=$(python3 - "$b" <<'EOF'
import sys, tarfile
names = []
with tarfile.open(sys.argv[1], "r:gz") as t:
    for m in t:
        n = m.name[2:] if m.name.startswith("./") else m.name
        if n in (".prefetch.landmark", ".no.prefetch.landmark"):
            print(" ".join(names) + " | " + n)
            break
        if not m.isdir():
            names.append("/" + n)
    else:
        print("no landmark")
EOF
)
        want_prio=""
        for p in "${PRIO[@]}"; do
            if grep -qxF -e "${p#/}" -e "./${p#/}" "$E2E_TMP/list"; then want_prio+="${want_prio:+ }$p"; fi
        done
        if [[ -n $want_prio ]]; then want_prio+=" | .prefetch.landmark"; else want_prio=" | .no.prefetch.landmark"; fi
        if [[ $got_prio == "$want_prio" ]]; then
            pass "$L: landmark right after the priority files: '$got_prio'"
        else
            fail "$L: files before the landmark: '$got_prio', want '$want_prio'"
        fi
        toc=$(jq -r --arg d "$d" '.layers[] | select(.digest == $d) | .annotations["containerd.io/snapshot/stargz/toc.digest"] // ""' "$EMAN")
        usize=$(jq -r --arg d "$d" '.layers[] | select(.digest == $d) | .annotations["io.containers.estargz.uncompressed-size"] // ""' "$EMAN")
        toc_real=sha256:$(tar -xzOf "$b" stargz.index.json 2>/dev/null | sha256sum | cut -d' ' -f1)
        if [[ $toc == "$toc_real" ]]; then
            pass "$L: toc.digest annotation = sha256 of stargz.index.json ($toc)"
        else
            fail "$L: toc.digest annotation '$toc', sha256 of stargz.index.json $toc_real"
        fi
        ubytes=$(gzip -dc "$b" 2>/dev/null | wc -c)
        if [[ $usize == "$ubytes" ]]; then
            pass "$L: io.containers.estargz.uncompressed-size = $ubytes"
        else
            fail "$L: io.containers.estargz.uncompressed-size '$usize', gzip -dc gives $ubytes bytes"
        fi
        diffid=$(jq -r ".rootfs.diff_ids[$i]" "$econf")
        real=sha256:$(gzip -dc "$b" 2>/dev/null | sha256sum | cut -d' ' -f1)
        if [[ $diffid == "$real" ]]; then pass "$L: config diff_id = sha256 of the uncompressed layer"; else fail "$L: config diff_id $diffid, uncompressed sha256 $real"; fi
        i=$((i + 1))
    done
    ETREE=$E2E_TMP/esgz-tree
    if oci_extract "$ES" esgz "$ETREE" 2>"$E2E_TMP/extract.err"; then
        compare_trees "esgz: tar -xzf of all layers == original tree" "$REF" "$ETREE"
    else
        fail "esgz: oci_extract (tar -xzf) of the converted image failed"
        show "$E2E_TMP/extract.err"
    fi
    for p in "${PATHS[@]}"; do cat_eq "$EIMG" "$p" "$REF$p" "esgz: ferry cat"; done
    cat_fails "$EIMG" "$WHITEOUT" "esgz: whited-out path"

    # containerd's ordinary unpack (overlayfs snapshotter, no stargz snapshotter)
    services_up
    CMD='cd / && busybox cat /etc/motd /data/overwritten.txt && busybox sha256sum /bin/busybox /app/hello.txt /data/sub/dir/numbers.txt && if [ -e /tmp/remove-me.txt ]; then echo whiteout-broken; else echo whiteout-ok; fi && /app/start.sh'
    {
        cat "$REF/etc/motd" "$REF/data/overwritten.txt"
        for p in /bin/busybox /app/hello.txt /data/sub/dir/numbers.txt; do echo "$(sha "$REF$p")  $p"; done
        echo whiteout-ok
        echo "ready small"
    } >"$E2E_TMP/ctr.want"
    OREF=$REGISTRY/formats:orig
    EREF=$REGISTRY/formats:esgz
    if push_oci "$PLAIN" small formats:orig 2>"$E2E_TMP/push.err"; then pass "skopeo push original -> $OREF"; else fail "skopeo push original"; show "$E2E_TMP/push.err"; fi
    if push_oci "$ES" esgz formats:esgz 2>"$E2E_TMP/push.err"; then pass "skopeo push eStargz -> $EREF"; else fail "skopeo push eStargz"; show "$E2E_TMP/push.err"; fi
    ctr_pull original "$OREF" || true
    ctr_pull esgz "$EREF" || true
    ctr_run "$OREF" "$CMD"
    if [[ $RC == 0 ]] && cmp -s "$E2E_TMP/ctr.out" "$E2E_TMP/ctr.want"; then
        pass "ctr run original: files and whiteout as in the reference tree"
    else
        fail "ctr run original: exit $RC, output differs from the reference tree (- want, + got)"
        showdiff "$E2E_TMP/ctr.want" "$E2E_TMP/ctr.out"
    fi
    ctr_run "$EREF" "$CMD"
    if [[ $RC == 0 ]] && cmp -s "$E2E_TMP/ctr.out" "$E2E_TMP/ctr.want"; then
        pass "ctr run eStargz image (overlayfs unpack): same motd, overwritten file, sha256s, whiteout and start.sh output as the original"
    else
        fail "ctr run eStargz image: exit $RC, output differs from the reference tree (- want, + got)"
        showdiff "$E2E_TMP/ctr.want" "$E2E_TMP/ctr.out"
    fi
else
    fail "no esgz manifest in $ES/index.json"
fi

# ================================================================ 3. pack
echo "# 3. ferry pack"
SRC=$E2E_TMP/packsrc
LONG=$(printf 'long-name-%.0s' $(seq 12))file.txt   # 128 chars
mkdir -p "$SRC/a/b/c/d" "$SRC/bin" "$SRC/emptydir"
head -c $((5 * 1024 * 1024)) /dev/urandom >"$SRC/a/random.bin"
printf 'top level text\n' >"$SRC/top.txt"
printf 'deep text\n' >"$SRC/a/b/c/d/deep.txt"
seq 1 20000 >"$SRC/a/b/numbers.txt"
printf 'long name\n' >"$SRC/a/b/c/$LONG"
: >"$SRC/a/empty"
ln -s b/c/d/deep.txt "$SRC/a/link-to-deep"
ln "$SRC/top.txt" "$SRC/a/b/hardlink.txt"
cp "$REF/bin/busybox" "$SRC/bin/busybox"
PK=$E2E_TMP/packed
PIMG=oci:$PK:packed
fy "$E2E_TMP/pack.out" "$E2E_TMP/pack.err" pack "$SRC" "$PIMG"
if [[ $RC == 0 ]]; then pass "ferry pack $SRC -> $PIMG"; else fail "ferry pack: exit $RC"; show "$E2E_TMP/pack.err"; fi
pmdig=$(manifest_digest "$PK" packed 2>/dev/null || true)
if [[ -n $pmdig && -f $(blob "$PK" "$pmdig") ]]; then
    fmts=$(layer_formats "$PIMG" || true)
    if [[ $fmts == gzip+ferry-index ]]; then pass "ferry inspect: one gzip+ferry-index layer"; else fail "ferry inspect formats of the packed image: '$fmts'"; fi
    while IFS= read -r -d '' f; do
        cat_eq "$PIMG" "/${f#./}" "$SRC/$f" "pack: ferry cat"
    done < <(cd "$SRC" && find . \( -type f -o -type l \) -print0 | LC_ALL=C sort -z)
    pl=$(blob "$PK" "$(jq -r '.layers[0].digest' "$(blob "$PK" "$pmdig")")")
    PX=$E2E_TMP/pack-extracted
    mkdir -p "$PX"
    if gzip -t "$pl" 2>"$E2E_TMP/gz.err" && tar --numeric-owner -xzf "$pl" -C "$PX" 2>"$E2E_TMP/tar.err"; then
        pass "pack: layer blob passes gzip -t and tar -xzf"
    else
        fail "pack: layer blob fails gzip -t / tar -xzf"
        show "$E2E_TMP/gz.err"; show "$E2E_TMP/tar.err"
    fi
    compare_trees "pack: tar -xzf of the layer == source tree" "$SRC" "$PX"
    if [[ -f $PX/top.txt && $(stat -c %i "$PX/top.txt") == $(stat -c %i "$PX/a/b/hardlink.txt" 2>/dev/null) ]]; then
        pass "pack: hardlink top.txt / a/b/hardlink.txt extracts as one inode"
    else
        fail "pack: top.txt and a/b/hardlink.txt are not one inode after tar -xzf"
    fi
    if [[ $(readlink "$PX/a/link-to-deep" 2>/dev/null) == b/c/d/deep.txt ]]; then
        pass "pack: symlink target kept (a/link-to-deep -> b/c/d/deep.txt)"
    else
        fail "pack: symlink a/link-to-deep -> '$(readlink "$PX/a/link-to-deep" 2>/dev/null)'"
    fi
    pcfg=$(blob "$PK" "$(jq -r .config.digest "$(blob "$PK" "$pmdig")")")
    real=sha256:$(gzip -dc "$pl" | sha256sum | cut -d' ' -f1)
    if [[ $(jq -r '.rootfs.diff_ids[0]' "$pcfg") == "$real" ]]; then pass "pack: config diff_id = sha256 of the uncompressed layer"; else fail "pack: config diff_id $(jq -r '.rootfs.diff_ids[0]' "$pcfg"), uncompressed sha256 $real"; fi

    services_up
    PREF=$REGISTRY/formats:packed
    if push_oci "$PK" packed formats:packed 2>"$E2E_TMP/push.err"; then pass "skopeo push packed -> $PREF"; else fail "skopeo push packed"; show "$E2E_TMP/push.err"; fi
    if ctr_pull packed "$PREF"; then
        imgs=$(ctr_ image ls -q 2>&1 || true)
        if grep -qxF "$PREF" <<<"$imgs"; then pass "ctr image ls lists $PREF"; else fail "ctr image ls does not list $PREF"; fi
        # the layer carries busybox: look at the unpacked files from inside
        PCMD="cd / && busybox sha256sum a/random.bin top.txt a/b/hardlink.txt a/b/numbers.txt a/empty a/b/c/$LONG a/link-to-deep && busybox readlink a/link-to-deep && busybox stat -c %i top.txt a/b/hardlink.txt | busybox uniq | busybox wc -l"
        {
            for p in a/random.bin top.txt a/b/hardlink.txt a/b/numbers.txt a/empty "a/b/c/$LONG" a/link-to-deep; do echo "$(sha "$SRC/$p")  $p"; done
            echo b/c/d/deep.txt
            echo 1
        } >"$E2E_TMP/ctr.want"
        ctr_run "$PREF" "$PCMD"
        if [[ $RC == 0 ]] && cmp -s "$E2E_TMP/ctr.out" "$E2E_TMP/ctr.want"; then
            pass "ctr run packed image: sha256s, symlink target and hardlink inode as in the source tree"
        else
            fail "ctr run packed image: exit $RC, output differs (- want, + got)"
            showdiff "$E2E_TMP/ctr.want" "$E2E_TMP/ctr.out"
        fi
    fi
else
    fail "no packed manifest in $PK/index.json"
fi

# ================================================================ 4. bad input
echo "# 4. bad input"
COR=$E2E_TMP/corrupt
cp -r "$IDX" "$COR"
CIMG=oci:$COR:small
big=$(jq -r '.layers | max_by(.size) | .digest' "$(blob "$COR" "$mdig")")
bb=$(blob "$COR" "$big")
off=$(($(stat -c %s "$bb") / 2))
# flip one byte, then find the tar member whose bytes that changes (first
# uncompressed offset where the corrupted stream differs or stops inflating)
victim=$(python3 - "$bb" "$off" <<'EOF'
import io, sys, tarfile, zlib
path, off = sys.argv[1], int(sys.argv[2])
orig = open(path, "rb").read()
bad = bytearray(orig)
bad[off] ^= 0xFF
open(path, "wb").write(bad)

def inflate(data):
    out = bytearray()
    while data:
        d = zlib.decompressobj(31)
        for i in range(0, len(data), 4096):
            try:
                out += d.decompress(data[i:i + 4096])
            except zlib.error:
                return bytes(out)
            if d.eof:
                break
        if not d.eof:
            return bytes(out)
        data = d.unused_data
    return bytes(out)

u, v = inflate(orig), inflate(bytes(bad))
pos = next((i for i, (a, b) in enumerate(zip(u, v)) if a != b), min(len(u), len(v)))
with tarfile.open(fileobj=io.BytesIO(u)) as t:
    for m in t:
        if m.isreg() and m.offset <= pos < m.offset_data + m.size:
            print("/" + (m.name[2:] if m.name.startswith("./") else m.name))
            break
EOF
) || true
e2e_log "flipped byte $off of layer ${big:7:12}; first affected file: '${victim}'"
if [[ -n $victim && -f $REF$victim ]]; then
    fy "$E2E_TMP/cat.out" "$E2E_TMP/cat.err" cat "$CIMG" "$victim"
    osz=$(stat -c %s "$E2E_TMP/cat.out")
    prefix_ok=0
    cmp -s -n "$osz" "$E2E_TMP/cat.out" "$REF$victim" && prefix_ok=1
    if [[ $RC != 0 && $RC != 124 ]] && grep -qi 'digest mismatch' "$E2E_TMP/cat.err" && ! grep -qi panick "$E2E_TMP/cat.err"; then
        pass "corrupt layer: ferry cat $victim fails (exit $RC): $(grep -i -m1 'digest mismatch' "$E2E_TMP/cat.err" | head -c 200)"
    else
        fail "corrupt layer: ferry cat $victim: exit $RC, want non-zero with 'digest mismatch'"
        show "$E2E_TMP/cat.err"
    fi
    if [[ $(sha "$E2E_TMP/cat.out") != "$(sha "$REF$victim")" && $prefix_ok == 1 ]]; then
        pass "corrupt layer: no wrong bytes on stdout ($osz bytes, a correct prefix of $(stat -c %s "$REF$victim"))"
    else
        fail "corrupt layer: stdout ($osz bytes) is the full original or contains wrong bytes (prefix ok=$prefix_ok)"
    fi
else
    fail "corrupt layer: could not map offset $off of ${big:7:12} to a file in the reference tree ('$victim')"
fi
cat_eq "$CIMG" /app/hello.txt "$REF/app/hello.txt" "corrupt layer: other layer still readable: ferry cat"

TR=$E2E_TMP/truncated
cp -r "$IDX" "$TR"
head -c $(($(stat -c %s "$IDX/index.json") / 2)) "$IDX/index.json" >"$TR/index.json"
for sub in cat inspect; do
    if [[ $sub == cat ]]; then args=(cat "oci:$TR:small" /etc/motd); else args=(inspect "oci:$TR:small"); fi
    fy "$E2E_TMP/tr.out" "$E2E_TMP/tr.err" "${args[@]}"
    if [[ $RC != 0 && $RC != 124 && ! -s $E2E_TMP/tr.out ]] && grep -q 'index.json' "$E2E_TMP/tr.err" && ! grep -qi panick "$E2E_TMP/tr.err"; then
        pass "truncated index.json: ferry $sub fails (exit $RC): $(head -1 "$E2E_TMP/tr.err" | head -c 200)"
    else
        fail "truncated index.json: ferry $sub: exit $RC, stdout $(stat -c %s "$E2E_TMP/tr.out") bytes, want a clear error naming index.json"
        show "$E2E_TMP/tr.err"
    fi
done

# A reader that stops early (`| head`): the printing commands end quietly with success,
# no panic and no error message (SIGPIPE stays ignored for the network code).
for sub in cat inspect; do
    case $sub in
        cat) args=(cat "oci:$IDX:small" /bin/busybox) ;;
        *) args=(inspect "oci:$IDX:small") ;;
    esac
    set +e
    (
        set -o pipefail
        timeout 60 "$FERRY" "${args[@]}" 2>"$E2E_TMP/pipe.err" | head -c 1 >/dev/null
    )
    rc=$?
    set -e
    if [[ $rc == 0 && ! -s $E2E_TMP/pipe.err ]]; then
        pass "ferry $sub | head -c 1: exit 0, nothing on stderr"
    else
        fail "ferry $sub | head -c 1: exit $rc"; show "$E2E_TMP/pipe.err"
    fi
done

e2e_summary
