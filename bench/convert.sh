#!/usr/bin/env bash
# `ferry convert --estargz` versus Debian's `ctr-remote image optimize --no-optimize`, and
# `ferry convert --zstd-chunked` versus `skopeo copy --dest-compress-format zstd:chunked`, on
# the same image, in one run. ctr-remote converts inside containerd's content store
# (the image is pulled there first, untimed); ferry converts OCI layout to OCI layout.
# Usage: bash bench/convert.sh   (root: starts a private containerd and registry)
source "$(dirname "$0")/lib.sh"
ensure_ferry; ensure_image
source tests/e2e/lib.sh
need_root "private containerd"
e2e_init
start_containerd
start_registry
push_oci "$IMG" "$TAG" bench:src
ctr_remote image pull --plain-http "$REGISTRY/bench:src" > /dev/null
layer_blobs "$IMG" "$TAG" | xargs cat > /dev/null   # warm the page cache for ferry too

t=$(now); ctr_remote image optimize --no-optimize --oci "$REGISTRY/bench:src" "$REGISTRY/bench:esgz" > "$E2E_TMP/ctr-remote.log" 2>&1; peer=$(since "$t")
clone_layout "$IMG" "$E2E_TMP/img"
t=$(now); "$FERRY" convert --estargz "oci:$E2E_TMP/img:$TAG" "oci:$E2E_TMP/img:esgz"; ours=$(since "$t")
printf '%-44s %8s s\n' "ctr-remote image optimize --no-optimize" "$peer" "ferry convert --estargz" "$ours"
echo "speedup: $(ratio "$peer" "$ours")x"

# zstd:chunked: skopeo (containers/image's compressor, what podman and buildah use)
# versus `ferry convert --zstd-chunked`, each OCI layout to OCI layout from the same
# warm source, with each tool's default level.
layers_bytes() { oci_manifest "$1" "$2" | jq '[.layers[].size] | add'; }
t=$(now); skopeo copy -q --dest-compress-format zstd:chunked "oci:$IMG:$TAG" "oci:$E2E_TMP/skopeo-zc:zc"; zpeer=$(since "$t")
t=$(now); "$FERRY" convert --zstd-chunked "oci:$E2E_TMP/img:$TAG" "oci:$E2E_TMP/img:zc"; zours=$(since "$t")
printf '%-44s %8s s  %12s B\n' \
    "skopeo copy --dest-compress-format zstd:chunked" "$zpeer" "$(layers_bytes "$E2E_TMP/skopeo-zc" zc)" \
    "ferry convert --zstd-chunked" "$zours" "$(layers_bytes "$E2E_TMP/img" zc)"
echo "zstd:chunked speedup: $(ratio "$zpeer" "$zours")x"
