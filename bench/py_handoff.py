#!/usr/bin/env python3
"""Python producer -> consumer handoff of torch tensors: gpupool vs torch.multiprocessing.

For each size, a producer process hands N tensors, one at a time, to a consumer process, and
the consumer measures from the moment the producer starts the handoff (gpupool: publish;
torch.multiprocessing: Queue.put) to the moment it holds a tensor it can use, with the data
ready (after a synchronise of its stream). Both processes share CLOCK_MONOTONIC
(time.perf_counter_ns), so the two ends' timestamps compare directly. The tensors are
produced before the clock starts: what is measured is the handoff, not the fill.

- gpupool: the producer allocates in gpupool memory, fills through a torch view on its
  stream, and publishes in place; the consumer gets it by name on a stream of its own and
  imports it with torch.from_dlpack (no copy on either side).
- torch.multiprocessing: the producer puts a CUDA tensor on a torch.multiprocessing Queue
  (CUDA IPC handles underneath); the consumer takes it off. The producer keeps each tensor
  alive until the consumer is done with it, as torch requires.

Then a persistence check: a producer publishes and exits; a consumer that got the tensor
before the exit keeps reading it, and a consumer that starts after the exit gets it.

The script starts its own gpupoold (--gpupoold, socket in a temporary directory) and finds
libgpupool-client next to it in a build tree (or at --library / $GPUPOOL_LIBRARY).
--device cpu runs the same comparison with CPU tensors on the daemon's host backend.

    python3 bench/py_handoff.py --gpupoold build/daemon/gpupoold --sizes 1M,64M --iters 200
"""

import json
import multiprocessing as mp
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from _common import arg_parser, percentile, pool_spec, run_pair, sync, torch_on, use_library  # noqa: E402


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def fmt_size(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return "%d %s" % (n // div, unit)
    return "%d B" % n


def _arrived(x, n, i, ctl, lat):
    """On a consumer's receipt of tensor i: records the latency since the t0 the producer
    sends, and says whether x holds i where checked (both ends, n elements)."""
    t1 = time.perf_counter_ns()
    t0 = ctl.recv()
    lat.append((t1 - t0) / 1e3)
    return x.numel() == n and float(x[0]) == float(i) and float(x[-1]) == float(i)


# --- gpupool ---------------------------------------------------------------------------------
def gp_producer(socket, device, nbytes, iters, prefix, ctl):
    import gpupool

    torch = torch_on(device)
    n = nbytes // 4
    c = gpupool.Client(socket, name="bench-producer")
    gp_dev = device if device.startswith("cuda") else "cpu"
    stream = torch.cuda.current_stream() if device.startswith("cuda") else None
    for i in range(iters):
        t = c.alloc((n,), "float32", device=gp_dev)
        x = torch.from_dlpack(t)
        x.fill_(float(i))
        sync(torch, device)
        ctl.recv()  # the consumer is ready for tensor i
        t0 = time.perf_counter_ns()
        c.publish("%s/%d" % (prefix, i), t, stream=stream)
        ctl.send(t0)
        del x
        t.release()  # the name holds the buffer now
    ctl.recv()
    c.close()


def gp_consumer(socket, device, nbytes, iters, prefix, ctl, out):
    import gpupool

    torch = torch_on(device)
    n = nbytes // 4
    c = gpupool.Client(socket, name="bench-consumer")
    cuda = device.startswith("cuda")
    stream = torch.cuda.Stream() if cuda else None
    lat, bad = [], 0
    for i in range(iters):
        name = "%s/%d" % (prefix, i)
        ctl.send("ready")
        if cuda:
            with torch.cuda.stream(stream):
                t = c.get(name, timeout=60, stream=stream)
                x = torch.from_dlpack(t)
                stream.synchronize()
        else:
            t = c.get(name, timeout=60)
            x = torch.from_dlpack(t)
        bad += not _arrived(x, n, i, ctl, lat)
        del x
        t.release()
        c.unpublish(name)
    ctl.send("done")
    c.close()
    out.put({"lat_us": lat, "bad": bad})


# --- torch.multiprocessing -------------------------------------------------------------------
def tmp_producer(device, nbytes, iters, q, ctl):
    torch = torch_on(device)
    n = nbytes // 4
    for i in range(iters):
        x = torch.full((n,), float(i), dtype=torch.float32, device=device)
        if not device.startswith("cuda"):
            x.share_memory_()  # outside the clock, as gpupool's fill is
        sync(torch, device)
        ctl.recv()
        t0 = time.perf_counter_ns()
        q.put(x)
        ctl.send(t0)
        ctl.recv()  # consumer done with it: only now may the producer drop it
        del x
    ctl.recv()


def tmp_consumer(device, nbytes, iters, q, ctl, out):
    torch = torch_on(device)
    n = nbytes // 4
    cuda = device.startswith("cuda")
    lat, bad = [], 0
    for i in range(iters):
        ctl.send("ready")
        x = q.get()
        if cuda:
            torch.cuda.current_stream().synchronize()
        bad += not _arrived(x, n, i, ctl, lat)
        del x
        ctl.send("consumed")
    ctl.send("done")
    out.put({"lat_us": lat, "bad": bad})


# --- persistence -----------------------------------------------------------------------------
def persist_producer(socket, device, nbytes, name):
    import gpupool

    torch = torch_on(device)
    n = nbytes // 4
    c = gpupool.Client(socket, name="persist-producer")
    t = c.alloc((n,), "float32", device=device if device.startswith("cuda") else "cpu")
    x = torch.from_dlpack(t)
    x.copy_(torch.arange(n, dtype=torch.float32, device=device))
    c.publish(name, t)
    sync(torch, device)
    # Exit without unpublishing or releasing: the process goes, the tensor must not.


def persist_consumer(socket, device, nbytes, name, ctl, out):
    import gpupool

    torch = torch_on(device)
    n = nbytes // 4
    want = torch.arange(n, dtype=torch.float32, device=device)
    c = gpupool.Client(socket, name="persist-consumer")
    t = c.get(name, timeout=60)
    x = torch.from_dlpack(t)
    ok_before = bool(torch.equal(x, want))
    ctl.send("got")
    ctl.recv()  # the producer has exited
    ok_after = bool(torch.equal(x, want))
    x.add_(1.0)  # still writable, still mapped
    sync(torch, device)
    ok_write = bool(torch.equal(x, want + 1.0))
    x.sub_(1.0)
    sync(torch, device)
    del x
    t.release()
    c.close()
    out.put({"before_exit": ok_before, "after_exit": ok_after, "write_after_exit": ok_write})


def late_consumer(socket, device, nbytes, name, out):
    import gpupool

    torch = torch_on(device)
    n = nbytes // 4
    c = gpupool.Client(socket, name="late-consumer")
    t = c.get(name, timeout=10)
    x = torch.from_dlpack(t)
    ok = bool(torch.equal(x, torch.arange(n, dtype=torch.float32, device=device)))
    del x
    t.release()
    c.unpublish(name)
    c.close()
    out.put({"late_get": ok})


def persistence_check(ctx, socket, device, nbytes):
    name = "bench/persist"
    a, b = ctx.Pipe()
    out = ctx.Queue()
    cons = ctx.Process(target=persist_consumer, args=(socket, device, nbytes, name, b, out))
    prod = ctx.Process(target=persist_producer, args=(socket, device, nbytes, name))
    prod.start()
    cons.start()
    a.recv()  # consumer holds the tensor
    prod.join(60)
    producer_rc = prod.exitcode
    a.send("producer exited")
    res = out.get(timeout=60)
    cons.join(30)
    late = ctx.Process(target=late_consumer, args=(socket, device, nbytes, name, out))
    late.start()
    res.update(out.get(timeout=60))
    late.join(30)
    res["producer_exit_code"] = producer_rc
    return res


# --- main ------------------------------------------------------------------------------------
def main():
    ap = arg_parser(__doc__)
    ap.add_argument("--sizes", default="1M,64M", help="tensor sizes in bytes (K/M/G suffixes)")
    ap.add_argument("--iters", type=int, default=200, help="handoffs per size and method")
    ap.add_argument("--warmup", type=int, default=10, help="leading handoffs not counted")
    ap.add_argument("--skip-torch-mp", action="store_true", help="measure gpupool only")
    args = ap.parse_args()

    use_library(args.library, args.gpupoold)

    import torch

    from gpupool.testing import Daemon

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("py_handoff: torch %s sees no CUDA device (use --device cpu to compare on the "
                 "host backend)" % torch.__version__)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    iters = args.iters + args.warmup
    dev_index = torch.device(args.device).index or 0 if cuda else 0
    cap = max(1 << 30, 4 * max(sizes))
    pool = pool_spec(cuda, dev_index, cap, 256 << 20)

    import torch.multiprocessing as tmp

    ctx = mp.get_context("spawn")
    tctx = tmp.get_context("spawn")
    results = {"device": args.device, "torch": torch.__version__, "iters": args.iters,
               "sizes": {}}
    if cuda:
        results["gpu"] = torch.cuda.get_device_name(dev_index)
    with Daemon(args.gpupoold, backend="cuda" if cuda else "host", pools=[pool]) as d:
        print("gpupoold %s backend on %s; %s; torch %s; %d handoffs per point (+%d warm-up)"
              % ("cuda" if cuda else "host", d.socket, results.get("gpu", "cpu"),
                 torch.__version__, args.iters, args.warmup), flush=True)
        for nbytes in sizes:
            row = {}
            gp = run_pair(ctx, gp_producer, (d.socket, args.device, nbytes, iters,
                                             "bench/%d" % nbytes),
                          gp_consumer, (d.socket, args.device, nbytes, iters,
                                        "bench/%d" % nbytes), timeout=600)
            row["gpupool"] = gp
            if not args.skip_torch_mp:
                q = tctx.Queue()
                row["torch.multiprocessing"] = run_pair(
                    tctx, tmp_producer, (args.device, nbytes, iters, q),
                    tmp_consumer, (args.device, nbytes, iters, q), timeout=600)
            for v in row.values():
                lat = v.pop("lat_us")[args.warmup:]
                v.update(p50_us=percentile(lat, 50), p99_us=percentile(lat, 99),
                         mean_us=statistics.fmean(lat), n=len(lat))
            results["sizes"][fmt_size(nbytes)] = row
        persist = persistence_check(ctx, d.socket, args.device, min(sizes))
        results["persistence"] = persist

    print()
    print("%-9s %-22s %10s %10s %10s %6s" % ("size", "method", "p50 us", "p99 us", "mean us",
                                              "bad"))
    for size, row in results["sizes"].items():
        for method, v in row.items():
            print("%-9s %-22s %10.1f %10.1f %10.1f %6d" % (size, method, v["p50_us"],
                                                          v["p99_us"], v["mean_us"], v["bad"]))
        if "torch.multiprocessing" in row:
            g, t = row["gpupool"], row["torch.multiprocessing"]
            row["ratio_p50"] = t["p50_us"] / g["p50_us"]
            row["ratio_p99"] = t["p99_us"] / g["p99_us"]
            print("%-9s %-22s %10.2fx %9.2fx   (torch.multiprocessing / gpupool; >1: gpupool "
                  "faster)" % (size, "ratio", row["ratio_p50"], row["ratio_p99"]))
    ok = all(persist.get(k) for k in ("before_exit", "after_exit", "write_after_exit",
                                       "late_get"))
    print()
    print("consumers after the producer exited (exit code %s): held tensor read %s, written %s;"
          " new consumer's get %s -> %s" % (
              persist.get("producer_exit_code"),
              "ok" if persist.get("after_exit") else "FAILED",
              "ok" if persist.get("write_after_exit") else "FAILED",
              "ok" if persist.get("late_get") else "FAILED", "PASS" if ok else "FAIL"))
    bad = sum(v["bad"] for row in results["sizes"].values() for k, v in row.items()
              if isinstance(v, dict))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if ok and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
