#!/usr/bin/env python3
"""Broadcast of a state dict from GPU 0 to GPUs 1..3 with torch.distributed (NCCL): the peer of
bench/copy_bench.c's broadcast mode (the gpupool copy engine), same tensors.

The state dict: Llama-3-8B-shaped (hidden 4096, MLP 14336, 8 KV heads of 128, vocabulary 128256,
32 layers), tied embeddings: 290 bf16 tensors, 15.0 GB, the list copy_bench.c lays out. Rank 0
fills it with random bits; every rank (one process per GPU, torch.multiprocessing spawn) holds
its own tensors. Two ways, each timed on rank 0 from a barrier after a synchronize to a barrier
after every rank's synchronize, median of 5 runs after one warm-up:
  per-tensor  dist.broadcast of each of the 290 tensors (what trainers do per parameter);
  bucket      one dist.broadcast of a flat buffer of all of them (NCCL's best case; the flatten
              and unflatten copies are not counted).
Each rank's tensors are then checked against rank 0's (per-tensor sums of the int32 view and of
each word xor its neighbour, all-gathered): bit-exact or the script fails.

Prints "BENCH key value" lines and a markdown table (also appended to --table FILE).
Exit 77 when torch, CUDA or two GPUs are missing.
"""
import argparse
import os
import socket
import statistics
import sys
import time


def layout():
    h, inter, kv, vocab = 4096, 14336, 1024, 128256
    out = [(vocab, h)]
    for _ in range(32):
        out += [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    out.append((h,))
    return out


def digest(torch, t):
    """Sums of the int32 words and of each word xor its neighbour, a chunk at a time (the
    temporaries of a whole 15 GB bucket would not fit next to it)."""
    w = t.reshape(-1).view(torch.int32)
    out = torch.zeros(2, dtype=torch.int64, device=w.device)
    step = 1 << 26
    for i in range(0, w.numel(), step):
        c = w[i:i + step]
        out[0] += c.sum(dtype=torch.int64)
        out[1] += (c[1:] ^ c[:-1]).sum(dtype=torch.int64)
    return out


def rank_main(rank, world, port, runs, q):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    shapes = layout()
    ts = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    total = sum(t.numel() * t.element_size() for t in ts)
    g = torch.Generator(device="cuda")
    g.manual_seed(1234)
    for t in ts:
        w = t.view(torch.int16)
        if rank == 0:
            w.random_(-32768, 32767, generator=g)
        else:
            w.fill_(0)
    flat = torch.empty(total // 2, dtype=torch.bfloat16, device="cuda")
    if rank == 0:
        torch.cat([t.reshape(-1) for t in ts], out=flat)
    torch.cuda.synchronize()

    def timed(fn):
        out = []
        for i in range(runs + 1):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            dist.barrier()
            if i > 0:
                out.append(time.perf_counter() - t0)
        return out

    def per_tensor():
        for t in ts:
            dist.broadcast(t, src=0)

    def bucket():
        dist.broadcast(flat, src=0)

    t_per = timed(per_tensor)
    t_bucket = timed(bucket)
    # Bit-exact: every rank's digests equal rank 0's, for the tensors and the bucket.
    dg = torch.stack([digest(torch, t) for t in ts] + [digest(torch, flat)])
    allg = [torch.empty_like(dg) for _ in range(world)]
    dist.all_gather(allg, dg)
    ok = all(torch.equal(allg[0], a) for a in allg)
    if rank == 0:
        q.put({"per": t_per, "bucket": t_bucket, "ok": ok, "total": total, "n": len(ts)})
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="processes, one per GPU (default 4)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--table", help="append the markdown table to this file")
    a = ap.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        print("SKIP: torch is missing (%s)" % e)
        return 77
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("SKIP: torch sees fewer than two GPUs")
        return 77
    world = min(a.ranks, torch.cuda.device_count())
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(rank_main, args=(world, free_port(), a.runs, q), nprocs=world, join=True)
    r = q.get()
    if not r["ok"]:
        print("FAIL: NCCL broadcast is not bit-exact on every rank")
        return 1
    per, bucket = statistics.median(r["per"]), statistics.median(r["bucket"])
    print("BENCH nccl_broadcast_per_tensor_ms %.2f" % (per * 1e3))
    print("BENCH nccl_broadcast_bucket_ms %.2f" % (bucket * 1e3))
    rows = ("| torch.distributed.broadcast (NCCL %s, torch %s), %d ranks, per tensor | %.1f | %.1f |\n"
            "| torch.distributed.broadcast (NCCL), one flat bucket | %.1f | %.1f |\n") % (
        ".".join(map(str, torch.cuda.nccl.version())), torch.__version__, world, per * 1e3,
        r["total"] / per / 1e9, bucket * 1e3, r["total"] / bucket / 1e9)
    print("%d tensors, %.2f GB, bit-exact on every rank" % (r["n"], r["total"] / 1e9))
    sys.stdout.write(rows)
    if a.table:
        with open(a.table, "a") as f:
            f.write(rows)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    sys.exit(main())
