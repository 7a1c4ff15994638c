#!/usr/bin/env bash
# The gpupool.torch tests (python/tests/torch: CPU tensors on the host backend) under a torch
# of their own: PyPI's torch in a venv made here on first use and kept for later runs, since
# CI images have no torch and only PyPI is reachable (PyPI's torch wheel pulls its CUDA wheels,
# about 3 GB; the tests need no GPU). Exits 77 (ctest's "skipped") saying why when the venv
# cannot be made.
#
#   tests/python/torch_tests.sh              # prepare when needed, then run the tests
#   tests/python/torch_tests.sh --prepare    # only make the venv (tools/test.sh does, once)
#   tests/python/torch_tests.sh --data       # the PinnedLoader tests (python/tests/torchdata)
#   tests/python/torch_tests.sh --dtensor    # sharded versions from DTensors (python/tests/dtensor)
#
# GPUPOOL_TORCH_VENV: where the venv lives (default: /var/cache/gpupool/torch-venv for root,
# where the test that runs a receiver as another uid can read it; else
# ~/.cache/gpupool/torch-venv). GPUPOOL_TORCH_VERSION: the torch to install (2.11.0).
# GPUPOOL_TORCH_PYTHON: an interpreter that has torch already (then no venv is made).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
ver=${GPUPOOL_TORCH_VERSION:-2.11.0}
if [ "$(id -u)" -eq 0 ]; then
  venv=${GPUPOOL_TORCH_VENV:-/var/cache/gpupool/torch-venv}
else
  venv=${GPUPOOL_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gpupool/torch-venv}
fi

skip() { echo "SKIP: gpupool.torch tests not run: $*"; exit 77; }

has_torch() { "$1" -c "import sys, torch, numpy; sys.exit(0 if torch.__version__.split('+')[0] == '$ver' else 1)" 2>/dev/null; }

prepare() {
  has_torch "$venv/bin/python" && return 0
  mkdir -p "$(dirname "$venv")" || skip "cannot create $(dirname "$venv")"
  chmod 755 "$(dirname "$venv")" 2>/dev/null
  (
    flock 9 # one install at a time (ctest -j, two builds)
    has_torch "$venv/bin/python" && exit 0
    echo "gpupool: installing torch==$ver from PyPI into $venv (once; about 3 GB with its CUDA wheels)"
    rm -rf "$venv"
    python3 -m venv "$venv" || exit 2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$ver" numpy || exit 3
    has_torch "$venv/bin/python" || exit 4
  ) 9>"$venv.lock"
  case $? in
    0) return 0 ;;
    2) skip "python3 -m venv failed (python3-venv is in tools/deps.sh)" ;;
    3) skip "pip could not install torch==$ver from PyPI into $venv (no network, or no wheel for this Python)" ;;
    *) skip "torch==$ver installed into $venv does not import" ;;
  esac
}

if [ -n "${GPUPOOL_TORCH_PYTHON:-}" ]; then
  py=$GPUPOOL_TORCH_PYTHON
  "$py" -c "import torch" 2>/dev/null || skip "GPUPOOL_TORCH_PYTHON=$py cannot import torch"
else
  prepare
  py=$venv/bin/python
fi
[ "${1:-}" = "--prepare" ] && exit 0
[ -n "${GPUPOOLD:-}" ] || skip "GPUPOOLD is not set (ctest sets it)"
[ "${1:-}" = "--data" ] && exec "$py" "$src/python/tests/torchdata/run.py"
[ "${1:-}" = "--dtensor" ] && exec "$py" "$src/python/tests/dtensor/run.py"
# --pure: the tests again on the pure-Python path (ctest python_torch_pure sets GPUPOOL_PURE_PYTHON=1).
[ "${1:-}" = "--pure" ] && [ "${GPUPOOL_PURE_PYTHON:-}" != 1 ] && { echo "--pure needs GPUPOOL_PURE_PYTHON=1"; exit 2; }
cd "$src/python/tests/torch" && exec "$py" -m unittest discover -s . -v
