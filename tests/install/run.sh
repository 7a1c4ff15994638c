#!/usr/bin/env bash
# The installed package as a user meets it. For each variant (without CUDA, and with it when
# the toolkit is present), from a Release build under -Werror:
#   1. cmake --install --prefix P writes nothing outside P (checked in a DESTDIR staging
#      root), and the tree is relocatable: everything below runs after P is moved elsewhere;
#   2. gpupool.pc: a ${pcfiledir}-based prefix, Requires.private and Libs.private;
#   3. tests/install/consumer, a project outside this tree, builds with find_package(gpupool)
#      against gpupool::client and gpupool::client-static, and with pkg-config (shared, and
#      static from the .pc's private requirements alone);
#   4. each consumer runs against the installed gpupoold (host backend): allocate, publish,
#      get from a second connection, every byte checked.
#
#   tests/install/run.sh [WORKDIR]     (default build/install-test)
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-$src/build/install-test}
jobs=$(nproc 2>/dev/null || echo 2)
mkdir -p "$work"
work=$(cd "$work" && pwd)

die() { echo "FAIL: $*" >&2; exit 1; }

variants=(nocuda)
if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null 2>&1; then
  variants+=(cuda)
else
  echo "(no CUDA toolkit: the CUDA variant is not built)"
fi

daemon_pid=
cleanup() {
  if [ -n "$daemon_pid" ]; then kill "$daemon_pid" 2>/dev/null || true; wait "$daemon_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT

for v in "${variants[@]}"; do
  echo "==== install test: $v"
  b=$work/build-$v
  cuda=OFF
  [ "$v" = cuda ] && cuda=ON
  # The whole tree, tests and examples too, builds in Release under -Werror (-O3 finds what
  # -O2 does not); installed from the same build, they are simply not installed.
  cmake -S "$src" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUPOOL_CUDA=$cuda \
        >"$b.configure.log" 2>&1 ||
    { cat "$b.configure.log"; die "configure ($v)"; }
  grep -q 'CMAKE_C_FLAGS_RELEASE.*-O3' "$b/CMakeCache.txt" || die "not a Release build"
  cmake --build "$b" -j"$jobs" >"$b.build.log" 2>&1 || { tail -n 60 "$b.build.log"; die "Release build ($v)"; }

  rm -rf "$work/stage-$v" "$work/moved-$v"
  p=$work/p-$v
  # Staged with DESTDIR, so that a regression shows up here instead of writing into the
  # machine's /usr/local or /etc: every file must land under DESTDIR + P.
  stage=$work/stage-$v
  DESTDIR=$stage cmake --install "$b" --prefix "$p" >"$b.install.log" 2>&1 || { cat "$b.install.log"; die "cmake --install ($v)"; }
  outside=$(cd "$stage" && find . ! -type d | sed 's|^\.||' | grep -v "^$p/" || true)
  [ -z "$outside" ] || die "cmake --install --prefix $p wrote outside the prefix:
$outside"
  mv "$stage$p" "$p"
  for f in sbin/gpupoold bin/gpupoolctl lib/systemd/system/gpupoold.service lib/systemd/system/gpupoold.socket \
           lib/sysusers.d/gpupool.conf etc/gpupool/gpupoold.conf include/gpupool/gpupool.h; do
    [ -e "$p/$f" ] || die "$f is not installed under the prefix"
  done
  pc=$(find "$p" -name gpupool.pc)
  [ -n "$pc" ] || die "no gpupool.pc"
  grep -q '^prefix=${pcfiledir}/' "$pc" || die "gpupool.pc does not find its prefix from \${pcfiledir}: $(grep ^prefix= "$pc")"
  grep -q '^Requires.private: libprotobuf-c' "$pc" || die "gpupool.pc lacks Requires.private: libprotobuf-c"
  grep -q '^Libs.private: .*-lpthread' "$pc" || die "gpupool.pc lacks Libs.private"
  if [ "$v" = cuda ]; then grep -q '^Libs.private: .*-lcudart_static' "$pc" || die "gpupool.pc lacks -lcudart_static"; fi
  if grep -rq "$p" "$pc" "$(dirname "$pc")/../cmake/gpupool/"*.cmake 2>/dev/null; then
    die "the pkg-config or CMake files name the install prefix $p literally (not relocatable)"
  fi

  # Relocate: what a package manager or a copied tree does.
  mv "$p" "$work/moved-$v"
  p=$work/moved-$v
  pcdir=$(dirname "$(find "$p" -name gpupool.pc)")
  libdir=$(dirname "$pcdir")

  c=$work/consumer-$v
  rm -rf "$c"
  mkdir -p "$c"
  for kind in shared static; do
    st=OFF
    [ $kind = static ] && st=ON
    cmake -S "$src/tests/install/consumer" -B "$c/cmake-$kind" -G Ninja -DCMAKE_PREFIX_PATH="$p" \
          -DCONSUMER_STATIC=$st >"$c/cmake-$kind.log" 2>&1 || { cat "$c/cmake-$kind.log"; die "find_package(gpupool) consumer, $kind ($v)"; }
    cmake --build "$c/cmake-$kind" >>"$c/cmake-$kind.log" 2>&1 || { cat "$c/cmake-$kind.log"; die "building the find_package consumer, $kind ($v)"; }
  done
  export PKG_CONFIG_PATH=$pcdir
  [ "$(pkg-config --variable=prefix gpupool)" -ef "$p" ] || die "pkg-config's prefix is not the moved tree: $(pkg-config --variable=prefix gpupool)"
  # shellcheck disable=SC2046
  cc -std=c11 -Wall -Werror -o "$c/pc-shared" "$src/tests/install/consumer/consumer.c" \
     $(pkg-config --cflags --libs gpupool) || die "pkg-config consumer, shared ($v)"
  # Static: the archive plus what the .pc says it needs (Requires.private, Libs.private).
  # shellcheck disable=SC2046
  cc -std=c11 -Wall -Werror -DGPUPOOL_STATIC -o "$c/pc-static" "$src/tests/install/consumer/consumer.c" \
     $(pkg-config --cflags gpupool) \
     $(pkg-config --static --libs gpupool | sed 's/-lgpupool-client\b/-l:libgpupool-client.a/') ||
    die "pkg-config consumer, static ($v)"
  if ldd "$c/pc-static" | grep -q libgpupool-client; then die "the static consumer loads libgpupool-client.so"; fi
  if ldd "$c/cmake-static/consumer" | grep -q libgpupool-client; then die "the gpupool::client-static consumer loads libgpupool-client.so"; fi

  sock=$work/gp-$v.sock
  rm -f "$sock"
  "$p/sbin/gpupoold" --backend host --socket "$sock" >"$work/gpupoold-$v.log" 2>&1 &
  daemon_pid=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
  [ -S "$sock" ] || { cat "$work/gpupoold-$v.log"; die "the installed gpupoold did not start"; }
  for exe in "$c/cmake-shared/consumer" "$c/cmake-static/consumer" "$c/pc-shared" "$c/pc-static"; do
    LD_LIBRARY_PATH=$libdir "$exe" "$sock" || die "$exe ($v)"
  done
  "$p/bin/gpupoolctl" --socket "$sock" status >/dev/null || die "installed gpupoolctl"
  kill -TERM "$daemon_pid"
  wait "$daemon_pid" || die "gpupoold exited with $? ($v)"
  daemon_pid=
  unset PKG_CONFIG_PATH
  echo "==== install test: $v ok"
done
echo "==== install test: ok"
