#!/usr/bin/env bash
# The test command: installs what is missing, builds gpupool twice (a normal build and one
# with AddressSanitizer + UndefinedBehaviorSanitizer) and runs every test with ctest in both;
# after the normal build, the install, packaging and systemd checks (tools/service-test.sh).
# GPU tests (label gpu) skip themselves without a GPU; run tools/gpu-test.sh on a GPU machine.
#
#   tools/test.sh            # both builds
#   GPUPOOL_TEST_SANITIZE=0 tools/test.sh   # the normal build only
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh
jobs=$(nproc 2>/dev/null || echo 2)

run_suite() {
  local dir=$1; shift
  echo "==== gpupool: building $dir ($*)"
  cmake -S . -B "$dir" -G Ninja "$@" >"$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; exit 1; }
  cmake --build "$dir" -j"$jobs"
  echo "==== gpupool: testing $dir"
  (cd "$dir" && ctest --output-on-failure -j"$jobs" --timeout 600)
}

mkdir -p build
# Python tests: python_host needs only python3-numpy; python_torch needs torch, which CI
# images lack and PyPI has: its venv is made here once (cached for later runs) so that both
# builds' tests use it. Without it they skip, saying why.
tests/python/torch_tests.sh --prepare || echo "gpupool: no torch venv; the python_torch tests will skip"
run_suite build/release -DCMAKE_BUILD_TYPE=RelWithDebInfo
tools/service-test.sh build/release
if [ "${GPUPOOL_TEST_SANITIZE:-1}" != 0 ]; then
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    run_suite build/sanitize -DCMAKE_BUILD_TYPE=Debug -DGPUPOOL_SANITIZE=ON
fi
[ "${GPUPOOL_TEST_FUZZ:-1}" = 0 ] || tools/fuzz.sh # each fuzz target for a bounded time; GPUPOOL_TEST_FUZZ=0 skips
echo "==== gpupool: all tests passed"
