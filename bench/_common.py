"""What the Python benchmarks that pit gpupool against torch.multiprocessing share
(py_handoff.py, weight_sync.py): finding libgpupool-client, the bench pool's spec, a process
pair over a pipe, torch on the device asked for, and the percentiles they report."""

import argparse
import os


def arg_parser(doc):
    """The options every such benchmark takes (--gpupoold, --library, --device, --json), the
    first paragraph of doc as the description."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpupoold", required=True, help="path of the gpupoold binary")
    ap.add_argument("--library", help="libgpupool-client.so (default: $GPUPOOL_LIBRARY, else "
                                      "../client/libgpupool-client.so next to --gpupoold)")
    ap.add_argument("--device", default="cuda:0", help="cuda:N (default) or cpu")
    ap.add_argument("--json", help="also write the results to this file")
    return ap


def use_library(library, gpupoold):
    """Point $GPUPOOL_LIBRARY (inherited by the spawned processes) at library, else keep the
    environment's, else take ../client/libgpupool-client.so next to gpupoold in a build tree."""
    lib = library or os.environ.get("GPUPOOL_LIBRARY")
    if not lib:
        guess = os.path.join(os.path.dirname(os.path.abspath(gpupoold)), "..", "client",
                             "libgpupool-client.so")
        if os.path.exists(guess):
            lib = os.path.abspath(guess)
    if lib:
        os.environ["GPUPOOL_LIBRARY"] = lib


def use_alloc_library():
    """Point $GPUPOOL_TORCH_ALLOC_LIBRARY (unless set) at libgpupool-torch-alloc.so next to
    $GPUPOOL_LIBRARY, for the benchmarks that run gpupool.torch.use_allocator()."""
    lib = os.environ.get("GPUPOOL_LIBRARY", "")
    alloc_lib = os.path.join(os.path.dirname(lib), "libgpupool-torch-alloc.so")
    if lib and os.path.exists(alloc_lib):
        os.environ.setdefault("GPUPOOL_TORCH_ALLOC_LIBRARY", alloc_lib)


def pool_spec(cuda, dev_index, capacity, slab):
    """The pool "bench": device memory of GPU dev_index, or host memory when not cuda."""
    if cuda:
        return "name=bench,kind=device,device=%d,capacity=%d,slab=%d" % (dev_index, capacity, slab)
    return "name=bench,kind=host,capacity=%d,slab=%d" % (capacity, slab)


def percentile(xs, p):
    """The p-th percentile of xs, interpolated between the two nearest ranks."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def torch_on(device):
    """torch, with device (cuda:N or cpu) made current."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    return torch


def sync(torch, device):
    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()


def run_pair(ctx, prod, prod_args, cons, cons_args, timeout, join_s=30, role="producer"):
    """Runs prod(*prod_args, pipe end) and cons(*cons_args, other end, out queue) in processes
    of ctx and returns what cons puts on the queue; raises when either exits non-zero (role
    names prod in that message)."""
    a, b = ctx.Pipe()
    out = ctx.Queue()
    p = ctx.Process(target=prod, args=prod_args + (a,))
    c = ctx.Process(target=cons, args=cons_args + (b, out))
    p.start()
    c.start()
    try:
        res = out.get(timeout=timeout)
    finally:
        for proc in (c, p):
            proc.join(join_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if p.exitcode not in (0, None) or c.exitcode not in (0, None):
        raise RuntimeError("%s exited %s, consumer exited %s" % (role, p.exitcode, c.exitcode))
    return res
