#!/usr/bin/env bash
# Checks of gpupool as it is installed and run, on top of a finished build (tools/test.sh
# runs this after the ctest suite of build/release):
#   - tests/install/run.sh: Release builds with and without CUDA, `cmake --install --prefix`
#     confined to the prefix and relocatable, an out-of-tree consumer through
#     find_package(gpupool) and pkg-config, shared and static;
#   - tests/install/pip.sh: `pip install ./python` in a fresh venv is all Python needs;
#   - tests/system/nspawn.sh: the units under a real systemd in a booted Debian 12 container.
# A check that cannot run here exits 77 and is reported as skipped, with its reason.
#
#   tools/service-test.sh [BUILD_DIR]      (default build/release)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
skipped=()
check() {
  local name=$1 rc t0=$SECONDS
  shift
  echo "==== gpupool: $name"
  set +e
  "$@"
  rc=$?
  set -e
  case $rc in
    0) echo "==== gpupool: $name passed ($((SECONDS - t0)) s)" ;;
    77) echo "==== gpupool: $name SKIPPED"; skipped+=("$name") ;;
    *) echo "==== gpupool: $name FAILED (exit $rc)" >&2; exit 1 ;;
  esac
}
check "install and consumers" tests/install/run.sh build/install-test
check "pip install ./python" tests/install/pip.sh "$build/daemon/gpupoold" build/pip-test
check "systemd in a booted container" tests/system/nspawn.sh "$build"
if [ ${#skipped[@]} -gt 0 ]; then echo "==== gpupool: skipped here: ${skipped[*]}"; fi
