#!/usr/bin/env python3
"""Refit on one GPU, colocated: trainer ranks (FSDP dim-0 shards of a Llama-3-8B-shaped bf16
model, separate processes) hand each version to an inference engine (a process of its own
whose parameters are fused qkv_proj / gate_up_proj, row-parallel o_proj / down_proj and
vocab-parallel embedding and head, as rank --rank of TP --tp holds them), three ways:

- (a) floor: raw copies of exactly the bytes the engine must receive, in the engine process,
  from a local source of the same layout: one flat cudaMemcpyAsync (torch copy_ of a uint8
  buffer) of all of them, and one copy_ per target tensor.
- (b) bucket: the RL-framework way on one GPU: each trainer rank flattens its shards into a
  bucket of its own (a copy), shared once with the engine over torch.multiprocessing (CUDA
  IPC, opened once: the most favourable case); per version the engine copies its slices
  out of the buckets into its parameters with copy_.
- (c) refit: each rank publishes its part with Client.publish_shard, from torch's allocator
  ("copy": publish_shard copies the shards into gpupool memory) or from
  gpupool.torch.empty shards ("inplace": no copy); the engine's plan.refit() writes the
  version into its parameters in place.

End to end: from the engine telling every rank "go" (the version's weights are in the
ranks' shards) to the engine's stream being done with the new weights in its parameters.
"refit alone": the engine's plan.refit() of a version already published (what the floor
measures). Per version after the first: allocations made by the engine's torch allocator,
GPU memory taken (cudaMemGetInfo), the daemon pool's reserve, and the engine's slab imports
(Client.slab_maps: each an IPC open of daemon memory). Every way's parameters are checked
against the others (per-tensor sums of the bf16 bits).

    python3 bench/refit.py --gpupoold build-gpu/daemon/gpupoold [--layers 32] [--world 4]
                           [--tp 1 --rank 0] [--versions 10]
"""

import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from _common import arg_parser, use_library  # noqa: E402

# Llama-3-8B.
H, NH, NKV, HD, FF, VOCAB = 4096, 32, 8, 128, 14336, 128256


def shapes(layers):
    s = {"embed": (VOCAB, H), "norm": (H,), "lm_head": (VOCAB, H)}
    for i in range(layers):
        p = "l%d." % i
        s.update({p + "q": (NH * HD, H), p + "k": (NKV * HD, H), p + "v": (NKV * HD, H),
                  p + "o": (H, NH * HD), p + "gate": (FF, H), p + "up": (FF, H), p + "down": (H, FF),
                  p + "in_norm": (H,), p + "post_norm": (H,)})
    return s


def fsdp_rows(n, rank, world):
    chunk = -(-n // world)
    return min(rank * chunk, n), min((rank + 1) * chunk, n)


def engine_layout(layers, tp, r):
    """{target: (shape, [(key, dim, global start, length, target offset)])}."""
    q, kv, ff, v = NH * HD // tp, NKV * HD // tp, FF // tp, VOCAB // tp
    out = {"embed": ((v, H), [("embed", 0, v * r, v, 0)]),
           "lm_head": ((v, H), [("lm_head", 0, v * r, v, 0)]),
           "norm": ((H,), [("norm", 0, 0, H, 0)])}
    for i in range(layers):
        p = "l%d." % i
        out[p + "qkv_proj"] = ((q + 2 * kv, H), [(p + "q", 0, q * r, q, 0), (p + "k", 0, kv * r, kv, q),
                                                 (p + "v", 0, kv * r, kv, q + kv)])
        out[p + "o_proj"] = ((H, q), [(p + "o", 1, q * r, q, 0)])
        out[p + "gate_up_proj"] = ((2 * ff, H), [(p + "gate", 0, ff * r, ff, 0),
                                                 (p + "up", 0, ff * r, ff, ff)])
        out[p + "down_proj"] = ((H, ff), [(p + "down", 1, ff * r, ff, 0)])
        out[p + "in_norm"] = ((H,), [(p + "in_norm", 0, 0, H, 0)])
        out[p + "post_norm"] = ((H,), [(p + "post_norm", 0, 0, H, 0)])
    return out


def trainer(rank, world, layers, socket, conn, bucket_q):
    import torch

    torch.cuda.set_device(0)
    import gpupool
    import gpupool.torch as gt

    c = gpupool.Client(socket, name="trainer%d" % rank)
    shp = shapes(layers)
    g = torch.Generator(device="cuda:0")
    g.manual_seed(1234 + rank)
    shards, gshards, rows = {}, {}, {}
    numel = 0
    for k, s in sorted(shp.items()):
        lo, hi = fsdp_rows(s[0], rank, world)
        if hi <= lo:
            continue
        rows[k] = (lo, hi, s)
        t = torch.randn((hi - lo,) + tuple(s[1:]), generator=g, device="cuda:0").to(torch.bfloat16)
        shards[k] = t
        e = gt.empty(*t.shape, dtype=t.dtype, device="cuda:0", client=c)
        e.copy_(t)
        gshards[k] = e
        numel += t.numel()
    bucket = torch.empty(numel, dtype=torch.bfloat16, device="cuda:0")
    offsets, off = {}, 0
    for k, t in shards.items():
        offsets[k] = (off, tuple(t.shape), rows[k][0], rows[k][2])
        off += t.numel()
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    conn.send(("ready", numel * 2))
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        if cmd[0] == "share_bucket":
            bucket_q.put((rank, bucket, offsets))
            conn.send("shared")
        elif cmd[0] == "bucket":  # flatten: the shards into the bucket
            for k, t in shards.items():
                o, shape, _, _ = offsets[k]
                bucket[o:o + t.numel()].view(shape).copy_(t)
            torch.cuda.synchronize()
            conn.send("done")
        elif cmd[0] in ("copy", "inplace"):
            src = shards if cmd[0] == "copy" else gshards
            parts = {k: (t, (slice(rows[k][0], rows[k][1]),), rows[k][2]) for k, t in src.items()}
            try:
                done = c.publish_shard("policy", parts, rank=rank, world=world, version=cmd[1],
                                       stream=stream)
            except gpupool.GpupoolError as e:
                conn.send(("error", str(e)))
                continue
            conn.send(("published", done))
    c.close()


def main():
    ap = arg_parser(__doc__)
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (Llama-3-8B: 32)")
    ap.add_argument("--world", type=int, default=4, help="trainer ranks (FSDP)")
    ap.add_argument("--tp", type=int, default=1, help="the engine's tensor-parallel degree")
    ap.add_argument("--rank", type=int, default=0, help="the engine's TP rank")
    ap.add_argument("--versions", type=int, default=10, help="versions per way (the first is cold)")
    ap.add_argument("--modes", default="inplace,copy", help="refit trainer modes, in order: "
                    "inplace (gpupool.torch.empty shards), copy (torch allocator shards)")
    args = ap.parse_args()
    use_library(args.library, args.gpupoold)
    try:
        import torch
    except ImportError:
        print("SKIP: torch is not installed")
        return 77
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 77
    import torch.multiprocessing as mp
    import gpupool
    from gpupool.testing import Daemon

    torch.cuda.set_device(0)
    shp = shapes(args.layers)
    model_bytes = sum(2 * _numel(s) for s in shp.values())
    layout = engine_layout(args.layers, args.tp, args.rank)
    engine_bytes = sum(2 * _numel(s) for s, _ in layout.values())
    # The trainers' gpupool shards (inplace), and two versions of copies (copy: the version
    # published and the next), with room for each rank's bundle to be a slab of its own.
    cap = (4 * model_bytes + (8 << 30)) >> 30
    daemon = Daemon(binary=args.gpupoold, backend="cuda",
                    pools=("name=gpu0,kind=device,device=0,capacity=%dG,slab=1G,keep_dedicated=16"
                           % cap,)).start()
    ctx = mp.get_context("spawn")
    bucket_q = ctx.Queue()
    pipes, procs = [], []
    results = {}
    try:
        for r in range(args.world):
            a, b = ctx.Pipe()
            p = ctx.Process(target=trainer, args=(r, args.world, args.layers, daemon.socket, b, bucket_q))
            p.start()
            pipes.append(a)
            procs.append(p)
        for a in pipes:
            tag, _ = a.recv()
            assert tag == "ready"
        dev = torch.cuda.get_device_name(0)
        print("device: %s; torch %s; model: Llama-3-8B shapes, %d layers, %.2f GB bf16; trainer: "
              "FSDP dim-0 over %d ranks; engine: TP rank %d of %d, %.2f GB to receive"
              % (dev, torch.__version__, args.layers, model_bytes / 1e9, args.world, args.rank,
                 args.tp, engine_bytes / 1e9), flush=True)
        params = {k: torch.zeros(s, dtype=torch.bfloat16, device="cuda:0") for k, (s, _) in layout.items()}
        ptrs = {k: t.data_ptr() for k, t in params.items()}
        stream = torch.cuda.Stream()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        # (a) the floor.
        flat_src = torch.empty(engine_bytes, dtype=torch.uint8, device="cuda:0")
        flat_dst = torch.empty(engine_bytes, dtype=torch.uint8, device="cuda:0")
        flat, per = [], []
        for _ in range(args.versions):
            with torch.cuda.stream(stream):
                ev0.record(stream)
                flat_dst.copy_(flat_src)
                ev1.record(stream)
            ev1.synchronize()
            flat.append(ev0.elapsed_time(ev1))
        del flat_src, flat_dst
        srcs = {k: torch.empty_like(t) for k, t in params.items()}
        for _ in range(args.versions):
            with torch.cuda.stream(stream):
                ev0.record(stream)
                for k, t in params.items():
                    t.copy_(srcs[k])
                ev1.record(stream)
            ev1.synchronize()
            per.append(ev0.elapsed_time(ev1))
        del srcs
        torch.cuda.empty_cache()
        results["floor_flat_ms"] = statistics.median(flat[1:])
        results["floor_per_tensor_ms"] = statistics.median(per[1:])

        # (b) buckets shared once, flattened and copied out each version.
        for a in pipes:
            a.send(("share_bucket",))
        buckets = {}
        for _ in pipes:
            r, bucket, offsets = bucket_q.get(timeout=30)
            buckets[r] = (bucket, offsets)
        for a in pipes:
            assert a.recv() == "shared"
        copies = []  # (dst view, src view) of every intersection
        for k, (s, pieces) in layout.items():
            for key, dim, gs, ln, toff in pieces:
                for r, (bucket, offsets) in buckets.items():
                    if key not in offsets:
                        continue
                    o, shape, lo, _ = offsets[key]
                    n = _numel(shape)
                    shard = bucket[o:o + n].view(shape)
                    hi = lo + shape[0]
                    if dim == 0:
                        a_, b_ = max(lo, gs), min(hi, gs + ln)
                        if b_ > a_:
                            copies.append((params[k].narrow(0, toff + a_ - gs, b_ - a_),
                                           shard[a_ - lo:b_ - lo]))
                    else:
                        copies.append((params[k][lo:hi].narrow(1, toff, ln), shard[:, gs:gs + ln]))
        e2e, eng = [], []
        for v in range(args.versions):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for a in pipes:
                a.send(("bucket",))
            for a in pipes:
                assert a.recv() == "done"
            t1 = time.perf_counter()
            with torch.cuda.stream(stream):
                for d, s_ in copies:
                    d.copy_(s_)
            stream.synchronize()
            t2 = time.perf_counter()
            e2e.append((t2 - t0) * 1e3)
            eng.append((t2 - t1) * 1e3)
        results["bucket_e2e_ms"] = statistics.median(e2e[1:])
        results["bucket_engine_copy_ms"] = statistics.median(eng[1:])
        results["bucket_copies"] = len(copies)
        want = _sums(params)
        del copies, buckets
        for t in params.values():
            t.zero_()

        # (c) refit, from torch's allocator ("copy") and from gpupool memory ("inplace").
        torch.cuda.synchronize()
        engine_before = torch.cuda.memory_allocated()
        c = gpupool.Client(daemon.socket, name="engine")
        targets = {}
        for k, (s, pieces) in layout.items():
            ps = []
            for key, dim, gs, ln, _ in pieces:
                sl = (slice(gs, gs + ln),) if dim == 0 else (slice(None), slice(gs, gs + ln))
                ps.append((key, sl))
            targets[k] = (params[k], ps, pieces[0][1])
        version = 0
        modes = []
        for mode in args.modes.split(","):
            try:
                version = _refit_mode(mode, c, pipes, targets, params, ptrs, want, stream, args,
                                      version, results)
                modes.append(mode)
            except Exception as e:  # noqa: BLE001 - said, and the other modes still run
                print("(c) refit %s: FAILED: %s" % (mode, e), flush=True)
                results["refit_%s_error" % mode] = str(e)
                for a in pipes:  # the answers still owed
                    while a.poll(3):
                        a.recv()
                        if not a.poll(0):
                            break
                version += 2 * args.versions + 2
        results["engine_torch_bytes_added"] = torch.cuda.memory_allocated() - engine_before
        c.close()
        _report(results, modes, engine_bytes, args)
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        for a in pipes:
            try:
                a.send(("quit",))
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        daemon.stop()
    return 0


def _refit_mode(mode, c, pipes, targets, params, ptrs, want, stream, args, version, results):
    import torch

    plan = None
    e2e, alone, allocs, taken, slabs = [], [], [], [], []
    for i in range(args.versions):
        for t in params.values():
            t.zero_()
        torch.cuda.synchronize()
        st0 = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
        free0 = torch.cuda.mem_get_info()[0]
        maps0 = c.slab_maps
        reserved0 = _reserved(c)
        # End to end: go, the ranks publish, the engine refits as soon as it is in.
        version += 1
        t0 = time.perf_counter()
        for a in pipes:
            a.send((mode, version))
        if plan is None:
            plan = c.refit_plan("policy", targets, newer_than=version - 1, timeout=30)
        got = plan.refit(newer_than=version - 1, timeout=30, stream=stream)
        stream.synchronize()
        t1 = time.perf_counter()
        for a in pipes:
            tag, what = a.recv()
            if tag != "published":
                raise RuntimeError("a trainer rank could not publish: %s" % what)
        assert got == version, (got, version)
        e2e.append((t1 - t0) * 1e3)
        # Refit alone: a version already published.
        for t in params.values():
            t.zero_()
        version += 1
        for a in pipes:
            a.send((mode, version))
        for a in pipes:
            tag, what = a.recv()
            if tag != "published":
                raise RuntimeError("a trainer rank could not publish: %s" % what)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = plan.refit(newer_than=version - 1, timeout=30, stream=stream)
        stream.synchronize()
        t1 = time.perf_counter()
        assert got == version, (got, version)
        alone.append((t1 - t0) * 1e3)
        allocs.append(torch.cuda.memory_stats().get("allocation.all.allocated", 0) - st0)
        taken.append(free0 - torch.cuda.mem_get_info()[0])
        slabs.append((c.slab_maps - maps0, _reserved(c) - reserved0))
    got_sums = _sums(params)
    for k, t in params.items():
        assert t.data_ptr() == ptrs[k], k
    bad = [k for k in want if want[k] != got_sums[k]]
    if bad:
        raise SystemExit("refit (%s): %d targets differ from the bucket way's, first %s"
                         % (mode, len(bad), bad[0]))
    # The replay alone, of the version last refitted: its GPU time (queued behind a
    # spinning kernel, so the host's enqueueing is hidden) and the host's enqueueing.
    gpu_ms, host_ms = _replay(plan, stream, args.versions)
    results["refit_%s_replay_gpu_ms" % mode] = gpu_ms
    results["refit_%s_replay_host_ms" % mode] = host_ms
    info = plan.info()
    results["refit_%s_gathered" % mode] = info["gathered"]
    # The same replay with every copy a cudaMemcpy2DAsync of its own (no gather kernel).
    os.environ["GPUPOOL_REFIT_GATHER"] = "0"
    try:
        gpu_ms, host_ms = _replay(plan, stream, args.versions)
    finally:
        del os.environ["GPUPOOL_REFIT_GATHER"]
    results["refit_%s_replay1_gpu_ms" % mode] = gpu_ms
    results["refit_%s_replay1_host_ms" % mode] = host_ms
    plan.close()
    results["refit_%s_e2e_ms" % mode] = statistics.median(e2e[1:])
    results["refit_%s_alone_ms" % mode] = statistics.median(alone[1:])
    results["refit_%s_torch_allocs_after_first" % mode] = sum(allocs[1:])
    results["refit_%s_gpu_bytes_taken_after_first" % mode] = sum(taken[1:])
    results["refit_%s_imports_after_first" % mode] = sum(m for m, _ in slabs[1:])
    results["refit_%s_imports_first" % mode] = slabs[0][0]
    results["refit_%s_pool_reserved_after_first" % mode] = sum(r for _, r in slabs[1:])
    results["refit_%s_copies" % mode] = info["copies"]
    results["refit_%s_plans" % mode] = info["plans"]
    return version


def _report(results, modes, engine_bytes, args):
    gb = engine_bytes / 1e9
    fl = results["floor_flat_ms"]
    print("engine receives %.2f GB per version; medians over %d warm versions" % (gb, args.versions - 1))
    print("(a) floor, one flat copy:          %8.2f ms  %6.0f GB/s" % (fl, gb / fl * 1e3))
    print("(a) floor, copy_ per tensor:       %8.2f ms" % results["floor_per_tensor_ms"])
    print("(b) bucket, end to end:            %8.2f ms  (engine's %d copies alone %.2f ms)"
          % (results["bucket_e2e_ms"], results["bucket_copies"], results["bucket_engine_copy_ms"]))
    for mode in modes:
        e, al = results["refit_%s_e2e_ms" % mode], results["refit_%s_alone_ms" % mode]
        print("(c) refit %-7s end to end:       %8.2f ms  %.2fx floor, (b)/(c) %.2fx; refit alone "
              "%.2f ms %.2fx floor (%d copies, %d plan); per version after the first: "
              "%d slab imports (IPC opens; %d for the first), %d torch allocations, "
              "%d bytes more reserved by the daemon's pool, %d GPU bytes taken"
              % (mode, e, e / fl, results["bucket_e2e_ms"] / e, al, al / fl,
                 results["refit_%s_copies" % mode], results["refit_%s_plans" % mode],
                 results["refit_%s_imports_after_first" % mode],
                 results["refit_%s_imports_first" % mode],
                 results["refit_%s_torch_allocs_after_first" % mode],
                 results["refit_%s_pool_reserved_after_first" % mode],
                 results["refit_%s_gpu_bytes_taken_after_first" % mode]))
        print("    replay of the plan alone (no get): GPU %.2f ms (%.2fx floor), host enqueue %.2f ms; "
              "%d of its copies in the gather kernel"
              % (results["refit_%s_replay_gpu_ms" % mode], results["refit_%s_replay_gpu_ms" % mode] / fl,
                 results["refit_%s_replay_host_ms" % mode], results["refit_%s_gathered" % mode]))
        print("    the same replay, every copy a cudaMemcpy2DAsync: GPU %.2f ms (%.2fx floor), host "
              "enqueue %.2f ms"
              % (results["refit_%s_replay1_gpu_ms" % mode], results["refit_%s_replay1_gpu_ms" % mode] / fl,
                 results["refit_%s_replay1_host_ms" % mode]))
    print("engine's torch allocator, after every refit against before the first plan: %+d bytes "
          "(its parameters: %.2f GB); gpupool memory it maps is the trainers'"
          % (results["engine_torch_bytes_added"], gb))

def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _sums(params):
    import torch

    return {k: int(t.view(torch.int16).to(torch.int64).sum().item()) for k, t in params.items()}


def _replay(plan, stream, n):
    """Median GPU and host milliseconds of gpupool_refit(plan) for the version plan last got."""
    import ctypes

    import torch
    from gpupool import _lib, _refit

    L = _refit._L()
    b = _lib.BundleP()
    s = stream.cuda_stream
    _lib.check(L.gpupool_bundle_get(plan._client._conn.usable(), plan._name, plan.version - 1, 0,
                                    _lib.READ_ONLY | _lib.KEEP_MAPPED, s, ctypes.byref(b)), "replay get")
    gpu, host = [], []
    try:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(n):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(20_000_000)  # ~10 ms of spinning: every copy is queued by then
                e0.record(stream)
                t0 = time.perf_counter()
                _lib.check(L.gpupool_refit(plan._plan, b, s), "replay")
                host.append((time.perf_counter() - t0) * 1e3)
                e1.record(stream)
            e1.synchronize()
            gpu.append(e0.elapsed_time(e1))
    finally:
        L.gpupool_bundle_release(b, s)
    return statistics.median(gpu), statistics.median(host)


def _reserved(c):
    return sum(p.get("reserved", 0) for p in c.stats()["pools"])


if __name__ == "__main__":
    sys.exit(main())
