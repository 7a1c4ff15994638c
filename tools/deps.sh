#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages gpupool needs to build and test, if any are missing.
# Used by tools/demo.sh and tools/test.sh; safe to run again (does nothing when all are there).
set -euo pipefail

PKGS=(build-essential cmake ninja-build pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler
      libcmocka-dev python3 python3-dev python3-numpy python3-venv python3-pip systemd clang groff-base
      debootstrap systemd-container ca-certificates)

# Peers (daemon-to-daemon fetches, daemon/peers/): UCX, found by pkg-config; without it the
# daemon builds without peers and says so.
PKGS+=(libucx-dev ucx-utils)

# python3-dev: Python's headers, for gpupool._fast (python/ext), the C part of gpupool.torch;
# without them the Python package runs its pure-Python path.

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

# The peer tests (tests/remote): network namespaces (ip netns, tc) and a round trip to check them.
PKGS+=(iproute2 iputils-ping)

# libFuzzer and the sanitizer runtimes of clang N (the fuzz targets, tools/fuzz.sh) come in
# libclang-rt-N-dev on Debian 12 and newer Ubuntu, in libclang-common-N-dev on older ones.
fuzzer_runtime_pkg() {
  local ver
  command -v clang >/dev/null || return 0
  [ "$(clang -print-file-name=libclang_rt.fuzzer-$(uname -m).a)" = "libclang_rt.fuzzer-$(uname -m).a" ] || return 0
  ver=$(clang -dumpversion | cut -d. -f1)
  if apt-cache show "libclang-rt-$ver-dev" >/dev/null 2>&1; then
    echo "libclang-rt-$ver-dev"
  else
    echo "libclang-common-$ver-dev"
  fi
}

SUDO=""
need_root() {
  if [ "$(id -u)" -ne 0 ] && [ -z "$SUDO" ]; then
    if command -v sudo >/dev/null; then SUDO="sudo"; else
      echo "gpupool: need root (or sudo) to install: $*" >&2; exit 1
    fi
  fi
}
export DEBIAN_FRONTEND=noninteractive

missing=()
for p in "${PKGS[@]}"; do
  installed "$p" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpupool: installing missing packages: ${missing[*]}"
  need_root "${missing[@]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
rt=$(fuzzer_runtime_pkg)
if [ -n "$rt" ]; then
  echo "gpupool: installing libFuzzer for clang: $rt"
  need_root "$rt"
  [ ${#missing[@]} -gt 0 ] || $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "$rt"
fi
