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
#      get from a second connection, every byte checked;
#   5. the man pages are installed under share/man, the installed programs answer --help,
#      Libs.private names the CUDA library directory the build found, and
#      -DBUILD_SHARED_LIBS=OFF is refused at configure time with a message saying what to use.
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

# BUILD_SHARED_LIBS=OFF cannot be honoured (gpupoold, gpupoolctl and the Python package link
# the shared library; the static one is always installed too): refused, not silently ignored.
if cmake -S "$src" -B "$work/build-static-only" -G Ninja -DBUILD_SHARED_LIBS=OFF \
     >"$work/build-static-only.log" 2>&1; then
  die "-DBUILD_SHARED_LIBS=OFF configured without a word (it would be ignored)"
fi
grep -q 'BUILD_SHARED_LIBS=OFF is not supported' "$work/build-static-only.log" ||
  { cat "$work/build-static-only.log"; die "-DBUILD_SHARED_LIBS=OFF failed without saying why"; }
grep -q 'gpupool::client-static' "$work/build-static-only.log" ||
  die "the BUILD_SHARED_LIBS=OFF refusal does not name the static target to use"
rm -rf "$work/build-static-only"

# Libs.private follows the toolkit the build finds: the toolkit's directories linked into
# another root and named by CUDAToolkit_ROOT must show up in gpupool.pc as that root.
if [[ " ${variants[*]} " == *" cuda "* ]]; then
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  croot=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  alt=$work/cuda-elsewhere
  rm -rf "$alt" "$work/build-cuda-elsewhere"
  mkdir -p "$alt"
  for d in "$croot"/*; do ln -s "$(readlink -f "$d")" "$alt/$(basename "$d")"; done
  cmake -S "$src" -B "$work/build-cuda-elsewhere" -G Ninja -DGPUPOOL_CUDA=ON -DCUDAToolkit_ROOT="$alt" \
        -DGPUPOOL_BUILD_TESTS=OFF -DGPUPOOL_BUILD_EXAMPLES=OFF >"$work/build-cuda-elsewhere.log" 2>&1 ||
    { cat "$work/build-cuda-elsewhere.log"; die "configure with CUDAToolkit_ROOT=$alt"; }
  grep -q "^Libs.private: -L$alt/lib[^ ]* -lcudart_static" "$work/build-cuda-elsewhere/gpupool.pc" ||
    die "with the toolkit found in $alt, gpupool.pc still says: $(grep ^Libs.private "$work/build-cuda-elsewhere/gpupool.pc")"
  rm -rf "$alt" "$work/build-cuda-elsewhere"
fi

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
           lib/sysusers.d/gpupool.conf etc/gpupool/gpupoold.conf include/gpupool/gpupool.h \
           share/man/man8/gpupoold.8 share/man/man1/gpupoolctl.1 share/man/man5/gpupoold.conf.5 \
           share/bash-completion/completions/gpupoolctl; do
    [ -e "$p/$f" ] || die "$f is not installed under the prefix"
  done
  for exe in "$p/sbin/gpupoold" "$p/bin/gpupoolctl"; do
    out=$(timeout 20 "$exe" --help) || die "installed $exe --help failed or hung"
    printf '%s' "$out" | grep -qi '^usage:' || die "installed $exe --help printed no usage"
  done
  pc=$(find "$p" -name gpupool.pc)
  [ -n "$pc" ] || die "no gpupool.pc"
  grep -q '^prefix=${pcfiledir}/' "$pc" || die "gpupool.pc does not find its prefix from \${pcfiledir}: $(grep ^prefix= "$pc")"
  grep -q '^Requires.private: libprotobuf-c' "$pc" || die "gpupool.pc lacks Requires.private: libprotobuf-c"
  grep -q '^Libs.private: .*-lpthread' "$pc" || die "gpupool.pc lacks Libs.private"
  if [ "$v" = cuda ]; then
    grep -q '^Libs.private: .*-lcudart_static' "$pc" || die "gpupool.pc lacks -lcudart_static"
    # The directory of the cudart_static the build linked, not a guessed /usr/local/cuda/lib.
    cudart=$(sed -n 's/^CUDA_cudart_static_LIBRARY:FILEPATH=//p' "$b/CMakeCache.txt")
    [ -n "$cudart" ] || die "the CUDA build found no cudart_static"
    grep -q "^Libs.private: -L$(dirname "$cudart") " "$pc" ||
      die "gpupool.pc's Libs.private does not name the CUDA library directory the build found ($(dirname "$cudart")): $(grep ^Libs.private "$pc")"
  fi
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
