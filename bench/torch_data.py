#!/usr/bin/env python3
"""DataLoader batches to the GPU: torch's pin_memory=True against gpupool's PinnedLoader.

A DataLoader of 4 workers (persistent) makes batches of 64 samples of 3x224x224 float32
(38.5 MB a batch); the main process copies each batch to the GPU (non_blocking) and checks
it there, bit for bit, against what the dataset must have produced. Two ways, same dataset,
same run:

- torch: DataLoader(pin_memory=True): each worker stacks the batch into shared memory and
  sends its fd; the main process's pin_memory thread copies it into pinned memory.
- gpupool: gpupool.torch_data.PinnedLoader: each worker stacks the batch straight into a
  buffer of a host-NUMA pool (pinned) and sends a token; the main process views it.

Reported per way: batches per second to the GPU over the timed epoch (after one epoch of
warm-up, workers started), and the main process's CPU time per batch (time.process_time:
every thread of the process, the pin_memory thread included). The script starts its own
gpupoold (CUDA backend, a host-NUMA pool); exits 77 without torch, CUDA or a GPU whose
driver offers host-NUMA pools.

    python3 bench/torch_data.py --gpupoold build-gpu/daemon/gpupoold
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)

from _common import arg_parser, use_library  # noqa: E402

SHAPE = (3, 224, 224)


class Images:
    """Sample i is a fixed pattern plus i (float32): cheap to make, so that what is timed is
    the way batches travel, and checkable on the GPU."""

    def __init__(self, n):
        self.n = n
        self.base = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        if self.base is None:
            self.base = pattern(torch, "cpu")
        return self.base + float(i), i


def pattern(torch, device):
    return (torch.arange(SHAPE[0] * SHAPE[1] * SHAPE[2], device=device, dtype=torch.float32)
            .remainder_(1021.0).view(SHAPE))


def run_way(torch, loader, timed_batches, device):
    """(batches/s, main-process CPU ms per batch, bad batches) of the epoch after a warm-up."""
    base = pattern(torch, device)
    bad = 0
    for epoch in range(2):
        if epoch == 1:
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
        n = 0
        for x, idx in loader:
            g = x.to(device, non_blocking=True)
            i = idx.to(device, non_blocking=True)
            want = base.unsqueeze(0) + i.view(-1, 1, 1, 1).float()
            bad += int(not torch.equal(g, want))
            del x, g
            n += 1
        if epoch == 1:
            torch.cuda.synchronize()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert n == timed_batches, (n, timed_batches)
    return n / wall, cpu / n * 1e3, bad


def main():
    ap = arg_parser(__doc__)
    ap.add_argument("--batches", type=int, default=40, help="batches per epoch (default 40)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--table", help="also write the markdown table to this file")
    args = ap.parse_args()
    use_library(args.library, args.gpupoold)
    try:
        import torch
    except ImportError as e:
        print("torch_data: SKIP: torch is not installed for %s (%s)" % (sys.executable, e))
        return 77
    if not torch.cuda.is_available():
        print("torch_data: SKIP: torch %s sees no CUDA device" % torch.__version__)
        return 77
    from gpupool.testing import Daemon
    from gpupool.torch_data import PinnedLoader

    device = torch.device(args.device)
    torch.cuda.set_device(device)
    torch.cuda.init()
    ds = Images(args.batches * args.batch_size)
    bytes_per_batch = args.batch_size * 4 * SHAPE[0] * SHAPE[1] * SHAPE[2]
    cap = max(2 << 30, (args.workers * 4 + 8) * bytes_per_batch)
    pool = "name=pinned,kind=host-numa,device=%d,capacity=%d,slab=%d" % (
        device.index or 0, cap, 256 << 20)
    try:
        d = Daemon(args.gpupoold, backend="cuda", pools=[pool]).start()
    except RuntimeError as e:
        print("torch_data: SKIP: gpupoold cannot serve a host-NUMA pool here: %s" % e)
        return 77
    res = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
           "batch": [args.batch_size] + list(SHAPE), "workers": args.workers,
           "batches": args.batches}
    try:
        common = dict(batch_size=args.batch_size, num_workers=args.workers,
                      persistent_workers=True)
        ways = [("torch pin_memory=True",
                 lambda: torch.utils.data.DataLoader(ds, pin_memory=True, **common)),
                ("gpupool PinnedLoader",
                 lambda: PinnedLoader(ds, socket=d.socket, **common))]
        for name, make in ways:
            loader = make()
            bps, cpu_ms, bad = run_way(torch, loader, args.batches, device)
            del loader
            res[name] = {"batches_per_s": bps, "main_cpu_ms_per_batch": cpu_ms, "bad": bad}
            print("torch_data: %s: %.1f batches/s (%.2f GB/s), main process CPU %.2f ms a "
                  "batch, bad %d" % (name, bps, bps * bytes_per_batch / 1e9, cpu_ms, bad),
                  flush=True)
    finally:
        d.stop()
    t, g = res["torch pin_memory=True"], res["gpupool PinnedLoader"]
    lines = ["DataLoader to the GPU on %s (torch %s): %d workers, batches of %s float32 "
             "(%.1f MB), %d timed batches after a warm-up epoch" % (
                 res["gpu"], res["torch"], args.workers, "x".join(map(str, res["batch"])),
                 bytes_per_batch / 1e6, args.batches), "",
             "| way | batches/s | GB/s | main-process CPU ms / batch | bad |",
             "| --- | --- | --- | --- | --- |"]
    for name in ("torch pin_memory=True", "gpupool PinnedLoader"):
        r = res[name]
        lines.append("| %s | %.1f | %.2f | %.2f | %d |" % (
            name, r["batches_per_s"], r["batches_per_s"] * bytes_per_batch / 1e9,
            r["main_cpu_ms_per_batch"], r["bad"]))
    ratio = g["batches_per_s"] / t["batches_per_s"]
    cpu = t["main_cpu_ms_per_batch"] / max(g["main_cpu_ms_per_batch"], 1e-9)
    lines += ["", "gpupool / torch: %.2fx the batches per second, %.2fx less main-process CPU "
              "per batch. Target (issue 23): >= 1.3x the batches/s with less CPU: %s." % (
                  ratio, cpu, "met" if ratio >= 1.3 and cpu > 1 else "missed"), ""]
    text = "\n".join(lines)
    print()
    print(text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "torch-data-table.md"), "w") as f:
            f.write(text)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if t["bad"] == 0 and g["bad"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
