#!/usr/bin/env bash
# The fuzz run CI makes on every build (called by tools/test.sh): builds the libFuzzer targets
# of tests/fuzz with clang in build/fuzz, replays every regression input, then fuzzes each
# target for GPUPOOL_FUZZ_SECONDS (default 45) from its checked-in seed corpus. Fails on any
# crash, leak, timeout or harness finding; libFuzzer saves the input that caused it as
# tests/fuzz/regress/TARGET/{crash,leak,timeout,oom}-SHA1: commit it with the fix, and every
# later run (and ctest's fuzz_replay_TARGET) replays it.
#
#   tools/fuzz.sh                                 # every target
#   GPUPOOL_FUZZ_SECONDS=600 tools/fuzz.sh daemon # one target, longer
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${GPUPOOL_FUZZ_SECONDS:-45}
jobs=$(nproc 2>/dev/null || echo 2)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(daemon client config meta wire)
dir=build/fuzz

if ! command -v clang >/dev/null; then
  echo "gpupool: the fuzz targets need clang with libFuzzer; run tools/deps.sh" >&2
  exit 1
fi
mkdir -p build
echo "==== gpupool: building the fuzz targets ($dir, clang, libFuzzer + ASan/UBSan)"
cmake -S . -B "$dir" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGPUPOOL_FUZZ=ON -DGPUPOOL_BUILD_EXAMPLES=OFF >"$dir.configure.log" 2>&1 ||
  { cat "$dir.configure.log"; exit 1; }
cmake --build "$dir" -j"$jobs" --target "${targets[@]/#/fuzz_}"

export ASAN_OPTIONS=detect_leaks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
summary=()
failed=()
for t in "${targets[@]}"; do
  bin=$dir/tests/fuzz/fuzz_$t
  seeds=(tests/fuzz/corpus/"$t")
  [ "$t" != config ] || seeds+=(config) # the example config file with every key
  regress=tests/fuzz/regress/$t
  work=$dir/corpus/$t
  log=$dir/fuzz_$t.log
  mkdir -p "$regress" "$work"
  shopt -s nullglob
  old=("$regress"/*)
  shopt -u nullglob
  if [ ${#old[@]} -gt 0 ]; then
    echo "==== gpupool: fuzz_$t: replaying ${#old[@]} regression input(s)"
    if ! "$bin" "${old[@]}" >"$dir/replay_$t.log" 2>&1; then
      tail -n 60 "$dir/replay_$t.log"
      failed+=("$t (regression input)")
      continue
    fi
  fi
  echo "==== gpupool: fuzz_$t: fuzzing for ${secs}s"
  rc=0
  timeout $((secs + 300)) "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$regress/" "$work" "${seeds[@]}" >"$log" 2>&1 || rc=$?
  done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1 || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  cov=$(sed -n 's/.* cov: \([0-9]*\) ft: \([0-9]*\) corp: \([0-9]*\).*/\1 \2 \3/p' <<<"$done_line")
  read -r c f n <<<"${cov:-? ? ?}"
  summary+=("$(printf '%-8s %12s %8s %8s %8s' "$t" "${execs:-?}" "$c" "$f" "$n")")
  if [ "$rc" -ne 0 ]; then
    tail -n 80 "$log"
    echo "gpupool: fuzz_$t found a problem (exit $rc); the input is in $regress/" >&2
    failed+=("$t")
  fi
done

echo "==== gpupool: fuzzing summary (${secs}s per target)"
printf '%-8s %12s %8s %8s %8s\n' target executions cov ft corpus
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpupool: fuzzing failed: ${failed[*]}" >&2
  exit 1
fi
