#!/usr/bin/env bash
# `pip install ./python` in a fresh virtual environment is everything a Python user needs:
# the wheel builds libgpupool-client with the project's CMake and carries it. The wheel is
# publishable and runs anywhere: its tag is manylinux (no lower than the newest GLIBC_ symbol
# version the library uses) and its library needs nothing but libc (protobuf-c is linked in,
# so machines without libprotobuf-c1 run it). Then, from outside the source tree, with no
# GPUPOOL_LIBRARY and no PYTHONPATH, the package loads its own library, reports one version
# for C and Python, shares a buffer through a live gpupoold, and examples/python run as a
# user runs them after `pip install "./python[numpy]"`.
#
#   tests/install/pip.sh GPUPOOLD [WORKDIR]
# Exit 77 (skipped) only when pip cannot reach a package index for the build requirements.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
gpupoold=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
work=${2:-$src/build/pip-test}
py=${GPUPOOL_PIP_PYTHON:-/usr/bin/python3}
die() { echo "FAIL: $*" >&2; exit 1; }
offline() {
  if grep -qiE "NewConnectionError|Temporary failure in name resolution|No matching distribution found for (scikit-build-core|numpy)|Network is unreachable" "$1"; then
    tail -n 5 "$1"
    echo "SKIP: pip cannot download $2 (no package index reachable)"
    exit 77
  fi
  cat "$1"
  die "$3"
}

rm -rf "$work"
mkdir -p "$work"
work=$(cd "$work" && pwd)
"$py" -m venv "$work/venv" || die "$py -m venv (python3-venv missing?)"
# A fresh build directory: what a user's first install does.
rm -rf "$src/python/build"
"$work/venv/bin/pip" wheel --no-deps -w "$work/dist" "$src/python" >"$work/wheel.log" 2>&1 ||
  offline "$work/wheel.log" "the build requirement scikit-build-core" "pip wheel ./python"
whl=$(ls "$work"/dist/gpupool-*.whl)
echo "built $(basename "$whl")"

# The library inside the wheel: what it needs from the system, and the tag it deserves.
mkdir "$work/unpacked"
"$work/venv/bin/python" -m zipfile -e "$whl" "$work/unpacked"
so=$work/unpacked/gpupool/libgpupool-client.so
[ -f "$so" ] || die "the wheel has no gpupool/libgpupool-client.so"
needed=$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
echo "libgpupool-client.so needs: $needed"
for lib in $needed; do
  case $lib in
    libc.so.6|libpthread.so.0|libdl.so.2|libm.so.6|librt.so.1|ld-linux-x86-64.so.2) ;;
    *) die "the wheel's library needs $lib, which a machine may not have (only libc's own libraries may be needed: link it statically, see GPUPOOL_STATIC_DEPS)" ;;
  esac
done
if ldd "$so" | grep -q protobuf-c; then die "ldd: the wheel's library loads libprotobuf-c: $(ldd "$so")"; fi
glibc=$(objdump -T "$so" | grep -o 'GLIBC_2\.[0-9]*' | sort -uV | tail -n 1)
glibc_minor=${glibc#GLIBC_2.}
tag=$(basename "$whl" .whl)
tag=${tag##*-}
case $tag in
  manylinux_2_*_x86_64) tag_minor=${tag#manylinux_2_}; tag_minor=${tag_minor%_x86_64} ;;
  *) die "wheel tag $tag is not a manylinux tag (an index refuses linux_x86_64): set wheel.tags in python/pyproject.toml" ;;
esac
[ "$tag_minor" -ge "$glibc_minor" ] ||
  die "wheel tag $tag claims glibc 2.$tag_minor but the library uses $glibc: raise the tag in python/pyproject.toml"
echo "tag $tag covers $glibc"

# The numpy extra brings NumPy, which the examples' host mode needs.
"$work/venv/bin/pip" install "$whl[numpy]" >"$work/pip.log" 2>&1 ||
  offline "$work/pip.log" "numpy" "pip install gpupool[numpy]"
tail -n 1 "$work/pip.log"

sock=$work/gp.sock
"$gpupoold" --backend host --socket "$sock" >"$work/gpupoold.log" 2>&1 &
daemon_pid=$!
trap 'kill $daemon_pid 2>/dev/null || true; wait $daemon_pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
[ -S "$sock" ] || { cat "$work/gpupoold.log"; die "gpupoold did not start"; }

cd /
env -u GPUPOOL_LIBRARY -u PYTHONPATH -u LD_LIBRARY_PATH "$work/venv/bin/python" - "$sock" "$src" <<'PY' || die "the pip-installed package"
import ctypes, importlib.metadata, os, re, sys
import gpupool
sock, src = sys.argv[1:3]
here = os.path.dirname(gpupool.__file__)
assert not here.startswith(os.path.join(src, "python", "")), f"imported from the source tree: {here}"
cmake = re.search(r"project\(gpupool VERSION ([0-9.]+)", open(os.path.join(src, "CMakeLists.txt")).read()).group(1)
versions = {"CMake project": cmake, "gpupool.__version__": gpupool.__version__,
            "package metadata": importlib.metadata.version("gpupool"),
            "libgpupool-client": gpupool.library_version()}
print(versions)
assert len(set(versions.values())) == 1, f"more than one version: {versions}"
lib = gpupool._lib.lib()._name
assert lib.startswith(here), f"the library is not the package's own: {lib}"
# gpupool.torch's C part, built with the package where Python's headers are (tools/deps.sh).
from gpupool import _native
assert _native.fast is not None, "the wheel has no gpupool._fast (were Python's headers missing?)"
assert _native.fast.__file__.startswith(here), f"gpupool._fast is not the package's own: {_native.fast.__file__}"
with gpupool.Client(sock, name="pip-test") as a, gpupool.Client(sock) as b:
    t = a.alloc((256,), "uint8")
    ctypes.memmove(t.data_ptr, bytes(range(256)), 256)
    a.publish("pip/test", t)
    g = b.get("pip/test", timeout=5)
    got = ctypes.string_at(g.data_ptr, 256)
    assert got == bytes(range(256)), "bytes differ"
    g.release(); t.release()
    a.unpublish("pip/test")
print("pip-installed gpupool", gpupool.__version__, "works from", here)
PY

# The examples as a user runs them after installing: from another directory, by path.
ex=$src/examples/python
for step in "producer.py --name pipex --count 2 --size 4096 --mode numpy" \
            "consumer.py --name pipex --count 2 --size 4096 --mode numpy --timeout 10"; do
  set -- $step
  script=$1; shift
  out=$(env -u GPUPOOL_LIBRARY -u PYTHONPATH -u LD_LIBRARY_PATH \
        "$work/venv/bin/python" "$ex/$script" --socket "$sock" "$@" 2>&1) ||
    { echo "$out"; die "examples/python/$script with the installed package"; }
  echo "$out" | tail -n 1
done
echo "$out" | grep -q "2 of 2 tensors matched" || { echo "$out"; die "consumer.py did not match both tensors"; }
echo "ok"
