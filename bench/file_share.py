#!/usr/bin/env python3
"""N consumer processes each bring the same large file to the GPU: a gpupool file object
against each process reading the file itself.

Methods (each run with N = 1, 4, 8 consumers at once, by default):
- gpupool: a publisher publishes the file once (Client.publish_file); each consumer maps it
  with Client.get_file_array (registered read-only with CUDA) and copies it to a device
  buffer of its own (torch copy_ from the mapping: pinned-speed DMA, no private host copy).
  The mapping is one page cache for every consumer.
- npload: each consumer np.load()s the file (a private host copy) and copies it to the GPU
  with torch.
- cupy: each consumer cupy.load()s it (NumPy load underneath, then a copy to the GPU).
  Skipped when CuPy is missing.

Measured per run: wall time from a common start (a barrier) to the last consumer holding the
data on the GPU, aggregate throughput N * size / that time, and the total PSS of the consumers
(/proc/PID/smaps_rollup, read by each consumer while every consumer still holds the data):
shared file pages count once in total, private copies N times. The page cache is warmed
before each method (the file is read once), so what is compared is getting data from RAM to
the GPU, not the disk.

--device cpu measures the host side alone (no GPU: gpupool maps and touches every page;
npload reads a private copy), which also runs on the host backend.

    python3 bench/file_share.py --gpupoold build-gpu/daemon/gpupoold \
        --library build-gpu/client/libgpupool-client.so --size 4G --consumers 1,4,8

Prints BENCH lines (file_share_<method>_<n>_gbps, _s, _pss_gib) and a Markdown table between
FILE_SHARE_TABLE_BEGIN and FILE_SHARE_TABLE_END. Exits 77 when --device cuda is asked for and
torch has no CUDA.
"""

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

NAME = "bench/file"


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def pss_bytes(pid="self"):
    """Proportional set size of a process, from /proc/PID/smaps_rollup (bytes)."""
    with open("/proc/%s/smaps_rollup" % pid) as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def make_npy(path, size):
    """A .npy file of `size` uint8 elements with a position-dependent pattern; returns the
    data's offset in the file (the header's length)."""
    import numpy as np

    a = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(size,))
    chunk = 1 << 26
    base = (np.arange(chunk, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)
    for o in range(0, size, chunk):
        n = min(chunk, size - o)
        a[o:o + n] = base[:n] ^ np.uint8((o // chunk) & 0xFF)
    a.flush()
    del a
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        if major == 1:
            np.lib.format.read_array_header_1_0(f)
        else:
            np.lib.format.read_array_header_2_0(f)
        return f.tell()


def warm(path):
    with open(path, "rb", buffering=0) as f:
        while f.readinto(bytearray(1 << 24)):
            pass


def checksum_host(a):
    import numpy as np

    return int(np.bitwise_xor.reduce(a[:: 1 << 20]))


def consumer(method, device, path, size, start_barrier, hold_barrier, out_q):
    """One consumer: bring the data where `device` says, report its time and PSS while every
    consumer holds its data, then let go."""
    try:
        import numpy as np

        torch = None
        if device == "cuda":
            import torch  # noqa: F811

            torch.cuda.init()
            torch.empty(1, device="cuda")  # context made before the clock starts
        keep = []
        start_barrier.wait()
        t0 = time.monotonic()
        if method == "gpupool":
            import gpupool

            c = gpupool.Client(name="file-consumer")
            keep.append(c)
            if device == "cuda":
                t = c.get_file_array(NAME, "uint8", device="cuda", timeout=30)
                keep.append(t)
                try:
                    src = torch.from_dlpack(t)  # the registered mapping, seen from the GPU
                    path_used = "dlpack (device view of the registered mapping)"
                except Exception as e:  # say so: the copy then goes through a host tensor
                    src = torch.from_numpy(np.array(t.numpy(), copy=False))
                    path_used = "host tensor (torch.from_dlpack refused: %s)" % (e,)
                print("gpupool consumer %d copy path: %s, src on %s, pinned=%s"
                      % (os.getpid(), path_used, src.device,
                         src.is_pinned() if src.device.type == "cpu" else "n/a"), flush=True)
                dst = torch.empty(size, dtype=torch.uint8, device="cuda")
                dst.copy_(src)
                torch.cuda.synchronize()
                keep.append(dst)
                check = int(dst[:: 1 << 20].cpu().numpy().astype(np.uint8).tolist()[-1])
            else:
                t = c.get_file_array(NAME, "uint8", timeout=30)
                keep.append(t)
                a = t.numpy()
                # Touch every page: what "having it in memory" costs on the host.
                check = int(a[:: 4096].sum())
                keep.append(a)
        elif method == "npload":
            a = np.load(path)
            keep.append(a)
            if device == "cuda":
                dst = torch.from_numpy(a).to("cuda")
                torch.cuda.synchronize()
                keep.append(dst)
                check = int(dst[:: 1 << 20].cpu().numpy().astype(np.uint8).tolist()[-1])
            else:
                check = int(a[:: 4096].sum())
        elif method == "cupy":
            import cupy

            dst = cupy.load(path)
            cupy.cuda.Device().synchronize()
            keep.append(dst)
            check = int(dst[:: 1 << 20].get().tolist()[-1])
        else:
            raise ValueError(method)
        t1 = time.monotonic()
        hold_barrier.wait()  # every consumer holds its data now
        pss = pss_bytes()
        out_q.put(("ok", t0, t1, pss, check))
        hold_barrier.wait()  # nobody lets go before every PSS was read
    except BaseException as e:  # reported to the parent, which fails the run
        out_q.put(("error", repr(e)))
        try:
            start_barrier.abort()
            hold_barrier.abort()
        except Exception:
            pass


def run(method, n, device, path, size, ctx):
    start_b = ctx.Barrier(n + 1)
    hold_b = ctx.Barrier(n)
    q = ctx.Queue()
    procs = [ctx.Process(target=consumer, args=(method, device, path, size, start_b, hold_b, q))
             for _ in range(n)]
    for p in procs:
        p.start()
    start_b.wait(timeout=600)
    t_start = time.monotonic()
    res = [q.get(timeout=1800) for _ in range(n)]
    for p in procs:
        p.join(timeout=600)
    errors = [r[1] for r in res if r[0] != "ok"]
    if errors:
        raise RuntimeError("%s with %d consumers failed: %s" % (method, n, errors[0]))
    t_end = max(r[2] for r in res)
    wall = t_end - t_start
    pss = sum(r[3] for r in res)
    return {"s": wall, "gbps": n * size / wall / 1e9, "pss_gib": pss / float(1 << 30)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpupoold", help="gpupoold binary (default: build-gpu/daemon/gpupoold, "
                    "else the one gpupool.testing finds)")
    ap.add_argument("--library", help="libgpupool-client.so (default: $GPUPOOL_LIBRARY)")
    ap.add_argument("--size", default="4G", help="file size (default 4G)")
    ap.add_argument("--consumers", default="1,4,8", help="consumer counts (default 1,4,8)")
    ap.add_argument("--methods", default="gpupool,npload,cupy")
    ap.add_argument("--device", choices=("cuda", "cpu", "auto"), default="auto")
    ap.add_argument("--dir", help="where to write the file (default: a temporary directory "
                    "under $TMPDIR; it must hold --size bytes)")
    args = ap.parse_args()

    size = parse_size(args.size)
    counts = [int(x) for x in args.consumers.split(",") if x]
    methods = [m for m in args.methods.split(",") if m]
    if args.library:
        os.environ["GPUPOOL_LIBRARY"] = os.path.abspath(args.library)
    device = args.device
    if device in ("auto", "cuda"):
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda and device == "cuda":
            print("SKIP: torch with CUDA is needed for --device cuda")
            return 77
        device = "cuda" if has_cuda else "cpu"
    if device == "cpu":
        methods = [m for m in methods if m != "cupy"]
    elif "cupy" in methods:
        try:
            import cupy  # noqa: F401
        except ImportError:
            print("BENCH_INFO cupy missing: its column stays empty")
            methods.remove("cupy")

    import gpupool
    from gpupool.testing import Daemon

    binary = args.gpupoold
    if not binary and os.path.exists(os.path.join(HERE, "..", "build-gpu", "daemon", "gpupoold")):
        binary = os.path.join(HERE, "..", "build-gpu", "daemon", "gpupoold")
    backend = "cuda" if device == "cuda" else "host"
    pools = () if device == "cuda" else ("name=main,kind=host,capacity=64M,slab=16M",)
    tmp = tempfile.mkdtemp(prefix="gpupool-file-bench-", dir=args.dir)
    daemon = Daemon(binary=binary, backend=backend, pools=pools).start()
    os.environ["GPUPOOL_SOCKET"] = daemon.socket
    results = {}
    try:
        path = os.path.join(tmp, "data.npy")
        t = time.monotonic()
        off = make_npy(path, size)
        print("BENCH_INFO file %s: %d bytes of data at offset %d, written in %.1f s"
              % (path, size, off, time.monotonic() - t), flush=True)
        if device == "cuda":
            import torch

            print("BENCH_INFO device %s" % torch.cuda.get_device_name(0), flush=True)
        with gpupool.Client(name="file-publisher") as pub:
            pub.publish_file(NAME, path, offset=off, length=size)
            ctx = mp.get_context("spawn")
            for m in methods:
                for n in counts:
                    warm(path)
                    r = run(m, n, device, path, size, ctx)
                    results[(m, n)] = r
                    for k in ("s", "gbps", "pss_gib"):
                        print("BENCH file_share_%s_%d_%s %.3f" % (m, n, k, r[k]), flush=True)
            pub.unpublish(NAME)
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    print("FILE_SHARE_TABLE_BEGIN")
    print("File to %s: %.1f GiB per consumer, page cache warm (aggregate GB/s = consumers x "
          "size / wall time; PSS = the consumers' total while all hold the data)\n"
          % ("GPU" if device == "cuda" else "host memory", size / float(1 << 30)))
    print("| consumers | " + " | ".join("%s GB/s | %s s | %s PSS GiB" % (m, m, m) for m in methods) + " |")
    print("| --- |" + " --- | --- | --- |" * len(methods))
    for n in counts:
        cells = []
        for m in methods:
            r = results.get((m, n))
            cells += ["%.1f" % r["gbps"], "%.2f" % r["s"], "%.2f" % r["pss_gib"]] if r else ["-"] * 3
        print("| %d | %s |" % (n, " | ".join(cells)))
    print("FILE_SHARE_TABLE_END")
    return 0


if __name__ == "__main__":
    sys.exit(main())
