#!/usr/bin/env python3
"""What a tensor costs through torch.multiprocessing's Queue on the CPU (host backend): per
tensor, a dict of small CPU tensors put by one process and got by another, with torch's own
sharing, gpupool.torch.install(cpu=True) on its pure-Python path (GPUPOOL_PURE_PYTHON=1), and
install(cpu=True) with its C extension (gpupool._fast), same run. torch runs both its sharing
strategies: file_descriptor (its default: an fd per storage, passed through a Unix socket) and
file_system (a named shared-memory file per storage).

Workloads: the 146 tensors of bench/weight_sync.py's Llama-shaped state dict, each made small
(bf16, 2,048 elements: 64x32 for a matrix, 2,048 for a norm) so that what is measured is the
per-tensor work and not the copies; and 10,000 float32 tensors of 256 elements. The producer
puts the same dict every time (torch moves its storages into shared memory at the first put
only; gpupool copies them into its kept buffers each time), the consumer gets it and says so;
the next put waits for that. Timed: from the producer starting put() to the consumer holding
the dict (time.perf_counter_ns, CLOCK_MONOTONIC, shared by both processes); printed: the
median over the messages after the first, divided by the number of tensors. Every message is
checked bit-exact outside the timed part once per way.

    python3 bench/torch_queue_cpu.py --gpupoold build/daemon/gpupoold \\
        [--fast-module build/python/ext/_fast.abi3.so] [--messages 30] [--ways "A;B"] [--workloads "146;10,000"]

Exits 77 without torch.
"""

import argparse
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)

from _common import percentile, use_library  # noqa: E402
from weight_sync import llama_layout  # noqa: E402

WAYS = ("torch (file_descriptor)", "torch (file_system)", "install(), pure Python", "install(), extension")


def small_llama():
    return [(name, (64, 32) if len(shape) == 2 else (2048,)) for name, shape in llama_layout()]


WORKLOADS = {
    "146-tensor state dict (bf16, 4 KiB each)": (small_llama, "bfloat16"),
    "10,000-tensor dict (float32, 1 KiB each)": (lambda: [("t%05d" % i, (256,)) for i in range(10000)],
                                                 "float32"),
}


def make(workload):
    import torch

    layout, dtype = WORKLOADS[workload]
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(shape, generator=g).to(getattr(torch, dtype)) for k, shape in layout()}


def _setup(way, socket):
    # torch's file descriptor sharing keeps fds per storage in flight.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if way.startswith("torch"):
        import torch.multiprocessing as mp

        mp.set_sharing_strategy(way[len("torch ("):-1])
    else:
        import gpupool.torch as gt

        gt.install(cpu=True, socket=socket)


def digest(d):
    import hashlib

    h = hashlib.sha256()
    for k in sorted(d):
        h.update(d[k].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def producer(way, socket, workload, messages, q, r):
    _setup(way, socket)
    msg = make(workload)
    want = digest(msg)
    took = []
    for v in range(messages):
        t0 = time.perf_counter_ns()
        q.put(msg)
        t1, ok = r.get(timeout=120)
        took.append(t1 - t0)
        if v == 0 and ok != want:
            raise SystemExit("%s: the received dict differs from the one sent" % way)
    q.put(None)
    r.put(took)


def consumer(way, socket, q, r):
    _setup(way, socket)
    first = True
    while True:
        got = q.get(timeout=120)
        t = time.perf_counter_ns()
        if got is None:
            return
        r.put((t, digest(got) if first else None))
        first = False
        del got


def run_way(way, socket, workload, messages, fast_module):
    import torch.multiprocessing as mp

    # The path is picked when gpupool.torch is imported: the spawned pair inherits it.
    os.environ.pop("GPUPOOL_PURE_PYTHON", None)
    os.environ.pop("GPUPOOL_FAST_MODULE", None)
    if way == "install(), pure Python":
        os.environ["GPUPOOL_PURE_PYTHON"] = "1"
    elif way == "install(), extension" and fast_module:
        os.environ["GPUPOOL_FAST_MODULE"] = os.path.abspath(fast_module)
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    c = ctx.Process(target=consumer, args=(way, socket, q, r))
    p = ctx.Process(target=producer, args=(way, socket, workload, messages, q, r))
    c.start()
    p.start()
    p.join(900)
    took = r.get(timeout=60) if p.exitcode == 0 else None
    c.join(60)
    for x in (p, c):
        if x.exitcode is None:
            x.kill()
            x.join()
    if took is None or c.exitcode != 0:
        return None  # said by the children (torch's fd sharing runs out of fds, say)
    return took[1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpupoold", required=True)
    ap.add_argument("--library")
    ap.add_argument("--fast-module", help="gpupool._fast's file in a build tree (default: the "
                                          "package's own, if built)")
    ap.add_argument("--messages", type=int, default=30)
    ap.add_argument("--ways", default=";".join(WAYS), help="semicolon-separated (default: all of %s)"
                    % "; ".join(WAYS))
    ap.add_argument("--workloads", default="146;10,000", help="semicolon-separated prefixes")
    a = ap.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        print("SKIP: no torch")
        return 77
    use_library(a.library, a.gpupoold)
    from gpupool.testing import Daemon

    with Daemon(a.gpupoold, pools=["name=bench,kind=host,capacity=2G,slab=16M"]) as d:
        print("%-42s %-24s %10s %10s %12s" % ("workload", "way", "p50 ms", "p90 ms", "us a tensor"),
              flush=True)
        ways = [w for w in WAYS if w in a.ways.split(";")]
        for workload, (layout, _) in WORKLOADS.items():
            if not any(workload.startswith(p) for p in a.workloads.split(";")):
                continue
            n = len(layout())
            msgs = a.messages if n < 1000 else max(6, a.messages // 4)
            for way in ways:
                took = run_way(way, d.socket, workload, msgs, a.fast_module)
                if took is None:
                    print("%-42s %-24s %s" % (workload, way, "failed (see above)"), flush=True)
                    continue
                p50 = percentile(took, 50) / 1e6
                print("%-42s %-24s %10.2f %10.2f %12.2f" % (workload, way, p50, percentile(took, 90) / 1e6,
                                                           p50 * 1e3 / n), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
