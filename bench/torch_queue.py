#!/usr/bin/env python3
"""PyTorch code as it is: CUDA tensors through a torch.multiprocessing Queue, with and
without gpupool.torch.install(), same run, bit-exact checked.

Workloads: one CUDA tensor of 1 MiB, one of 64 MiB, the 146-tensor Llama-shaped bf16 state
dict of bench/weight_sync.py put on the Queue as one dict, and a dict of 10,000 float32
tensors of 1 KiB (what a message of many small storages costs). Per version the producer
writes new values (and their checksum, on the GPU), synchronizes, and puts the object; the
consumer gets it, synchronizes its stream and checks the checksum outside the timed part.
Timed: from the producer starting put() to the consumer holding the tensors with their
data ready (time.perf_counter_ns, CLOCK_MONOTONIC, shared by both processes). Timed apart:
how long the consumer's `del` of the message takes (its storages' last references go; the
p50 is printed as "receiver lets go"), and, for the gpupool ways, how many requests the
daemon handled for it (counted with its request counter outside the timed part: one Release
for all the holds of a message); and how many of a way's Opens gpupoold read before their
message's Share (the sender does not wait for the Share's reply; such an Open waits for it).

Ways: "torch" (torch's own CUDA IPC reductions); "install()" (both processes call
gpupool.torch.install() before anything is put: the tensors, made by torch's caching
allocator, are copied once into gpupool buffers on the sender's stream, buffers the sender
reuses for the next message once the daemon says no one holds them); "install() + empty"
(the same, with the producer's tensors made by gpupool.torch.empty: shared in place, no
copy); "install() + use_allocator()" (both processes also call use_allocator(): every CUDA
tensor is a block of a gpupool segment the process keeps, shared in place; a message names
each segment once, however many of its tensors lie in it). Every message is one Share request
and one Open request, whatever its number of tensors. Ratios are torch / the way. The script starts its own gpupoold (CUDA backend) and
exits 77 without torch, CUDA or gpupool.torch.install (this module's absence is said).

A first row measures the channel alone: a 64-byte object (no tensor) through the same Queue,
the floor under every way. --profile records the time of each step of gpupool.torch's send
(feeder thread) and receive (GPUPOOL_TORCH_PROFILE=1) and prints their medians per way.
--workloads picks rows (comma-separated prefixes, e.g. "1 MiB,queue").

    python3 bench/torch_queue.py --gpupoold build-gpu/daemon/gpupoold
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)

from _common import arg_parser, percentile, run_pair, sync, torch_on, use_library  # noqa: E402
from weight_sync import checksum, initial_values, llama_layout, touch  # noqa: E402

MiB = 1 << 20
WAYS = (("torch", False), ("install()", True), ("install() + empty", "empty"),
        ("install() + use_allocator()", "allocator"))
FLOOR = "queue alone (64 B, no tensor)"
WORKLOADS = {
    FLOOR: lambda: [],
    "1 MiB tensor": lambda: [("t", (MiB // 4,))],
    "64 MiB tensor": lambda: [("t", (64 * MiB // 4,))],
    "146-tensor state dict": llama_layout,
    "10000-tensor dict (1 KiB each)": lambda: [("t%d" % i, (256,)) for i in range(10000)],
}
DTYPES = {FLOOR: "float32", "1 MiB tensor": "float32", "64 MiB tensor": "float32",
          "146-tensor state dict": "bfloat16", "10000-tensor dict (1 KiB each)": "float32"}


def _setup(device, install):
    if install == "allocator":
        import gpupool.torch as gt

        gt.use_allocator()  # before the first CUDA allocation
    torch = torch_on(device)
    if install:
        import gpupool.torch as gt

        gt.install()
    return torch


def _medians(install):
    """Per recorded step of gpupool.torch, the median in ms (the first message left out)."""
    if not install:
        return {}
    import gpupool.torch as gt

    prof = getattr(gt, "_profile", lambda: {})()
    return {k: percentile([x / 1e6 for x in v[1:]], 50) for k, v in prof.items() if len(v) > 1}


def producer(device, workload, versions, install, q, ctl):
    torch = _setup(device, install)
    if workload == FLOOR:
        for v in range(1, versions + 1):
            ctl.recv()
            t0 = time.perf_counter_ns()
            q.put(b"x" * 64)
            ctl.send((t0, 0))
        ctl.recv()
        ctl.send({})
        return
    layout = WORKLOADS[workload]()
    ts = initial_values(torch, layout, DTYPES[workload], device)
    if install == "empty":
        import gpupool.torch as gt

        ts = [gt.empty_like(t).copy_(t) for t in ts]  # gpupool memory from the start
        sync(torch, device)
    names = [n for n, _ in layout]
    for v in range(1, versions + 1):
        ctl.recv()  # the consumer is done with the previous version
        touch(ts, v)
        want = checksum(torch, ts)
        sync(torch, device)
        t0 = time.perf_counter_ns()
        q.put(ts[0] if len(ts) == 1 else dict(zip(names, ts)))
        ctl.send((t0, want))
    ctl.recv()
    ctl.send(_medians(install))


def consumer(device, workload, versions, install, q, ctl, out):
    torch = _setup(device, install)
    lat, drop, bad, reqs = [], [], 0, []
    for v in range(1, versions + 1):
        ctl.send("ready")
        obj = q.get()
        sync(torch, device)
        t1 = time.perf_counter_ns()
        t0, want = ctl.recv()
        lat.append((t1 - t0) / 1e3)
        if workload != FLOOR:
            tensors = list(obj.values()) if isinstance(obj, dict) else [obj]
            bad += checksum(torch, tensors) != want
            del tensors
        # Letting go of the message (its storages' last references): not part of the
        # handoff's time, but the receiving thread's (torch: its IPC ref counts; gpupool: a
        # Release per hold).
        c = None
        if install and workload != FLOOR:
            import gpupool.torch as gt

            c = gt._client()
            r0 = c.stats()["requests"]
            r1 = c.stats()["requests"]
        t2 = time.perf_counter_ns()
        del obj
        drop.append((time.perf_counter_ns() - t2) / 1e3)
        if c is not None:
            # What a Stats costs the counter itself, taken off (the producer waits meanwhile).
            reqs.append((c.stats()["requests"] - r1) - (r1 - r0))
    ctl.send("done")
    sender = ctl.recv()
    out.put({"lat_us": lat, "drop_us": drop, "bad": bad, "sender": sender,
             "receiver": _medians(install), "drop_requests": reqs})


def main():
    ap = arg_parser(__doc__)
    ap.add_argument("--versions", type=int, default=30, help="handoffs per way (>= 2)")
    ap.add_argument("--table", help="also write the markdown table to this file")
    ap.add_argument("--profile", action="store_true",
                    help="print the median of each step of gpupool.torch's send and receive")
    ap.add_argument("--workloads", help="comma-separated prefixes of the rows to run (default: all)")
    args = ap.parse_args()
    if args.profile:
        os.environ["GPUPOOL_TORCH_PROFILE"] = "1"  # read by gpupool.torch in the spawned processes
    use_library(args.library, args.gpupoold)
    try:
        import torch
    except ImportError as e:
        print("torch_queue: SKIP: torch is not installed for %s (%s)" % (sys.executable, e))
        return 77
    if not torch.cuda.is_available():
        print("torch_queue: SKIP: torch %s sees no CUDA device" % torch.__version__)
        return 77
    try:
        import gpupool.torch as gt
        gt.install  # noqa: B018
    except (ImportError, AttributeError) as e:
        print("torch_queue: SKIP: gpupool.torch.install is not in this tree (%s)" % e)
        return 77
    from gpupool.testing import Daemon

    dev = torch.device(args.device)
    pool = "name=gpu,kind=device,device=%d,capacity=%d,slab=%d" % (dev.index or 0, 12 << 30,
                                                                     256 << 20)
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "versions": args.versions, "workloads": {}}
    import gpupool

    with Daemon(args.gpupoold, backend="cuda", pools=[pool]) as d, gpupool.Client(d.socket, name="bench") as st:
        os.environ["GPUPOOL_SOCKET"] = d.socket  # inherited by the spawned processes
        picks = [w.strip() for w in args.workloads.split(",")] if args.workloads else None
        for wl in WORKLOADS:
            if picks and not any(wl.startswith(p) for p in picks):
                continue
            row = res["workloads"][wl] = {}
            versions = args.versions if "dict" not in wl else max(2, args.versions // 3)
            for way, install in (WAYS[:1] if wl == FLOOR else WAYS):
                q = ctx.Queue()
                waited = st.stats().get("opens_waited", 0)
                r = run_pair(ctx, producer, (args.device, wl, versions, install, q),
                             consumer, (args.device, wl, versions, install, q), timeout=600,
                             join_s=60)
                lat = r["lat_us"]
                row[way] = {"cold_ms": lat[0] / 1e3, "p50_ms": percentile(lat[1:], 50) / 1e3,
                            "p99_ms": percentile(lat[1:], 99) / 1e3, "bad": r["bad"],
                            "n": len(lat), "drop_p50_ms": percentile(r["drop_us"][1:], 50) / 1e3}
                if r.get("drop_requests"):
                    row[way]["drop_requests_p50"] = percentile(r["drop_requests"], 50)
                # Opens the daemon read before their message's Share (a receiver quicker than
                # the daemon): they waited for it.
                row[way]["opens_waited"] = st.stats().get("opens_waited", 0) - waited
                print("torch_queue: %s, %s: cold %.3f ms, warm p50 %.3f ms, p99 %.3f ms, bad %d; "
                      "receiver lets go in %.3f ms (p50)%s%s"
                      % (wl, way, row[way]["cold_ms"], row[way]["p50_ms"], row[way]["p99_ms"],
                         r["bad"], row[way]["drop_p50_ms"],
                         ", %g daemon requests (p50)" % row[way]["drop_requests_p50"]
                         if "drop_requests_p50" in row[way] else "",
                         "; %d of %d Opens waited for their Share" % (row[way]["opens_waited"], len(lat))
                         if install else ""), flush=True)
                steps = dict(r.get("sender") or {}, **(r.get("receiver") or {}))
                if steps:
                    row[way]["steps_ms"] = steps
                    print("torch_queue: %s, %s: step p50s (ms): %s" % (wl, way, ", ".join(
                        "%s %.3f" % kv for kv in sorted(steps.items()))), flush=True)
    lines = ["torch.multiprocessing Queue on %s (torch %s): warm p50 / p99 in ms, cold = "
             "first handoff; x = torch's p50 / the way's" % (res["gpu"], res["torch"]), "",
             "| workload | torch | install() (copy) | x | install() + empty (no copy) | x "
             "| install() + use_allocator() | x "
             "| cold: torch / copy / no copy | receiver lets go: torch / copy / no copy | bad |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    # The targets: x = torch's p50 / the way's, per workload and way.
    targets = {"1 MiB tensor": {"copy": 2.0, "no copy": 2.0, "use_allocator()": 2.0},
               "64 MiB tensor": {"copy": 1.0},
               "146-tensor state dict": {"copy": 3.0, "no copy": 5.0, "use_allocator()": 5.0}}
    verdicts = []
    for wl, row in res["workloads"].items():
        if wl == FLOOR:
            t = row["torch"]
            lines.append("| %s | %.3f / %.3f | | | | | | | %.3f | | |" % (wl, t["p50_ms"], t["p99_ms"], t["cold_ms"]))
            continue
        t, g, e, a = row["torch"], row["install()"], row["install() + empty"], row["install() + use_allocator()"]
        rg, re_, ra = t["p50_ms"] / g["p50_ms"], t["p50_ms"] / e["p50_ms"], t["p50_ms"] / a["p50_ms"]
        lines.append("| %s | %.3f / %.3f | %.3f / %.3f | %.2fx | %.3f / %.3f | %.2fx | %.3f / %.3f | %.2fx "
                     "| %.3f / %.3f / %.3f | %.3f / %.3f / %.3f | %d |"
                     % (wl, t["p50_ms"], t["p99_ms"], g["p50_ms"], g["p99_ms"], rg, e["p50_ms"],
                        e["p99_ms"], re_, a["p50_ms"], a["p99_ms"], ra, t["cold_ms"], g["cold_ms"], e["cold_ms"],
                        t["drop_p50_ms"], g["drop_p50_ms"], e["drop_p50_ms"],
                        t["bad"] + g["bad"] + e["bad"] + a["bad"]))
        if wl == "146-tensor state dict":
            for name, x in (("copy", g), ("no copy", e)):
                ok = "met" if x["drop_p50_ms"] <= t["drop_p50_ms"] else "missed"
                verdicts.append("letting go of the dict no slower than torch (%s): %s (%.3f against "
                                "%.3f ms)" % (name, ok, x["drop_p50_ms"], t["drop_p50_ms"]))
        if wl in targets:
            for name, ratio in (("copy", rg), ("no copy", re_), ("use_allocator()", ra)):
                if name in targets[wl]:
                    want = targets[wl][name]
                    verdicts.append("%s >= %gx (%s): %s (%.2fx)" % (
                        wl, want, name, "met" if ratio >= want else "missed", ratio))
    if verdicts:
        lines += ["", "Targets: " + "; ".join(verdicts) + "."]
    lines.append("")
    text = "\n".join(lines)
    print()
    print(text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "torch-queue-table.md"), "w") as f:
            f.write(text)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    bad = sum(v["bad"] for row in res["workloads"].values() for v in row.values())
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
