#!/usr/bin/env bash
# PyTorch's own test/test_multiprocessing.py with gpupool.torch active in every process, on a
# GPU machine: once with install() and use_allocator() (every CUDA tensor a gpupool buffer),
# once with install() alone (CUDA storages copied into gpupool memory when sent), and once
# with neither (torch as it is, for comparison). A sitecustomize.py on PYTHONPATH does it, so
# spawned and forkserver children run it too. Prints each CUDA test as passed, failed or
# skipped per mode, and what changes between modes.
#
#   tools/torch-mp-suite.sh --test-file PATH [--python PY] [--build DIR] [--modes "allocator install none"]
#                           [--tests "cuda event leaf_variable"] [--per-test-timeout S] [--jobs N]
#                           [--timeline]
#
# Each test runs in a process of its own under a time limit (--per-test-timeout, default 120 s):
# a test that hangs (a child that died while its parent waits on a queue with no timeout) is
# reported as "timed out" and the next one runs. --jobs N runs N tests at once (default 1; the
# tests are separate processes sharing the one gpupoold). --timeline: every Python process of
# the tests logs when it started, when its multiprocessing target started and ended, and when
# it exited; each test's timeline (seconds from the test's start) follows its result in
# <mode>.log (for a test with a time limit of its own, as test_cuda_ipc_deadlock's 10 s: what
# takes the time, start-up or the target).
# --tests: unittest -k patterns (default: the tests that touch CUDA: every name with "cuda",
# the CUDA event tests and the leaf-variable test that shares a CUDA tensor); "" runs the
# whole file (its CPU tests repeat 30 times and take minutes).
#
# PATH: test/test_multiprocessing.py of the PyTorch source matching the installed torch (the
# wheel ships torch.testing._internal, which it imports, but not the test itself); without
# --test-file the script tries GitHub (raw.githubusercontent.com, tag v<torch version>) and
# stops saying so when that cannot be reached. DIR: a build tree with gpupoold,
# libgpupool-client.so and libgpupool-torch-alloc.so (default: build-gpu). Logs go to $OUT
# (or a temp dir): <mode>.log and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
build=build-gpu
test_file=""
modes="allocator install none"
tests="cuda event leaf_variable"
per_test=120
jobs=1
timeline=0
while [ $# -gt 0 ]; do
  case $1 in
    --test-file) test_file=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    --tests) tests=$2; shift 2 ;;
    --per-test-timeout) per_test=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --timeline) timeline=1; shift ;;
    *) echo "usage: $0 --test-file PATH [--python PY] [--build DIR] [--modes \"allocator install none\"] [--tests \"...\"] [--per-test-timeout S] [--jobs N] [--timeline]" >&2; exit 2 ;;
  esac
done
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
die() { echo "torch-mp-suite.sh: $*" >&2; exit 1; }

ver=$("$py" -c "import torch; print(torch.__version__.split('+')[0])") || die "$py cannot import torch"
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || die "torch sees no CUDA device"
# The test file imports torch's own test helpers, which need packages torch's wheel does not
# bring (expecttest): without them every test would fail alike on the import.
helpers_check() {
  local err
  err=$("$py" -c "import torch.testing._internal.common_utils" 2>&1) && return 0
  die "the test file needs torch's test helpers, which do not import here ($(printf '%s\n' "$err" | tail -1)): install what is missing (pip install expecttest) or put it on PYTHONPATH"
}
helpers_check
if [ -z "$test_file" ]; then
  test_file=$out/test_multiprocessing.py
  curl -fsSL -m 30 -o "$test_file" \
    "https://raw.githubusercontent.com/pytorch/pytorch/v$ver/test/test_multiprocessing.py" ||
    die "cannot fetch test_multiprocessing.py for torch $ver from GitHub; pass --test-file PATH (from a PyTorch v$ver checkout)"
fi
[ -f "$test_file" ] || die "no such file: $test_file"
for f in daemon/gpupoold client/libgpupool-client.so client/libgpupool-torch-alloc.so; do
  [ -e "$build/$f" ] || die "$build/$f missing: build the tree (GPU_BUILD_TARGETS includes gpupool-torch-alloc)"
done

work=$(mktemp -d)
trap 'kill "$dpid" 2>/dev/null; rm -rf "$work"' EXIT
sock=$work/gpupoold.sock
# A device pool on every GPU (the multi-GPU tests put tensors on cuda:1), and a host pool.
ngpu=$("$py" -c "import torch; print(torch.cuda.device_count())")
pools=()
for ((d = 0; d < ngpu; d++)); do
  pools+=(--pool "name=gpu$d,kind=device,device=$d,capacity=16G,slab=1G")
done
"$build/daemon/gpupoold" --backend cuda --socket "$sock" --log-level warn "${pools[@]}" \
  --pool "name=host,kind=host-numa,device=0,numa=0,capacity=4G,slab=256M" >"$out/gpupoold.log" 2>&1 &
dpid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
[ -S "$sock" ] || die "gpupoold did not start: $(tail -5 "$out/gpupoold.log")"

# Runs in every Python process started with this PYTHONPATH, children included.
mkdir -p "$work/site"
cat >"$work/site/sitecustomize.py" <<'PYEOF'
import os
mode = os.environ.get("GPUPOOL_TORCH_SUITE_MODE", "none")
if os.environ.get("GPUPOOL_TORCH_SUITE_TIMELINE") == "1":
    import atexit, sys, time
    import multiprocessing.process as _mpp

    def _mark(what):
        sys.stderr.write("timeline %.3f pid=%d %s\n" % (time.time(), os.getpid(), what))
        sys.stderr.flush()

    _mark("start " + " ".join(sys.argv[:3]))
    _run = _mpp.BaseProcess.run

    def _timed_run(self):
        _mark("target start (%s)" % self.name)
        try:
            return _run(self)
        finally:
            _mark("target end (%s)" % self.name)

    _mpp.BaseProcess.run = _timed_run
    atexit.register(_mark, "exit")
if mode in ("allocator", "install"):
    import gpupool.torch as _gt
    if mode == "allocator":
        try:
            _gt.use_allocator()
        except Exception as e:  # a process that made CUDA memory before (none should)
            import sys
            sys.stderr.write("gpupool sitecustomize: use_allocator failed: %s\n" % e)
    _gt.install()
PYEOF

cp "$test_file" "$work/test_multiprocessing.py"
# The tests to run, by name (read from the file without importing it), minus those that cannot
# apply to a mode: under use_allocator() test_rebuild_cuda_tensor calls torch's internal
# storage._share_cuda_(), which CUDAPluggableAllocator refuses ("does not yet support
# shareIPcHandle"); its child dies and the parent waits on queue.get() with no timeout.
names() { # MODE
  "$py" - "$work/test_multiprocessing.py" "$1" "$tests" <<'PYEOF'
import ast, sys
path, mode, pats = sys.argv[1], sys.argv[2], sys.argv[3].split()
na = {"allocator": {"test_rebuild_cuda_tensor"}}.get(mode, set())
tree = ast.parse(open(path).read())
for cls in tree.body:
    if isinstance(cls, ast.ClassDef) and cls.name == "TestMultiprocessing":
        for f in cls.body:
            if isinstance(f, ast.FunctionDef) and f.name.startswith("test") and f.name not in na \
                    and (not pats or any(p in f.name for p in pats)):
                print("TestMultiprocessing." + f.name)
PYEOF
}
for mode in $modes; do
  echo "==== torch-mp-suite: mode $mode"
  [ "$mode" != allocator ] || echo "not applicable under use_allocator(): test_rebuild_cuda_tensor (see above)" >"$out/$mode.na"
  : >"$out/$mode.log"
  mkdir -p "$work/logs/$mode"
  export mode sock work root build py per_test timeline
  names "$mode" | xargs -P "$jobs" -I{} bash -c '
    t={}
    log=$work/logs/$mode/$t.log
    (cd "$work" &&
      GPUPOOL_TORCH_SUITE_TIMELINE=$timeline GPUPOOL_TORCH_SUITE_MODE=$mode GPUPOOL_SOCKET=$sock PYTHONPATH="$work/site:$root/python${PYTHONPATH:+:$PYTHONPATH}" \
      GPUPOOL_LIBRARY=$root/$build/client/libgpupool-client.so \
      GPUPOOL_TORCH_ALLOC_LIBRARY=$root/$build/client/libgpupool-torch-alloc.so \
      timeout -k 5 "$per_test" "$py" test_multiprocessing.py -v "$t" >"$log" 2>&1)
    rc=$?
    if [ $rc = 124 ] || [ $rc = 137 ]; then
      printf "\n%s (%s) ... timed out after %s s\n" "${t#*.}" "$t" "$per_test" >>"$log"
    fi
    if [ "$timeline" = 1 ]; then
      "$py" -c "
import sys
rows = [l.split(None, 3) for l in open(sys.argv[1], errors=\"replace\") if l.startswith(\"timeline \")]
t0 = min((float(r[1]) for r in rows), default=0)
for r in sorted(rows, key=lambda r: float(r[1])):
    print(\"  %7.3f s  %s  %s\" % (float(r[1]) - t0, r[2], r[3].rstrip()))
" "$log" >"$log.tl"
      printf "timeline of %s:\n" "$t" >>"$log"
      cat "$log.tl" >>"$log"
      rm -f "$log.tl"
    fi
    echo "exit status $rc ($t)" >>"$log"'
  for t in $(names "$mode"); do cat "$work/logs/$mode/$t.log" >>"$out/$mode.log"; done
done

# One line per CUDA test and mode: passed, failed (with the error's last line) or skipped (with
# the reason), read from each test's own log (it ends with the "exit status" line above):
# unittest's "... ok" can come lines after the test's name when the test prints warnings.
"$py" - "$out" $modes <<'PYEOF' | tee "$out/summary.txt"
import re, sys
out, modes = sys.argv[1], sys.argv[2:]
res, why = {}, {}
for m in modes:
    try:
        text = open("%s/%s.log" % (out, m), errors="replace").read()
    except OSError:
        continue
    seg = []
    for ln in text.splitlines():
        mm = re.match(r"^exit status (\d+) \([\w]+\.(test\w+)\)$", ln)
        if not mm:
            seg.append(ln)
            continue
        rc, name, body = int(mm.group(1)), mm.group(2), "\n".join(seg)
        seg = []
        if " ... timed out after " in body:
            st = "failed (timed out)"
        elif rc == 0:
            sk = re.search(r"skipped '([^']*)'", body)
            st = "skipped: " + sk.group(1) if sk else "passed"
        else:
            st = "failed"
            errs = [l for l in body.splitlines() if re.match(r"^\w*(Error|Exception)\b.*", l)]
            why[(name, m)] = errs[-1] if errs else "exit status %d" % rc
        res.setdefault(name, {})[m] = st
print("%-48s %s" % ("CUDA test", "  ".join("%-20s" % m for m in modes)))
for name in sorted(res):
    print("%-48s %s" % (name, "  ".join("%-20s" % res[name].get(m, "-")[:20] for m in modes)))
for m in modes:
    vals = [r.get(m) for r in res.values()]
    print("%s: %d passed, %d failed, %d skipped" % (m, vals.count("passed"),
          sum(1 for v in vals if v and v.startswith("failed")),
          sum(1 for v in vals if v and v.startswith("skipped"))))
for (name, m), w in sorted(why.items()):
    print("failed in %s: %s: %s" % (m, name, w[:160]))
PYEOF
