#!/bin/sh
# The README's C API example ("The C API in brief") compiles as it stands, with the project's
# warnings as errors, and does what it says against a real gpupoold on a host pool: a reader
# copying the block must get a working program.
#
#   tests/service/readme_c.sh README CC "CFLAGS" INCLUDE_DIR BUILD_INCLUDE_DIR LIBRARY GPUPOOLD
set -eu
readme=$1 cc=$2 cflags=$3 inc=$4 binc=$5 lib=$6 gpupoold=$7
tmp=$(mktemp -d)
pid=
cleanup() { [ -z "$pid" ] || kill "$pid" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
awk '/^## The C API in brief/ { on = 1 } on && /^```c$/ { code = 1; next } code && /^```$/ { exit } code' \
  "$readme" >"$tmp/example.c"
[ -s "$tmp/example.c" ] || { echo "FAIL: no \`\`\`c block under '## The C API in brief' in $readme"; exit 1; }
# shellcheck disable=SC2086
if ! "$cc" -std=c11 -Wall -Wextra -Werror $cflags -I"$inc" -I"$binc" "$tmp/example.c" "$lib" \
     -Wl,-rpath,"$(dirname "$lib")" -o "$tmp/example" 2>"$tmp/cc.err"; then
  echo "FAIL: the README's C example does not compile as shown:"
  cat "$tmp/cc.err"
  exit 1
fi
"$gpupoold" --backend host --socket "$tmp/gp.sock" --pool name=default,kind=host,capacity=16M,slab=2M \
  --log-level warn 2>"$tmp/daemon.log" &
pid=$!
i=0
while [ ! -S "$tmp/gp.sock" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
out=$(GPUPOOL_SOCKET="$tmp/gp.sock" timeout 60 "$tmp/example" 2>&1) || {
  echo "FAIL: the README's C example failed: $out"; cat "$tmp/daemon.log"; exit 1; }
[ "$out" = "read what was published" ] || { echo "FAIL: the README's C example printed: $out"; exit 1; }
echo "ok: the README's C example compiles and runs: $out"
