#!/usr/bin/env bash
# GPU check of peers with device memory (tests/gpu/gpu_peers.c: two gpupoolds on this machine,
# device pools on both sides, a buffer and a bundle fetched over UCX on 127.0.0.1, bit-exact,
# throughput printed), under each UCX this machine offers:
#   1. the UCX gpupoold finds (LD_LIBRARY_PATH as given, else the system's), UCX_TLS=tcp;
#   2. the same with UCX_TLS=tcp,cuda_copy when that UCX lists cuda_copy;
#   3. a UCX carried next to the build in BUILD/lib/ucx113 (Debian 12's libucx0 1.13: the
#      libraries, libnuma, the cma module and ucx_info), UCX_TLS=tcp, when present.
#   4. the UCX of the libucx-cu13 wheel carried in BUILD/lib/ucxwheel (its libucx/lib with
#      libucp, libuct, libucs, libucm, the cuda, cma modules and ucx_info, and
#      libucx_cu13.libs beside it, as the wheel lays them out), UCX_TLS=tcp,cuda_copy, when
#      present: gpupoold then runs against UCX 1.22 with CUDA support (it still stages).
# Runs 1 and 3 are each followed by the same fetches between host pools (GPUPOOL_PEERS_HOST=1:
# host backend, no staging), the reference for their throughput.
# First it prints what UCX is here (ucx_info -v, its transports and memory types, ldconfig).
#
#   tests/remote/gpu_peers.sh [BUILD]     BUILD defaults to build-gpu; run from the repository
#
# Each run is bounded by GPU_PEERS_TIMEOUT seconds (70). Exit status: 0 when every run that
# could start passed, 1 otherwise.
set -u
cd "$(dirname "$0")/../.." || exit 1
build=${1:-build-gpu}
limit=${GPU_PEERS_TIMEOUT:-70}
daemon=$build/daemon/gpupoold
check=$build/tests/gpu/gpupool_gpu_peers
carried=$PWD/$build/lib/ucx113
rc=0

echo "== UCX here ($(date -u +%H:%M:%S))"
if command -v ucx_info >/dev/null; then
  timeout 10 ucx_info -v 2>&1 | head -5
  timeout 20 ucx_info -d 2>&1 | grep -i -E "transport|memory" | sort | uniq -c
else
  echo "no ucx_info on PATH"
fi
ldconfig -p | grep -E "libuc[pts]\." || echo "ldconfig knows no libucp/libuct/libucs"
echo "== gpupoold's libraries"
ldd "$daemon" | grep -E "uc[pmst]|numa|not found"

run() {
  local what=$1; shift
  echo "== $what ($(date -u +%H:%M:%S))"
  env "$@" timeout -k 5 "$limit" "$check" "$daemon"
  local r=$?
  echo "== $what: exit $r"
  case $r in 0|77) ;; *) rc=1 ;; esac
}

if ldd "$daemon" | grep -q "libucp.so.0 => not found"; then
  echo "== no libucp.so.0 for gpupoold here: runs 1 and 2 skipped"
else
  tls=$(timeout 20 ucx_info -d 2>/dev/null | grep -i "transport: cuda_copy" | head -1)
  run "run 1: UCX as found, UCX_TLS=tcp" UCX_TLS=tcp UCX_NET_DEVICES=lo
  run "run 1 reference: host pools, UCX as found, UCX_TLS=tcp" GPUPOOL_PEERS_HOST=1 UCX_TLS=tcp UCX_NET_DEVICES=lo
  if [ -n "$tls" ]; then
    run "run 2: UCX as found, UCX_TLS=tcp,cuda_copy" UCX_TLS=tcp,cuda_copy UCX_NET_DEVICES=lo
  else
    echo "== run 2 skipped: ucx_info lists no cuda_copy here"
  fi
fi
if [ -f "$carried/libucp.so.0" ]; then
  echo "== carried UCX: $(LD_LIBRARY_PATH=$carried${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$carried/ucx_info" -v 2>&1 | head -1)"
  run "run 3: carried UCX ($carried), UCX_TLS=tcp" \
    LD_LIBRARY_PATH="$carried${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" UCX_MODULE_DIR="$carried/ucx" \
    UCX_TLS=tcp UCX_NET_DEVICES=lo
  run "run 3 reference: host pools, carried UCX, UCX_TLS=tcp" GPUPOOL_PEERS_HOST=1 \
    LD_LIBRARY_PATH="$carried${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" UCX_MODULE_DIR="$carried/ucx" \
    UCX_TLS=tcp UCX_NET_DEVICES=lo
fi
wheel=$PWD/$build/lib/ucxwheel
if [ -f "$wheel/libucx/lib/libucp.so.0" ]; then
  wl="$wheel/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "== wheel UCX: $(LD_LIBRARY_PATH=$wl UCX_MODULE_DIR=$wheel/libucx/lib/ucx "$wheel/libucx/bin/ucx_info" -v 2>&1 | head -1)"
  LD_LIBRARY_PATH=$wl UCX_MODULE_DIR=$wheel/libucx/lib/ucx timeout 20 "$wheel/libucx/bin/ucx_info" -d 2>&1 |
    grep -i -E "transport|memory" | sort | uniq -c
  run "run 4: wheel UCX ($wheel), UCX_TLS=tcp,cuda_copy" LD_LIBRARY_PATH="$wl" \
    UCX_MODULE_DIR="$wheel/libucx/lib/ucx" UCX_TLS=tcp,cuda_copy UCX_NET_DEVICES=lo
fi
exit $rc
