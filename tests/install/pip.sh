#!/usr/bin/env bash
# `pip install ./python` in a fresh virtual environment is everything a Python user needs:
# the wheel builds libgpupool-client with the project's CMake and carries it. Then, from
# outside the source tree, with no GPUPOOL_LIBRARY and no PYTHONPATH, the package loads its
# own library, reports one version for C and Python, and shares a buffer through a live
# gpupoold.
#
#   tests/install/pip.sh GPUPOOLD [WORKDIR]
# Exit 77 (skipped) only when pip cannot reach a package index for the build requirements.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
gpupoold=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
work=${2:-$src/build/pip-test}
py=${GPUPOOL_PIP_PYTHON:-/usr/bin/python3}
die() { echo "FAIL: $*" >&2; exit 1; }

rm -rf "$work"
mkdir -p "$work"
work=$(cd "$work" && pwd)
"$py" -m venv "$work/venv" || die "$py -m venv (python3-venv missing?)"
# A fresh build directory: what a user's first install does.
rm -rf "$src/python/build"
if ! "$work/venv/bin/pip" install "$src/python" >"$work/pip.log" 2>&1; then
  if grep -qiE "NewConnectionError|Temporary failure in name resolution|No matching distribution found for scikit-build-core|Network is unreachable" "$work/pip.log"; then
    tail -n 5 "$work/pip.log"
    echo "SKIP: pip cannot download the build requirement scikit-build-core (no package index reachable)"
    exit 77
  fi
  cat "$work/pip.log"
  die "pip install ./python"
fi
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
echo "ok"
