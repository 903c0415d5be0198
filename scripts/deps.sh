#!/usr/bin/env bash
# Installs the Debian packages ferry's tests and benchmarks use (idempotent; needs root).
set -euo pipefail
PKGS=(containerd runc docker-registry skopeo podman stargz-snapshotter fuse3 protobuf-compiler
      pigz zstd jq wrk hyperfine debootstrap iproute2 ca-certificates apache2-utils
      python3-grpcio python3-protobuf gnuplot-nox gcc libc6-dev
      curl gpgv debian-archive-keyring xz-utils)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# containerd 2.x beside the system's 1.6, verified from Debian unstable's signed index,
# for the e2e tests that run on both (tests/e2e/lib.sh containerd_flavours)
bash "$(dirname "$0")/containerd2.sh"
