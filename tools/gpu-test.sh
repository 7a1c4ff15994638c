#!/usr/bin/env bash
# Build the GPU test suite on a build machine, run it on a GPU machine.
#
#   tools/gpu-test.sh [build]   On the build machine (CUDA toolkit, libuv, protobuf-c, cmocka
#                               installed; no GPU needed): configures build-gpu/ with libuv
#                               and protobuf-c linked statically, builds gpupoold, the GPU
#                               tests, the benchmark, gpupoolctl and libgpupool-client.so
#                               (GPU_BUILD_TARGETS="..." or "all" to choose), and copies the
#                               cmocka and protobuf-c shared libraries into build-gpu/lib/.
#                               Then carry the repository, build-gpu/ included, to the GPU
#                               machine (any path).
#   tools/gpu-test.sh run       On the GPU machine, from the copied repository (any path):
#                               runs the tests labelled gpu with ctest
#                               (LD_LIBRARY_PATH=build-gpu/lib) and
#                               writes the log to $OUT/gpu-test.log when $OUT is set.
#                               GPU_TEST_ARGS="-R replicas" passes more arguments to ctest.
#
# ctest files hold the absolute source and build paths of the build machine. When the tree
# now lives elsewhere, run mode rewrites those paths in build-gpu/**/CTestTestfile.cmake to
# the current location first (nothing else depends on them: the C test binaries find
# themselves through /proc/self/exe and get gpupoold's path as an argument).
#
# Exit status: ctest's (0 when every gpu test passed or was skipped).
set -euo pipefail

cd "$(dirname "$0")/.."
root=$PWD
build="build-gpu"

die() { echo "gpu-test.sh: $*" >&2; exit 1; }

# What the GPU machine runs: the daemon, the GPU tests, the benchmarks, gpupoolctl, the demo
# programs and the shared client library (for the Python tests; it links the shared
# protobuf-c, copied into build-gpu/lib below). GPU_BUILD_TARGETS=all builds the whole tree.
targets=${GPU_BUILD_TARGETS:-gpupoold gpupool_gpu_test gpupool_gpu_pinned gpupool_gpu_imports gpupool_gpu_files gpupool_gpu_copy gpupool_gpu_replicas gpupool_gpu_peers gpupool_gpu_survive gpupool_survive_bench gpupool_bench gpupool_copy_bench gpupool_replica_bench gpupool_pinned_bench gpupool_host_bench gpupoolctl gpupool-client gpupool-torch-alloc gpupool-producer gpupool-consumer}

build_tree() {
  cmake -S . -B "$build" -DGPUPOOL_STATIC_DEPS=ON -DGPUPOOL_CUDA=ON -DGPUPOOL_PYTHON_GPU=python3 \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo
  # gpupool.torch's C extension (an abi3 module: the GPU machine's Python of another minor
  # version loads it too), where this machine has Python's headers to build it.
  if [ -z "${GPU_BUILD_TARGETS:-}" ] && cmake --build "$build" --target help | grep -qw 'gpupool-fast'; then
    targets="$targets gpupool-fast"
  fi
  # shellcheck disable=SC2086 # one word per target
  cmake --build "$build" -j2 --target $targets
  mkdir -p "$build/lib"
  local found=0
  for f in /usr/lib/x86_64-linux-gnu/libcmocka.so.0* /usr/lib/x86_64-linux-gnu/libprotobuf-c.so.1*; do
    [ -e "$f" ] || continue
    cp -a "$f" "$build/lib/"
    case "$f" in *cmocka*) found=1 ;; esac
  done
  [ "$found" = 1 ] || die "no /usr/lib/x86_64-linux-gnu/libcmocka.so.0* to copy (install libcmocka-dev)"
  echo "gpu-test.sh: built $root/$build; copy the repository with it to the GPU machine and" \
       "run tools/gpu-test.sh run there"
}

# Point the ctest files at this location if the tree was built somewhere else. Both the old
# build path and the old source path are rewritten (through placeholders, so a new path that
# contains an old one is not rewritten twice).
relocate() {
  [ -f "$build/CMakeCache.txt" ] || die "$build/CMakeCache.txt missing: run tools/gpu-test.sh build first"
  local obuild osrc
  obuild=$(sed -n 's/^CMAKE_CACHEFILE_DIR:INTERNAL=//p' "$build/CMakeCache.txt")
  osrc=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt")
  if [ -z "$obuild" ] || [ -z "$osrc" ]; then
    die "cannot read the original paths from $build/CMakeCache.txt"
  fi
  if [ "$obuild" != "$root/$build" ] || [ "$osrc" != "$root" ]; then
    echo "gpu-test.sh: tree was built at $osrc; rewriting ctest paths to $root"
    find "$build" -name CTestTestfile.cmake -print0 |
      xargs -0 sed -i -e "s#${obuild}#@GPUPOOL_BUILD@#g" -e "s#${osrc}#@GPUPOOL_SRC@#g" \
                      -e "s#@GPUPOOL_BUILD@#${root}/${build}#g" -e "s#@GPUPOOL_SRC@#${root}#g"
  fi
}

run_tests() {
  relocate
  local log rc
  log=$(mktemp)
  set +e
  LD_LIBRARY_PATH="$root/$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    ctest --test-dir "$build" -L gpu --output-on-failure ${GPU_TEST_ARGS:-} 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$log" "$OUT/gpu-test.log"
  fi
  rm -f "$log"
  return "$rc"
}

case "${1:-build}" in
  build) build_tree ;;
  run) run_tests ;;
  -h|--help) sed -n '2,20p' "$0" ;;
  *) die "unknown mode '$1' (build or run)" ;;
esac
