#!/usr/bin/env python3
"""What reading DTensors costs a trainer rank: --world rank processes (a gloo process group on
CPU, the host backend) hold a Llama-shaped bf16 state dict of --layers layers as DTensors
(Shard(0) FSDP slices, norms replicated), and publish it version after version with
publish_shard, given the DTensors, against given the same local tensors as explicit
(tensor, slices, global_shape) with rank and world. The difference is the cost of deriving
every rank's slice and the publishing ranks from the placements (torch's
compute_local_shape_and_global_offset per tensor, cached per shape). The engine (rank 0 here,
after each version) checks one refit of the whole model against full_tensor().

    python3 bench/dtensor_publish.py --gpupoold build/daemon/gpupoold [--world 2]
                                     [--layers 16] [--versions 6]
"""

import datetime
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from _common import arg_parser, use_library  # noqa: E402

HIDDEN, KV, FF, VOCAB = 512, 128, 1408, 4096


def shapes(layers):
    out = {"embed": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = "layers.%d." % i
        out.update({p + "q": (HIDDEN, HIDDEN), p + "k": (KV, HIDDEN), p + "v": (KV, HIDDEN),
                    p + "o": (HIDDEN, HIDDEN), p + "gate": (FF, HIDDEN), p + "up": (FF, HIDDEN),
                    p + "down": (HIDDEN, FF), p + "in_norm": (HIDDEN,), p + "post_norm": (HIDDEN,)})
    out.update({"norm": (HIDDEN,), "head": (VOCAB, HIDDEN)})
    return out


def rank_main(rank, world, layers, versions, socket, store, out):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import gpupool
    from gpupool import _dtensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    sd = {k: distribute_tensor(torch.randn(s, generator=g).to(torch.bfloat16), mesh,
                               [Replicate()] if len(s) == 1 else [Shard(0)])
          for k, s in shapes(layers).items()}
    c = gpupool.Client(socket, name="rank%d" % rank)
    t0 = time.perf_counter()
    part, parts, mine = _dtensor.shard_part(sd, "bench")
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(20):
        t0 = time.perf_counter()
        _dtensor.shard_part(sd, "bench")
        warm.append(time.perf_counter() - t0)
    times = {"dtensor": [], "explicit": []}
    version = 0
    for _ in range(versions):
        for how in ("dtensor", "explicit"):
            version += 1
            dist.barrier()
            t0 = time.perf_counter()
            if how == "dtensor":
                c.publish_shard("bench", sd, version=version)
            else:
                c.publish_shard("bench", mine, part, parts, version)
            times[how].append(time.perf_counter() - t0)
            dist.barrier()  # the version is complete
    if rank == 0:
        whole = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in sd.items()}
        with c.refit_plan("bench", {k: (t, [k]) for k, t in whole.items()}) as plan:
            plan.refit()
    for k, t in sd.items():
        full = t.full_tensor()
        if rank == 0:
            assert torch.equal(whole[k].view(torch.int16), full.view(torch.int16)), k
    c.close()
    if rank == 0:
        nbytes = sum(v[0].numel() * 2 for v in mine.values())
        with open(out, "w") as f:
            f.write("%d tensors, rank 0 publishes %d slices (%.1f MB) as part %d of %d\n"
                    % (len(sd), len(mine), nbytes / 1e6, part, parts))
            f.write("deriving the slices from the DTensors: %.2f ms the first time, then "
                    "median %.2f ms, min %.2f ms\n" % (cold * 1e3, statistics.median(warm) * 1e3,
                                                       min(warm) * 1e3))
            for how, xs in times.items():
                f.write("publish_shard, %-8s: median %.2f ms, min %.2f ms over %d versions\n"
                        % (how, statistics.median(xs) * 1e3, min(xs) * 1e3, len(xs)))
            f.write("refit of the whole model into rank 0: bit-equal to full_tensor()\n")
    dist.destroy_process_group()


def main():
    ap = arg_parser(__doc__)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--versions", type=int, default=6)
    a = ap.parse_args()
    use_library(a.library, a.gpupoold)
    import torch.multiprocessing as mp

    from gpupool.testing import Daemon

    d = Daemon(binary=a.gpupoold, backend="host",
               pools=("name=main,kind=host,capacity=1G,slab=64M",)).start()
    try:
        tmp = tempfile.mkdtemp(prefix="gpupool-dtensor-bench-")
        out = os.path.join(tmp, "result")
        mp.spawn(rank_main, args=(a.world, a.layers, a.versions, d.socket,
                                  os.path.join(tmp, "store"), out), nprocs=a.world, join=True)
        with open(out) as f:
            sys.stdout.write(f.read())
    finally:
        d.stop()


if __name__ == "__main__":
    main()
