#!/usr/bin/env python3
"""Publish tensors for consumer.py to read in another process, without copies.

With torch and a GPU (and a daemon with a CUDA device pool) each tensor is allocated in
gpupool device memory, filled by a CUDA kernel through a torch view of it, and published in
place. Otherwise NumPy fills tensors in gpupool host memory (the daemon's host backend).
Values follow tensor_values() so the consumer can check them bit for bit.

    gpupoold --socket /tmp/gp.sock &
    python3 producer.py --socket /tmp/gp.sock --name demo --count 3 --size 1048576
    python3 consumer.py --socket /tmp/gp.sock --name demo --count 3 --size 1048576

The published names outlive this process: the daemon keeps each tensor until a consumer
(or anyone) unpublishes it and the last holder lets go.

These examples import the installed package: `pip install "./python[numpy]"` first. From a
build tree without installing, point Python at the sources and the built library:
PYTHONPATH=python GPUPOOL_LIBRARY=build/release/client/libgpupool-client.so.
"""

import argparse
import sys
import time

import gpupool


def tensor_values(xp, n, i, device=None):
    """Tensor i of the sequence: sin((k + 1) * (i + 1) / n) for k in 0..n-1, float32.
    xp is torch or numpy; the producer and the consumer compute it the same way."""
    if xp.__name__ == "torch":
        k = xp.arange(1, n + 1, device=device, dtype=xp.float32)
        return xp.sin(k * float(i + 1) / float(n))
    k = xp.arange(1, n + 1, dtype=xp.float32)
    return xp.sin(k * xp.float32(i + 1) / xp.float32(n))


def pick_mode(client, want):
    """'torch' when asked or when torch sees a GPU and the daemon has a device pool."""
    if want == "numpy":
        return "numpy", None
    has_device_pool = [p for p in client.pools() if p["kind"] == "device"]
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if gpu and has_device_pool:
        return "torch", "cuda:%d" % has_device_pool[0]["device"]
    if want == "torch":
        raise SystemExit("--mode torch needs torch with CUDA and a gpupoold with a device pool "
                         "(torch GPU: %s, device pools: %d)" % (gpu, len(has_device_pool)))
    return "numpy", None


def demo_parser(doc, name_help, count_help):
    """The options producer.py and consumer.py share: they must agree on names and sizes."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--socket", help="gpupoold socket (default: $GPUPOOL_SOCKET or the "
                                     "system default)")
    ap.add_argument("--name", default="demo", help=name_help)
    ap.add_argument("--count", type=int, default=3, help=count_help)
    ap.add_argument("--size", type=int, default=1 << 20, help="elements per tensor (float32)")
    ap.add_argument("--mode", choices=("auto", "torch", "numpy"), default="auto")
    return ap


def main():
    ap = demo_parser(__doc__, "name prefix; tensors are NAME/0, NAME/1...",
                     "how many tensors to publish")
    ap.add_argument("--hold", type=float, default=0.0,
                    help="seconds to stay connected after publishing (0: exit at once)")
    args = ap.parse_args()

    with gpupool.Client(args.socket, name="producer.py") as client:
        mode, device = pick_mode(client, args.mode)
        n = args.size
        for i in range(args.count):
            name = "%s/%d" % (args.name, i)
            t0 = time.perf_counter()
            if mode == "torch":
                import torch

                # Produce straight into gpupool memory: a torch view of the buffer, filled
                # by CUDA kernels on torch's current stream. publish() records the ready
                # event in that stream, so consumers wait for the kernels, not the CPU.
                buf = client.alloc((n,), "float32", device=device)
                x = torch.from_dlpack(buf)
                x.copy_(tensor_values(torch, n, i, device))
                client.publish(name, x)
                where = "%s, buffer %d" % (device, buf.buffer_id)
            else:
                buf = client.alloc((n,), "float32", device="cpu")
                buf.numpy()[...] = tensor_values(__import__("numpy"), n, i)
                client.publish(name, buf)
                where = "host memory, buffer %d" % buf.buffer_id
            dt = time.perf_counter() - t0
            print("published %s: %d float32 (%.1f MiB) in %s, no copy, %.2f ms"
                  % (name, n, n * 4 / 2.0 ** 20, where, dt * 1e3), flush=True)
            buf.release()  # the name holds the buffer from now on
        if args.hold > 0:
            time.sleep(args.hold)
    print("producer done (%s mode); the names stay published after this process exits" % mode)


if __name__ == "__main__":
    try:
        main()
    except gpupool.GpupoolError as e:
        sys.exit("producer.py: %s" % e)
