"""What one CUDA allocation costs under gpupool.torch.use_allocator() against torch's caching
allocator: torch.empty(n, device=...) and its free, timed in a loop, each allocator in a fresh
process (an allocator is chosen before the first CUDA allocation).

    python bench/torch_alloc.py --gpupoold build-gpu/daemon/gpupoold [--json out.json]

Reports the median and p90 of one allocate+free pair per size (4 KiB, 1 MiB, 64 MiB), after a
warm-up, and of a mixed pattern (64 live tensors of sizes from 4 KiB to 12 MiB, on two streams,
allocated and then freed, per allocate+free pair): both allocators serve them from a cache in
the process (use_allocator(): blocks of gpupool buffers it keeps); for use_allocator() also the
requests its cache made to gpupoold during the timed loops (segments allocated and given back).
"""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import arg_parser, percentile, pool_spec, use_alloc_library, use_library  # noqa: E402

SIZES = (4 << 10, 1 << 20, 64 << 20)
ITERS = 2000
MIXED = (4 << 10, 64 << 10, 1 << 20, 3 << 20, 12 << 20, 256 << 10, 16 << 10, 8 << 20)
MIXED_LIVE = 64
MIXED_ROUNDS = 100


def measure(which, device, sock):
    import torch

    if which == "gpupool":
        import gpupool.torch as gt

        gt.use_allocator(socket=sock)
    dev = torch.device(device)
    out = {}
    for size in SIZES:
        n = size // 4
        for _ in range(50):
            t = torch.empty(n, device=dev)
            del t
        torch.cuda.synchronize(dev)
        xs = []
        for _ in range(ITERS):
            t0 = time.perf_counter_ns()
            t = torch.empty(n, device=dev)
            del t
            xs.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize(dev)
        out[size] = {"p50_us": percentile(xs, 50), "p90_us": percentile(xs, 90)}
    # A step's temporaries: many live at once, of mixed sizes, half on a second stream.
    side = torch.cuda.Stream(dev)
    xs = []
    for r in range(MIXED_ROUNDS + 5):
        t0 = time.perf_counter_ns()
        live = []
        for i in range(MIXED_LIVE):
            if i % 2:
                with torch.cuda.stream(side):
                    live.append(torch.empty(MIXED[i % len(MIXED)] // 4, device=dev))
            else:
                live.append(torch.empty(MIXED[i % len(MIXED)] // 4, device=dev))
        del live
        if r >= 5:
            xs.append((time.perf_counter_ns() - t0) / 1e3 / MIXED_LIVE)
    torch.cuda.synchronize(dev)
    out["mixed"] = {"p50_us": percentile(xs, 50), "p90_us": percentile(xs, 90)}
    if which == "gpupool":
        c = gt.allocator_counts()
        out["counts"] = c
    return out


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2], sys.argv[3], sys.argv[4])))
        return 0
    ap = arg_parser(__doc__)
    args = ap.parse_args()
    use_library(args.library, args.gpupoold)
    use_alloc_library()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from gpupool.testing import Daemon

    dev_index = int(args.device.split(":")[1]) if ":" in args.device else 0
    results = {}
    with Daemon(binary=args.gpupoold, backend="cuda",
                pools=[pool_spec(True, dev_index, 8 << 30, 1 << 30)]) as d:
        for which in ("torch", "gpupool"):
            env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                          "..", "python"))
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", which, args.device,
                                d.socket], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=600)
            if p.returncode != 0:
                sys.stderr.write(p.stderr.decode(errors="replace"))
                return 1
            results[which] = json.loads(p.stdout.decode().strip().splitlines()[-1])
    print("torch.empty + free, one pair (us)   caching p50/p90    gpupool p50/p90")
    for size in SIZES + ("mixed",):
        a, b = results["torch"][str(size)], results["gpupool"][str(size)]
        what = "%10d bytes" % size if size != "mixed" else "  mixed, 64 live"
        print("%s                     %7.1f / %7.1f   %7.1f / %7.1f"
              % (what, a["p50_us"], a["p90_us"], b["p50_us"], b["p90_us"]))
    c = results["gpupool"].get("counts", {})
    print("use_allocator(): %d allocations, %d segments allocated and %d given back by requests to "
          "gpupoold; %d segments (%.1f MiB) kept at the end"
          % (c.get("allocs", 0), c.get("daemon_allocs", 0), c.get("daemon_releases", 0),
             c.get("segments", 0), c.get("segment_bytes", 0) / 2**20))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
