#!/usr/bin/env bash
# The set-up + demo command: installs what is missing, builds gpupool, starts gpupoold on a
# private socket (CUDA backend if a usable GPU is present, host memory otherwise), runs the
# producer -> consumer demo with three consumers, shows what the daemon holds, and stops it.
#
#   tools/demo.sh [--count N] [--size BYTES]
set -euo pipefail
cd "$(dirname "$0")/.."
count=8
size=$((4 << 20))
while [ $# -gt 0 ]; do
  case "$1" in
    --count) count=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
tools/deps.sh
jobs=$(nproc 2>/dev/null || echo 2)
echo "==== building (build/release)"
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/release -j"$jobs" >/dev/null
B=build/release

dir=$(mktemp -d /tmp/gpupool-demo-XXXXXX)
sock=$dir/gpupoold.sock
cleanup() {
  if [ -n "${daemon_pid:-}" ] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid"; wait "$daemon_pid" || true
  fi
  rm -rf "$dir"
}
trap cleanup EXIT

echo "==== starting gpupoold on $sock (backend auto)"
"$B"/daemon/gpupoold --socket "$sock" --backend auto 2>"$dir/gpupoold.log" &
daemon_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
[ -S "$sock" ] || { cat "$dir/gpupoold.log"; echo "gpupoold did not start" >&2; exit 1; }
sed 's/^/  daemon: /' "$dir/gpupoold.log"

echo "==== consumers wait for names; the producer publishes $count buffers of $size bytes"
pids=()
for i in 1 2 3; do
  "$B"/examples/gpupool-consumer --socket "$sock" --count "$count" --id "$i" >"$dir/consumer$i.out" 2>&1 &
  pids+=($!)
done
"$B"/examples/gpupool-producer --socket "$sock" --count "$count" --size "$size"
fail=0
for i in 1 2 3; do
  wait "${pids[$((i-1))]}" || fail=1
  cat "$dir/consumer$i.out"
done
if [ -x "$B"/tools/gpupoolctl ]; then
  echo "==== gpupoolctl status / buffers (the names still hold the buffers)"
  "$B"/tools/gpupoolctl --socket "$sock" status || true
  "$B"/tools/gpupoolctl --socket "$sock" buffers || true
fi
echo "==== stopping gpupoold (the names and their buffers go with it)"
kill -TERM "$daemon_pid"; wait "$daemon_pid"; daemon_pid=
echo "==== daemon log"
sed 's/^/  daemon: /' "$dir/gpupoold.log" | tail -n 12
if [ $fail -ne 0 ]; then echo "DEMO FAILED: a consumer saw wrong bytes" >&2; exit 1; fi
echo "==== demo ok: every consumer read every byte the producer wrote, in place"
