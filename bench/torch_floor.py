#!/usr/bin/env python3
"""The per-tensor floor of sending tensors through torch's pickling from Python: what the
torch and pickle calls that any Python-level reducer must make cost, with no daemon, no
socket and no CUDA IPC at all. bench/torch_queue.py's state dict (146 tensors) spends per
tensor what torch's own sharing spends; a target of 5x torch there is a budget per tensor,
and this says how much of it these calls take before gpupool does anything.

Steps, each timed over the 146-tensor Llama-shaped bf16 state dict of bench/weight_sync.py
(made on --device), per tensor, median of --reps repetitions:

- pickle, minimal reducer: ForkingPickler.dumps of the dict with a reducer that sends a
  tensor as a number (the cheapest a reducer can be; nothing is described).
- pickle, view described: the reducer gpupool.torch registers sends (storage, dtype, offset,
  size, stride, requires_grad); here the storage is a number too.
- unpickle, view described: pickle.loads of that, the rebuild function returning at once.
- storage from memory: a DLPack capsule of the storage's bytes (gpupool's bytes_capsule,
  whose deleter drops the hold) made into a torch storage (torch._C._from_dlpack, then
  untyped_storage()): what a receiver needs per storage to tie the hold to it.
- tensor on a storage: torch.empty((0,), dtype, device).set_(storage, offset, size,
  stride): the view the sender had, rebuilt.

    python3 bench/torch_floor.py [--device cuda:0|cpu] [--reps 20] [--table FILE]
"""

import argparse
import io
import os
import pickle
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)

from _common import percentile, torch_on  # noqa: E402
from weight_sync import initial_values, llama_layout  # noqa: E402


# The steps of the floor's sum (the others are gpupool's own, listed after it).
FLOOR_STEPS = ("pickle, view described", "unpickle, view described",
               "storage from memory (capsule + from_dlpack)", "tensor on a storage (empty().set_)")


def _rebuild_min(i):
    return i


def _rebuild_view(cls, storage, dtype, offset, size, stride, requires_grad):
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N (default) or cpu")
    ap.add_argument("--reps", type=int, default=20, help="repetitions of each step (median kept)")
    ap.add_argument("--table", help="also write the markdown table to this file")
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print("torch_floor: SKIP: torch is not installed for %s (%s)" % (sys.executable, e))
        return 77
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("torch_floor: SKIP: torch %s sees no CUDA device" % torch.__version__)
        return 77
    from multiprocessing.reduction import ForkingPickler

    from gpupool import _dlpack

    if hasattr(torch._C, "_from_dlpack"):
        from_dlpack = torch._C._from_dlpack
    else:
        from torch.utils.dlpack import from_dlpack
    torch = torch_on(args.device)
    layout = llama_layout()
    ts = initial_values(torch, layout, "bfloat16", args.device)
    d = dict(zip([n for n, _ in layout], ts))
    n = len(ts)
    dev = ts[0].device
    dl_dev = (_dlpack.kDLCUDA, dev.index or 0) if dev.type == "cuda" else (_dlpack.kDLCPU, 0)

    class Owner:  # what a capsule keeps referenced (a hold, in gpupool.torch)
        pass

    def dumps_with(reducer):
        saved = ForkingPickler._extra_reducers.get(torch.Tensor)
        ForkingPickler.register(torch.Tensor, reducer)
        try:
            buf = io.BytesIO()
            ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(d)
            return buf.getvalue()
        finally:
            if saved is None:
                del ForkingPickler._extra_reducers[torch.Tensor]
            else:
                ForkingPickler.register(torch.Tensor, saved)

    counter = iter(range(1 << 62))

    def reduce_min(t):
        return (_rebuild_min, (next(counter),))

    def reduce_view(t):
        return (_rebuild_view, (type(t), next(counter), t.dtype, t.storage_offset(), tuple(t.size()),
                                tuple(t.stride()), t.requires_grad))

    payload = dumps_with(reduce_view)
    owner = Owner()
    storages = [t.untyped_storage() for t in ts]

    def step_pickle_min():
        dumps_with(reduce_min)

    def step_pickle_view():
        dumps_with(reduce_view)

    def step_unpickle():
        pickle.loads(payload)

    made = []

    def step_storage():
        made.clear()
        for st in storages:
            cap = _dlpack.bytes_capsule(st.data_ptr(), dl_dev, st.nbytes(), owner)
            made.append(from_dlpack(cap).untyped_storage())

    def step_tensor():
        for t, st in zip(ts, storages):
            torch.empty((0,), dtype=t.dtype, device=dev).set_(st, t.storage_offset(), tuple(t.size()),
                                                             tuple(t.stride()))

    steps = [("pickle, minimal reducer", step_pickle_min),
             ("pickle, view described", step_pickle_view),
             ("unpickle, view described", step_unpickle),
             ("storage from memory (capsule + from_dlpack)", step_storage),
             ("tensor on a storage (empty().set_)", step_tensor)]

    # What gpupool.torch's C extension does per tensor, where it is loaded (GPUPOOL_FAST_MODULE
    # or the package's own): its views of a message's memory in one call, through DLPack and
    # through torch's C shim (torch_from_blob); the steps a receiver takes per storage besides
    # (its untyped_storage(), torch's weak reference to it); the sender's reducer per tensor.
    from gpupool import _native

    fast = _native.fast
    if fast is not None:
        from gpupool import _torch_recv, _torch_send
        from gpupool._torch_state import _DL_TYPES

        items = [(t.data_ptr(), _DL_TYPES[t.dtype], tuple(t.size()), tuple(t.stride()), owner) for t in ts]

        def step_views_dlpack():
            fast.setup_torch(0, 0, None, ())
            try:
                made[:] = fast.views(from_dlpack, dl_dev[0], dl_dev[1], items)
            finally:
                _torch_recv._setup_torch_shim()

        def step_views_shim():
            made[:] = fast.views(from_dlpack, dl_dev[0], dl_dev[1], items)

        def step_untyped_storage():
            for t in ts:
                t.untyped_storage()

        def step_weak_ref():
            from torch.multiprocessing.reductions import StorageWeakRef

            for st in storages:
                StorageWeakRef(st)

        def step_reduce():
            # The reducer in C with a message being pickled (its storages numbered in C).
            b = _torch_send._Batch(dev.type == "cpu")
            b.usable = True
            _torch_send._tls.batch = b
            try:
                for t in ts:
                    fast.reduce_tensor(t)
            finally:
                _torch_send._tls.batch = None

        steps.append(("gpupool._fast.views, through DLPack (one call for all)", step_views_dlpack))
        if _torch_recv._TORCH_SHIM:
            steps.append(("gpupool._fast.views, through torch_from_blob (one call for all)", step_views_shim))
        steps += [("untyped_storage() of a tensor", step_untyped_storage),
                  ("StorageWeakRef of a storage", step_weak_ref)]
        steps.append(("gpupool._fast.reduce_tensor in a message (C add)", step_reduce))
    lines = ["Per-tensor floor of a Python reducer: %d tensors on %s (torch %s), us per tensor, "
             "median of %d reps (bench/torch_floor.py)" % (
                 n, torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 torch.__version__, args.reps), "", "| step | us per tensor |", "| --- | --- |"]
    total = 0.0
    for name, fn in steps:
        fn()  # warm
        xs = []
        for _ in range(args.reps):
            t0 = time.perf_counter_ns()
            fn()
            xs.append((time.perf_counter_ns() - t0) / 1e3 / n)
        made.clear()
        p50 = percentile(xs, 50)
        if name in FLOOR_STEPS:
            total += p50
        lines.append("| %s | %.2f |" % (name, p50))
    lines.insert(len(lines) - (len(steps) - 5), "| sum of the last four (no daemon, no socket) | %.2f |" % total)
    text = "\n".join(lines)
    print(text)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
