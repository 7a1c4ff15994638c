#!/usr/bin/env bash
# Fairness benchmark: what one uid's flood costs another uid's latency (bench/fairness.c says
# what each mode floods with). Builds gpupoold and the benchmark in a release build
# (RelWithDebInfo, build/release unless BUILD names another build directory), then runs it as
# root: it starts its own gpupoold per mode on a private socket, floods it from uid 65534 and
# prints a table of the victim's p50/p99/max against idle, and whether each ratio meets the
# 5x goal. About a minute; it stops by itself and kills its children.
#
#   tools/fairness-bench.sh                    # every mode, 3 s each
#   tools/fairness-bench.sh --modes wake,hash  # some modes (idle always runs)
#   tools/fairness-bench.sh --seconds 5        # longer measuring time per mode
#   tools/fairness-bench.sh --quick            # every mode once, briefly: does it run?
#   tools/fairness-bench.sh --repeat 3 --nice -10  # median of 3 runs, ahead of other work
#
# With $OUT set, the output is also written to $OUT/fairness-bench.log.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build/release}

die() { echo "fairness-bench.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root: the floods come from uid 65534 (nobody), the victim is root"
if [ ! -f "$build/CMakeCache.txt" ]; then
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
type=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$build/CMakeCache.txt")
case "$type" in
  Release | RelWithDebInfo) ;;
  *) echo "fairness-bench.sh: warning: $build is a $type build; figures are meant from RelWithDebInfo" >&2 ;;
esac
cmake --build "$build" -j"${JOBS:-2}" --target gpupoold gpupool_fairness_bench >/dev/null

echo "gpupool $(git rev-parse --short HEAD 2>/dev/null || echo '?') ($type), $(date -u '+%Y-%m-%d %H:%M UTC'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  "$build/bench/gpupool_fairness_bench" "$build/daemon/gpupoold" "$@" 2>&1 | tee "$OUT/fairness-bench.log"
  exit "${PIPESTATUS[0]}"
fi
exec "$build/bench/gpupool_fairness_bench" "$build/daemon/gpupoold" "$@"
