#!/usr/bin/env python3
"""Producer->consumer handoff of a CUDA tensor with torch.multiprocessing, the peer that
gpupool_bench's handoff figures are compared with.

A producer process fills a uint8 CUDA tensor, synchronizes, takes t0 and puts the tensor on
a Queue (spawn context). The consumer, already blocked in get(), receives it (torch opens the
CUDA IPC handle and waits on the producer's event while unpickling), synchronizes its current
stream and takes t1. The latency is t1 - t0 on CLOCK_MONOTONIC (time.monotonic_ns), the
clock gpupool_bench uses too. The consumer drops the tensor and acknowledges before the next
round, so the producer never frees memory a consumer still maps.

Prints, per size (4 KiB, 1 MiB, 64 MiB), a human line and machine-readable lines:
    BENCH torch_handoff_<bytes>_p50_us <value>
    BENCH torch_handoff_<bytes>_p99_us <value>
    BENCH torch_handoff_<bytes>_first_us <value>
Exit status 77 when torch or a CUDA device is missing.
"""

import argparse
import sys
import time

SIZES = [(4096, "4KiB"), (1 << 20, "1MiB"), (64 << 20, "64MiB")]


def percentile(values, pct):
    v = sorted(values)
    if not v:
        return 0.0
    i = int(pct / 100.0 * (len(v) - 1) + 0.5)
    return v[min(i, len(v) - 1)]


def consumer(tensors, acks):
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.current_stream()
    acks.put("ready")
    while True:
        item = tensors.get()
        if item is None:
            break
        tensor, t0 = item
        stream.synchronize()
        t1 = time.monotonic_ns()
        if tensor.device.type != "cuda" or tensor.data_ptr() == 0:
            acks.put(("error", "received tensor is not a CUDA tensor"))
            return
        latency_us = (t1 - t0) / 1e3
        # Drop every reference before acknowledging: the producer may then free the block.
        del tensor, item
        acks.put(("ok", latency_us))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200, help="measured handoffs per size")
    ap.add_argument("--warmup", type=int, default=10, help="unmeasured handoffs per size")
    args = ap.parse_args()

    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        print(f"SKIP: torch is not importable ({e})")
        return 77
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device visible to torch")
        return 77

    torch.cuda.set_device(0)
    ctx = mp.get_context("spawn")
    tensors, acks = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(tensors, acks), daemon=True)
    proc.start()
    if acks.get(timeout=300) != "ready":
        print("FAIL: consumer did not start", file=sys.stderr)
        return 1

    print(f"torch {torch.__version__} handoff on {torch.cuda.get_device_name(0)}", flush=True)
    for size, label in SIZES:
        first = None
        lat = []
        for i in range(args.warmup + args.iters):
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
            t.fill_(i & 0xFF)
            torch.cuda.synchronize()
            # The consumer is back in get() once it acknowledged the previous round; give it
            # the same head start gpupool_bench gives its consumer.
            time.sleep(0.002)
            t0 = time.monotonic_ns()
            tensors.put((t, t0))
            status, value = acks.get(timeout=300)
            if status != "ok":
                print(f"FAIL: {value}", file=sys.stderr)
                return 1
            del t
            if i == 0:
                first = value
            if i >= args.warmup:
                lat.append(value)
        p50, p99 = percentile(lat, 50), percentile(lat, 99)
        print(f"torch.multiprocessing handoff {label:<6} p50 {p50:9.1f} us  p99 {p99:9.1f} us"
              f"  first {first:9.1f} us  (n={len(lat)})", flush=True)
        print(f"BENCH torch_handoff_{size}_p50_us {p50:.3f}")
        print(f"BENCH torch_handoff_{size}_p99_us {p99:.3f}")
        print(f"BENCH torch_handoff_{size}_first_us {first:.3f}", flush=True)
    tensors.put(None)
    proc.join(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
