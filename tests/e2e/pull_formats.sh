#!/usr/bin/env bash
# tests/e2e/pull_formats.sh — `ferry pull` + `ctr run --snapshotter ferry` of the same
# small image in three forms, each compared with containerd's own overlayfs snapshotter
# (needs root and /dev/fuse).
#
#   bash tests/e2e/pull_formats.sh
#
# Setup: the small image (bench/make-image.sh --small, 2 layers) in ferry's registry
# (`ferry registry serve`) in three forms:
#   indexed  a copy indexed by `ferry index` (64 KiB spans, every layer) and pushed with
#            its index artifact by `ferry copy`;
#   estargz  converted by `ctr-remote image optimize --no-optimize --oci` in the private
#            containerd (namespace ferry-e2e-build) and pushed back with `ctr image push`;
#   plain    the image pushed as is (skopeo), no index, not eStargz;
#   zstd-skopeo  zstd:chunked written by `skopeo copy --dest-compress-format
#            zstd:chunked` into a layout (not to the registry: containers/image's blob
#            info cache would hand it the plain form's blobs) and pushed by `ferry copy`;
#   zstd-ferry   zstd:chunked written by `ferry convert --zstd-chunked` straight to the
#            registry.
# `ferry daemon` with the snapshotter, prefetch and background fill off; a private
# containerd with [proxy_plugins.ferry]. Each form is pulled by ferry into a namespace of
# its own and its image removed (`ctr image rm --sync`) before the next form: the plain
# and indexed forms share layer digests, and ferry's snapshotter commits a pulled layer
# under its chain id for every namespace, so a layer left by one form would stand in
# (as "lazy") for the other's. The overlayfs references are pulled by `ctr image pull
# --plain-http` into namespace ferry-e2e-ovl. Every ctr/ferry call runs under `timeout`.
#
# Per form, in the order plain, indexed, estargz, zstd-skopeo, zstd-ferry:
# 1. `ferry pull --plain-http`: its summary says every layer lazy (all but plain) or
#    every layer unpacked (plain).
# 2. `ctr run --rm --snapshotter ferry REF` (the image's default command) prints what
#    the same reference prints on overlayfs ("ready small").
# 3. indexed, estargz: `ferry status --json` on the daemon's control socket lists one
#    mount per layer of this image, each a FUSE mount in mountinfo, and after that start
#    0 < bytes fetched < bytes total, summed over the image's mounts (a start reads part
#    of the image, once).
# 4. A probe of the rootfs (every path: type, mode, owner, size, link count, link
#    target, md5sum of every regular file; small files' contents; the whited-out file)
#    prints the same on ferry as on overlayfs; so do mtimes in seconds, and (plain,
#    indexed) mtimes with nanoseconds. eStargz: its TOC records mtimes rounded to the
#    second, so ferry's must equal overlayfs's (read from the tar headers) rounded (so
#    does `ferry convert`'s zstd:chunked TOC; skopeo's keeps nanoseconds); its
#    metadata files (stargz.index.json, .no.prefetch.landmark), plain files to overlayfs,
#    are the only difference in `ls -A /` (ferry, like stargz-snapshotter, hides them).
#
# Env: FERRY (default target/release/ferry, else target/debug/ferry), FERRY_TIMEOUT
#      (seconds per ferry call, 120), E2E_KEEP=1, E2E_VERBOSE=1 (see lib.sh).
# Output: PASS:/FAIL: lines, last line "N passed, M failed"; exit 1 on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

need_root "private containerd, FUSE"
need_cmd containerd ctr ctr-remote runc skopeo jq curl timeout
[[ -e /dev/fuse ]] || skip "no /dev/fuse"
find_ferry
e2e_init
small_image
require_ferry pull
"$FERRY" daemon --help 2>/dev/null | grep -- '--config' >/dev/null ||
    { fail "ferry binary without \`daemon --config\`: $FERRY"; e2e_summary || exit 1; }

NS_OVL=$CTR_NAMESPACE-ovl
NS_BUILD=$CTR_NAMESPACE-build
FT=${FERRY_TIMEOUT:-120}
LAYERS=$(oci_manifest "$SMALL" small | jq '.layers | length')

# ---------------------------------------------------------------- helpers
# cn NS ARGS...: ctr in namespace NS with a timeout (CT seconds, default 120); output in
# OUT, exit in RC
cn() {
    local ns=$1
    shift
    set +e
    OUT=$(timeout "${CT:-120}" ctr -a "$CONTAINERD_SOCK" -n "$ns" "$@" 2>&1)
    RC=$?
    set -e
}
# cn_ending SUFFIX NS ARGS...: cn for a command whose output ends with SUFFIX. When it
# exits 0 but its output does not end there, ctr's copy of the container's output was
# cut short (it races the container's exit; seen on loaded CI machines: the last two lines
# of a probe missing, and once the whole of an overlayfs run's "ready small", each with
# the container's exit 0); the command is run once more and that is said, so a
# truncation that repeats still fails.
cn_ending() {
    local suffix=$1
    shift
    cn "$@"
    if [[ $RC == 0 && $OUT != *"$suffix" ]]; then
        echo "    | ctr's output was cut short ($(wc -c <<<"$OUT") bytes, exit 0): running it once more"
        cn "$@"
    fi
}
# cn_probe NS ARGS...: cn_ending for the probe, whose output ends with "end"
cn_probe() { cn_ending end "$@"; }
say() { sed 's/^/    | /' <<<"$1" | tail -"${2:-10}"; }
# fpull NS REF: ferry pull REF into namespace NS; output in PULL_OUT, exit in PULL_RC
fpull() {
    set +e
    PULL_OUT=$(timeout "$FT" "$FERRY" pull --address "$CONTAINERD_SOCK" --namespace "$1" \
        --snapshotter ferry --snapshotter-root "$SNAP_ROOT" --plain-http "$2" 2>&1)
    PULL_RC=$?
    set -e
}
# status_json FILE: the daemon's status answer into FILE; sets RC
status_json() { fy "$1" "$E2E_TMP/status.err" status --json --socket "$CTL_SOCK"; }
# is_fuse_mount DIR: DIR is a FUSE mount point in this mount namespace
is_fuse_mount() {
    awk -v m="$1" '$5 == m { for (i = 7; i <= NF; i++) if ($i == "-") { print $(i + 1); break } }' \
        /proc/self/mountinfo | grep '^fuse' >/dev/null
}

# PROBE, run as `sh -c "$PROBE" probe [HIDDEN-PATH...]`: for every path of the rootfs
# (`find / -xdev`, sorted, HIDDEN-PATHs left out): type, mode, owner, size and link
# count (not for directories: their size and link count are the filesystem's own), link
# target, and md5sum of every regular file; then contents of the small files and the
# whited-out file. Mtimes go on lines of their own: "mt PATH SECONDS" and "ns PATH
# YYYY-MM-DD HH:MM:SS.NANOSECONDS +0000" (none for mount points, which the runtime
# sets). It writes nothing, so the tree it lists is the image's.
PROBE='cd /
mps=" $(cut -d" " -f2 /proc/self/mounts | tr "\n" " ")"
find / -xdev | sort | while read -r f; do
  for h in "$@"; do [ "$f" = "$h" ] && continue 2; done
  if [ -d "$f" ] && [ ! -L "$f" ]; then stat -c "%F %a %u:%g - - %n" "$f"
  else stat -c "%F %a %u:%g %s %h %N" "$f"; fi
  [ -f "$f" ] && [ ! -L "$f" ] && md5sum "$f"
  case "$mps" in *" $f "*) ;; *) stat -c "mt %n %Y" "$f"; stat -c "ns %n %y" "$f" ;; esac
done
cat app/start.sh app/hello.txt data/overwritten.txt etc/passwd etc/group etc/motd
ls tmp/remove-me.txt 2>&1
echo end'
# rounded_mtimes: "ns PATH DATE" lines (stdin) as "mt PATH SECONDS", SECONDS the mtime
# rounded to the nearest second (half away from zero), as eStargz TOCs record it
rounded_mtimes() {
    local path date time zone s
    while read -r _ path date time zone; do
        s=$(date -u -d "$date $time $zone" +%s.%N)
        printf 'mt %s %d\n' "$path" "$(python3 -c 'import sys; from decimal import Decimal, ROUND_HALF_UP; print(Decimal(sys.argv[1]).quantize(Decimal(1), rounding=ROUND_HALF_UP))' "$s")"
    done
}
# the eStargz metadata entries ctr-remote writes into each layer: plain files to
# overlayfs, format metadata that ferry (like stargz-snapshotter) does not show
ESGZ_META=(/stargz.index.json /.no.prefetch.landmark /.prefetch.landmark)

# ---------------------------------------------------------------- setup
# the indexed form: a copy of the layout, every layer indexed
IMG=$E2E_TMP/indexed
indexed_small "$IMG"

: >"$E2E_TMP/reg.toml"
start_ferry_registry reg "$E2E_TMP/reg.toml" || e2e_die "ferry registry did not start"
# shellcheck disable=SC2034 # read by push_oci (lib.sh)
REGISTRY=$REG_ADDR
PLAIN_REF=$REG_ADDR/formats/plain:v1
INDEXED_REF=$REG_ADDR/formats/indexed:v1
ESGZ_REF=$REG_ADDR/formats/estargz:v1
SRC_REF=$REG_ADDR/formats/source:v1
ZSK_REF=$REG_ADDR/formats/zstd-skopeo:v1
ZFY_REF=$REG_ADDR/formats/zstd-ferry:v1

push_oci "$SMALL" small formats/plain:v1 || e2e_die "skopeo push of the plain image failed"
fy "$E2E_TMP/copy.out" "$E2E_TMP/copy.err" copy --plain-http "oci:$IMG:small" "$INDEXED_REF"
[[ $RC == 0 ]] || { show "$E2E_TMP/copy.err"; e2e_die "ferry copy of the indexed image failed (exit $RC)"; }

# the zstd:chunked forms: skopeo's (through a layout) and ferry's
set +e
timeout 300 skopeo copy -q --dest-compress-format zstd:chunked "oci:$SMALL:small" \
    "oci:$E2E_TMP/zstd-skopeo:v1" >"$E2E_TMP/skopeo-zstd.log" 2>&1
rc=$?
set -e
[[ $rc == 0 ]] || { show "$E2E_TMP/skopeo-zstd.log"; e2e_die "skopeo copy --dest-compress-format zstd:chunked failed (exit $rc)"; }
fy "$E2E_TMP/copy-zsk.out" "$E2E_TMP/copy-zsk.err" copy --plain-http "oci:$E2E_TMP/zstd-skopeo:v1" "$ZSK_REF"
[[ $RC == 0 ]] || { show "$E2E_TMP/copy-zsk.err"; e2e_die "ferry copy of skopeo's zstd:chunked image failed (exit $RC)"; }
fy "$E2E_TMP/convert-zfy.out" "$E2E_TMP/convert-zfy.err" convert --zstd-chunked --plain-http "oci:$SMALL:small" "$ZFY_REF"
[[ $RC == 0 ]] || { show "$E2E_TMP/convert-zfy.err"; e2e_die "ferry convert --zstd-chunked failed (exit $RC)"; }
for form in zstd-skopeo zstd-ferry; do
    nz=$(curl -fsS --noproxy '*' -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
        "http://$REG_ADDR/v2/formats/$form/manifests/v1" |
        jq '[.layers[] | select(.mediaType == "application/vnd.oci.image.layer.v1.tar+zstd") | select((.annotations["io.github.containers.zstd-chunked.manifest-checksum"] // .annotations["io.containers.zstd-chunked.manifest-checksum"] // "") | startswith("sha256:"))] | length')
    if [[ $nz == "$LAYERS" ]]; then
        pass "setup: $form: every one of the $LAYERS layers is zstd with a zstd:chunked manifest checksum"
    else
        fail "setup: $form: zstd:chunked manifest checksum on ${nz:-?} of $LAYERS layers"
    fi
done

lazy_snapshotter_daemon # CTL_SOCK, DAEMON_CONFIG, SNAP_SOCK (lib.sh)
start_containerd_with_snapshotter ferry "$SNAP_SOCK"

# the eStargz form: ctr-remote converts the plain image inside our containerd
push_oci "$SMALL" small formats/source:v1 || e2e_die "skopeo push of the source image failed"
for step in "image pull --plain-http $SRC_REF" \
    "image optimize --no-optimize --oci $SRC_REF $ESGZ_REF"; do
    set +e
    # shellcheck disable=SC2086 # the step is a word list
    timeout 300 ctr-remote -a "$CONTAINERD_SOCK" -n "$NS_BUILD" $step >"$E2E_TMP/ctr-remote.log" 2>&1
    rc=$?
    set -e
    [[ $rc == 0 ]] || { show "$E2E_TMP/ctr-remote.log"; e2e_die "ctr-remote $step failed (exit $rc)"; }
done
CT=300 cn "$NS_BUILD" image push --plain-http "$ESGZ_REF"
[[ $RC == 0 ]] || { say "$OUT"; e2e_die "ctr image push of the eStargz image failed (exit $RC)"; }
ntoc=$(curl -fsS --noproxy '*' -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
    "http://$REG_ADDR/v2/formats/estargz/manifests/v1" |
    jq '[.layers[] | select(.annotations["containerd.io/snapshot/stargz/toc.digest"] // "" | startswith("sha256:"))] | length')
if [[ $ntoc == "$LAYERS" ]]; then
    pass "setup: ctr-remote's eStargz image has a toc.digest on all $LAYERS layers"
else
    fail "setup: ctr-remote's eStargz image: toc.digest on ${ntoc:-?} of $LAYERS layers"
fi

# ---------------------------------------------------------------- per form
# check_form NAME REF LAZY(yes|no) [HIDDEN-PATH...]: the checks above for one form;
# HIDDEN-PATHs are left out of both probes (and must be the only difference at /)
check_form() {
    local name=$1 ref=$2 lazy=$3 ns=$CTR_NAMESPACE-$1 t0 ovl_default ovl_probe ovl_root
    shift 3
    echo "# $name: $ref"

    # 1. ferry pull
    t0=$SECONDS
    fpull "$ns" "$ref"
    local want="$LAYERS layers (0 lazy, $LAYERS unpacked, 0 already present)"
    [[ $lazy == yes ]] && want="$LAYERS layers ($LAYERS lazy, 0 unpacked, 0 already present)"
    if [[ $PULL_RC == 0 && $PULL_OUT == *"$want"* ]]; then
        pass "$name: ferry pull: $(tail -1 <<<"$PULL_OUT") ($((SECONDS - t0))s)"
    else
        fail "$name: ferry pull: exit $PULL_RC, want '$want'"; say "$PULL_OUT"
        return 0
    fi

    # the reference: the same REF on overlayfs
    CT=300 cn "$NS_OVL" image pull --plain-http "$ref"
    [[ $RC == 0 ]] || { fail "$name: ctr image pull --plain-http (overlayfs): exit $RC"; say "$OUT"; return 0; }
    cn_ending small "$NS_OVL" run --rm --snapshotter overlayfs "$ref" "ovl-$name-$$"
    [[ $RC == 0 ]] || { fail "$name: overlayfs run: exit $RC"; say "$OUT"; return 0; }
    ovl_default=$OUT
    cn_probe "$NS_OVL" run --rm --snapshotter overlayfs "$ref" "ovl-probe-$name-$$" sh -c "$PROBE" probe "$@"
    [[ $RC == 0 && $OUT == *end ]] || { fail "$name: overlayfs probe: exit $RC"; say "$OUT"; return 0; }
    ovl_probe=$OUT
    cn_ending tmp "$NS_OVL" run --rm --snapshotter overlayfs "$ref" "ovl-root-$name-$$" ls -A /
    ovl_root=$OUT

    # 2. the default command
    cn_ending small "$ns" run --rm --snapshotter ferry "$ref" "ferry-$name-$$"
    if [[ $RC == 0 && $OUT == "$ovl_default" ]]; then
        pass "$name: ctr run --snapshotter ferry prints what overlayfs prints: '$OUT'"
    else
        fail "$name: ctr run --snapshotter ferry: exit $RC, output differs from overlayfs ('$ovl_default')"; say "$OUT"
    fi

    # 3. lazy: FUSE mounts, part of the image fetched
    if [[ $lazy == yes ]]; then
        local st=$E2E_TMP/status-$name.json mounts n nfuse=0 fetched total mp
        status_json "$st"
        if [[ $RC != 0 ]]; then
            fail "$name: ferry status --json: exit $RC"; show "$E2E_TMP/status.err"
        else
            # this image's mounts: those whose image names this form's repository
            mounts=$(jq -c --arg r "${ref%:*}" '[.mounts[] | select(.image | startswith($r))]' "$st")
            n=$(jq length <<<"$mounts")
            for mp in $(jq -r '.[].mountpoint' <<<"$mounts"); do
                is_fuse_mount "$mp" && nfuse=$((nfuse + 1))
            done
            fetched=$(jq '[.[].stats.bytes_fetched] | add // 0' <<<"$mounts")
            total=$(jq '[.[].stats.bytes_total] | add // 0' <<<"$mounts")
            if [[ $n == "$LAYERS" && $nfuse == "$n" ]]; then
                pass "$name: ferry status lists $n mounts for the image, each a FUSE mount"
            else
                fail "$name: ferry status lists $n mounts for ${ref%:*} ($nfuse FUSE in mountinfo), want $LAYERS"
                jq -c '.mounts[] | {mountpoint, image, layer}' "$st" | sed 's/^/    | /' | head -8
            fi
            if ((n > 0 && fetched > 0 && fetched < total)); then
                pass "$name: after a start, bytes fetched $fetched of $total (lazy: only what the start read)"
            else
                fail "$name: bytes fetched $fetched of $total (want 0 < fetched < total)"
            fi
        fi
    fi

    # 4. the probe: the tree; mtimes in seconds; mtimes with nanoseconds
    cn_probe "$ns" run --rm --snapshotter ferry "$ref" "ferry-probe-$name-$$" sh -c "$PROBE" probe "$@"
    local tree ovl_tree mt want_mt nsl ovl_nsl how
    tree=$(grep -v '^mt \|^ns ' <<<"$OUT" || true)
    ovl_tree=$(grep -v '^mt \|^ns ' <<<"$ovl_probe" || true)
    mt=$(grep '^mt ' <<<"$OUT" || true)
    nsl=$(grep '^ns ' <<<"$OUT" || true)
    ovl_nsl=$(grep '^ns ' <<<"$ovl_probe" || true)
    if [[ $RC == 0 && $tree == "$ovl_tree" && $tree == *end ]]; then
        pass "$name: probe on ferry == on overlayfs ($(grep -c '^[a-z]' <<<"$tree") paths with type, mode, owner, size, links, target; md5sum of $(grep -c '^[0-9a-f]\{32\}  /' <<<"$tree") files; contents)"
    else
        fail "$name: probe on ferry differs from overlayfs (exit $RC); diff overlayfs ferry:"
        diff <(echo "$ovl_tree") <(echo "$tree") | sed 's/^/    | /' | head -20 || true
    fi
    if [[ $name == estargz || $name == zstd-ferry ]]; then
        # the TOC records mtimes rounded to the second; overlayfs unpacks the tar headers
        want_mt=$(rounded_mtimes <<<"$ovl_nsl")
        how="overlayfs's rounded to the second, as the TOC records them"
    else
        want_mt=$(grep '^mt ' <<<"$ovl_probe" || true)
        how="overlayfs's"
    fi
    if [[ $RC == 0 && -n $mt && $mt == "$want_mt" ]]; then
        pass "$name: mtimes (seconds) of $(wc -l <<<"$mt") paths on ferry == $how"
    else
        fail "$name: mtimes (seconds) on ferry != $how; diff want ferry:"
        diff <(echo "$want_mt") <(echo "$mt") | sed 's/^/    | /' | head -8 || true
    fi
    if [[ $name != estargz && $name != zstd-ferry ]]; then
        if [[ $RC == 0 && -n $nsl && $nsl == "$ovl_nsl" ]]; then
            pass "$name: mtimes with nanoseconds on ferry == on overlayfs ($(wc -l <<<"$nsl") paths)"
        else
            fail "$name: mtimes with nanoseconds differ from overlayfs on $(diff <(echo "$ovl_nsl") <(echo "$nsl") | grep -c '^>') of $(wc -l <<<"$ovl_nsl") paths; diff overlayfs ferry:"
            diff <(echo "$ovl_nsl") <(echo "$nsl") | sed 's/^/    | /' | head -6 || true
        fi
    fi
    if (($# > 0)); then
        local h want_root=$ovl_root
        for h in "$@"; do want_root=$(grep -v -x -F "${h#/}" <<<"$want_root" || true); done
        cn_ending tmp "$ns" run --rm --snapshotter ferry "$ref" "ferry-root-$name-$$" ls -A /
        if [[ $RC == 0 && $OUT == "$want_root" && $OUT != "$ovl_root" ]]; then
            pass "$name: / on ferry == / on overlayfs without the format's metadata files ($(tr '\n' ' ' <<<"$(comm -23 <(sort <<<"$ovl_root") <(sort <<<"$OUT"))"), which overlayfs shows)"
        else
            fail "$name: / on ferry is not / on overlayfs minus $*: exit $RC"
            diff <(echo "$ovl_root") <(echo "$OUT") | sed 's/^/    | /' | head -10 || true
        fi
    fi

    # done with this form: remove the image, so its snapshots (shared by name across
    # namespaces) cannot stand in for the next form's layers
    CT=60 cn "$ns" image rm --sync "$ref"
    [[ $RC == 0 ]] || e2e_log "warning: ctr image rm --sync $ref: $OUT"
}

check_form plain "$PLAIN_REF" no
check_form indexed "$INDEXED_REF" yes
check_form estargz "$ESGZ_REF" yes "${ESGZ_META[@]}"
check_form zstd-skopeo "$ZSK_REF" yes
check_form zstd-ferry "$ZFY_REF" yes

e2e_summary
