#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages gpupool needs to build and test, if any are missing.
# Used by tools/demo.sh and tools/test.sh; safe to run again (does nothing when all are there).
set -euo pipefail

PKGS=(build-essential cmake ninja-build pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler
      libcmocka-dev python3 python3-numpy python3-venv python3-pip systemd
      debootstrap systemd-container)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "gpupool: installing missing packages: ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "gpupool: need root (or sudo) to install: ${missing[*]}" >&2; exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
