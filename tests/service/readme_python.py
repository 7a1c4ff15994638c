#!/usr/bin/env python3
"""The README's NumPy example (the ```python block after "Without a GPU"), as a reader runs
it: its producer part, then its consumer part, each a process of its own, against a real
gpupoold on the host backend, with only NumPy (no torch, no GPU). The consumer must print
what the comment in the block says.

Usage: readme_python.py README GPUPOOLD PYTHON_DIR LIBGPUPOOL
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

README, GPUPOOLD, PYTHON_DIR, LIBGPUPOOL = sys.argv[1:5]


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def main():
    try:
        import numpy  # noqa: F401
    except ImportError:
        print("(no NumPy here: skipped)")
        sys.exit(77)
    text = open(README).read()
    m = re.search(r"Without a GPU.*?```python\n(.*?)```", text, re.S)
    if not m:
        fail("no ```python block after 'Without a GPU' in the README")
    block = m.group(1)
    parts = re.split(r"^(?=# consumer\.py)", block, flags=re.M)
    if len(parts) != 2 or "producer.py" not in parts[0]:
        fail(f"the block is not a producer part and a consumer part:\n{block}")
    want = re.search(r"#\s*(\(1024, 1024\) float32 \S+)\s*$", parts[1], re.M)
    tmp = tempfile.mkdtemp(prefix="gpupool-readme-py-")
    sock = os.path.join(tmp, "gp.sock")
    env = {k: v for k, v in os.environ.items() if k not in ("LISTEN_FDS", "LISTEN_PID", "NOTIFY_SOCKET")}
    env.update(GPUPOOL_SOCKET=sock, PYTHONPATH=PYTHON_DIR, GPUPOOL_LIBRARY=LIBGPUPOOL)
    if os.environ.get("GPUPOOL_TEST_PY_PRELOAD"):
        env.update(LD_PRELOAD=os.environ["GPUPOOL_TEST_PY_PRELOAD"], ASAN_OPTIONS="detect_leaks=0")
    daemon_env = {k: v for k, v in env.items() if k not in ("LD_PRELOAD",)}
    d = subprocess.Popen([GPUPOOLD, "--backend", "host", "--socket", sock, "--log-level", "warn"], env=daemon_env)
    try:
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        outs = []
        for name, code in (("producer", parts[0]), ("consumer", parts[1])):
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
            print(f"{name}: exit {p.returncode}\n{p.stdout}{p.stderr}", end="")
            if p.returncode != 0:
                fail(f"the README's {name} part failed")
            outs.append(p.stdout)
        if not want or want.group(1) not in outs[1]:
            fail(f"the consumer printed {outs[1]!r}, not what the block's comment says "
                 f"({want.group(1) if want else 'no comment found'})")
    finally:
        d.terminate()
        d.wait(15)
        shutil.rmtree(tmp, ignore_errors=True)
    print("ok")


if __name__ == "__main__":
    main()
