#!/usr/bin/env python3
"""Where one gpupool.torch message's time goes, function by function: the 146-tensor
Llama-shaped state dict pickled by ForkingPickler.dumps in one process (what a Queue's feeder
thread does: reductions, copies, the Share) and loaded by ForkingPickler.loads in another (the
Open, the storages, the tensors), the bytes passed over a pipe between them, each side under
cProfile for the warm messages.

Prints, per way, the wall time of dumps and loads (median of the warm messages, measured
without the profiler in alternate messages) and each side's functions by their own time
(cProfile adds a fixed cost to every Python call it sees, so Python-heavy steps look larger
than they are: read the ranking, not the sum). Ways: "copy" (torch's tensors, copied into
kept buffers), "empty" (gpupool.torch.empty tensors, shared in place), "allocator"
(use_allocator() in both processes; CUDA only). --device cpu runs copy and empty on the host
backend (install(cpu=True)).

    python3 bench/torch_msg_profile.py --gpupoold build-gpu/daemon/gpupoold
"""

import cProfile
import io
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)

from _common import arg_parser, percentile, run_pair, sync, torch_on, use_alloc_library, use_library  # noqa: E402
from weight_sync import initial_values, llama_layout, touch  # noqa: E402


def _setup(device, way):
    if way == "allocator":
        import gpupool.torch as gt

        gt.use_allocator()  # before the first CUDA allocation
    torch = torch_on(device)
    import gpupool.torch as gt

    gt.install(cpu=device == "cpu")
    return torch, gt


def _top(prof, n):
    if n <= 0:
        return "(not profiled)"
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    # The table only: from its header line on.
    lines = s.getvalue().splitlines()
    for i, ln in enumerate(lines):
        if ln.lstrip().startswith("ncalls"):
            return "\n".join(lines[i:])
    return s.getvalue()


def _steps(gt):
    """gpupool.torch's own step times (GPUPOOL_TORCH_PROFILE=1), median ms over the warm
    messages (profiled or not: the profiler slows the profiled ones)."""
    prof = getattr(gt, "_profile", lambda: {})()
    return {k: percentile([x / 1e6 for x in v[1:]], 50) for k, v in prof.items() if len(v) > 1}


def producer(device, way, messages, top, ctl):
    from multiprocessing.reduction import ForkingPickler

    torch, gt = _setup(device, way)
    layout = llama_layout()
    ts = initial_values(torch, layout, "bfloat16", device)
    if way == "empty":
        ts = [gt.empty_like(t).copy_(t) for t in ts]
    names = [n for n, _ in layout]
    prof = cProfile.Profile()
    wall = []
    for m in range(messages):
        ctl.recv()
        touch(ts, m + 1)
        sync(torch, device)
        profiled = top > 0 and m > 0 and m % 2 == 0
        if profiled:
            prof.enable()
        t0 = time.perf_counter_ns()
        b = ForkingPickler.dumps(dict(zip(names, ts)))
        t1 = time.perf_counter_ns()
        if profiled:
            prof.disable()
        elif m > 0:
            wall.append((t1 - t0) / 1e6)
        ctl.send_bytes(b)
    ctl.recv()
    ctl.send({"wall_ms": wall, "top": _top(prof, top), "steps": _steps(gt)})


def consumer(device, way, messages, top, ctl, out):
    import pickle

    torch, gt = _setup(device, way)
    prof = cProfile.Profile()
    wall, drop = [], []
    for m in range(messages):
        ctl.send("ready")
        b = ctl.recv_bytes()
        profiled = top > 0 and m > 0 and m % 2 == 0
        if profiled:
            prof.enable()
        t0 = time.perf_counter_ns()
        d = pickle.loads(b)
        sync(torch, device)
        t1 = time.perf_counter_ns()
        if profiled:
            prof.disable()
        elif m > 0:
            wall.append((t1 - t0) / 1e6)
        t2 = time.perf_counter_ns()
        del d
        if not profiled and m > 0:
            drop.append((time.perf_counter_ns() - t2) / 1e6)
    ctl.send("done")
    sender = ctl.recv()
    out.put({"sender": sender, "wall_ms": wall, "drop_ms": drop, "top": _top(prof, top), "steps": _steps(gt)})


def main():
    ap = arg_parser(__doc__)
    ap.add_argument("--messages", type=int, default=41, help="messages per way (the first is cold)")
    ap.add_argument("--ways", default="copy,empty,allocator", help="comma-separated ways")
    ap.add_argument("--top", type=int, default=25, help="functions listed per side (0: no cProfile at all)")
    args = ap.parse_args()
    use_library(args.library, args.gpupoold)
    use_alloc_library()
    os.environ["GPUPOOL_TORCH_PROFILE"] = "1"  # gpupool.torch's step times, in the spawned processes
    try:
        import torch
        import gpupool.torch  # noqa: F401
    except ImportError as e:
        print("torch_msg_profile: SKIP: %s" % e)
        return 77
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("torch_msg_profile: SKIP: torch %s sees no CUDA device" % torch.__version__)
        return 77
    from gpupool.testing import Daemon

    if cuda:
        dev = torch.device(args.device)
        pool = "name=gpu,kind=device,device=%d,capacity=%d,slab=%d" % (dev.index or 0, 12 << 30, 256 << 20)
        backend = "cuda"
    else:
        pool = "name=cpu,kind=host,capacity=%d,slab=%d" % (8 << 30, 256 << 20)
        backend = "host"
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    with Daemon(args.gpupoold, backend=backend, pools=[pool]) as d:
        os.environ["GPUPOOL_SOCKET"] = d.socket
        for way in [w.strip() for w in args.ways.split(",") if w.strip()]:
            if way == "allocator" and not cuda:
                print("torch_msg_profile: %s: skipped (use_allocator() is for CUDA)" % way)
                continue
            r = run_pair(ctx, producer, (args.device, way, args.messages, args.top),
                         consumer, (args.device, way, args.messages, args.top), timeout=600)
            s = r["sender"]
            print("torch_msg_profile: %s: dumps p50 %.3f ms, loads (+ stream sync) p50 %.3f ms, "
                  "del p50 %.3f ms (%d unprofiled warm messages)"
                  % (way, percentile(s["wall_ms"], 50), percentile(r["wall_ms"], 50),
                     percentile(r["drop_ms"], 50), len(r["wall_ms"])), flush=True)
            steps = dict(s["steps"], **r["steps"])
            print("torch_msg_profile: %s: step p50s (ms): %s" % (way, ", ".join(
                "%s %.3f" % kv for kv in sorted(steps.items()))), flush=True)
            print("--- %s: sender (ForkingPickler.dumps), by own time\n%s" % (way, s["top"]))
            print("--- %s: receiver (pickle.loads), by own time\n%s" % (way, r["top"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
