#!/usr/bin/env python3
"""Weight sync: a trainer process hands a state dict to an inference process, version after
version, three ways, on one GPU, bit-exact checked.

Workloads: a Llama-3.2-1B-shaped bf16 state dict (embedding 128256x2048, 16 layers of
q/k/v/o projections, gate/up/down MLP and two norms, a final norm: 146 tensors) and 1,000
float32 tensors of 64 KiB. Each version the trainer writes new values into a few tensors
(fill_ with a version-dependent constant) and computes a checksum of the whole dict on the
GPU; the consumer computes the same checksum of what it received (outside the timed part).

Ways:
- torch.mp: the trainer puts its dict of CUDA tensors on a torch.multiprocessing Queue
  (CUDA IPC handles; the consumer's handle cache makes later versions of the same storages
  cheaper); the consumer takes it off.
- bucket: the flattened-bucket practice: one CUDA tensor holds every weight; it travels once
  over a torch.multiprocessing Queue with the offsets; each version the trainer sends a small
  message and the consumer unflattens by slicing the bucket into a dict of views.
- gpupool: two bundles from Client.alloc_dict (double buffering: version N+1 is written into
  one while the consumer may still read version N in the other); the trainer writes the
  whole state (a copy from the other bundle, then the version's changes) and publish_dict's
  it; the consumer waits in get_dict(newer_than=last, keep_mapped=True: the two bundles'
  memory stays mapped between versions) and builds torch views with TensorDict.torch().
- gpupool+reuse: the same, the consumer also asking get_dict(reuse_views=True): a version in
  a bundle it viewed before comes with the torch views it built then (double buffering
  alternates between two bundles), so a warm version builds none.

Timing per version: from the trainer starting the handoff (its writes done and synchronized)
to the consumer holding a dict of torch tensors whose data is ready (after a synchronize of
its stream), on CLOCK_MONOTONIC (time.perf_counter_ns) shared by both processes. The first
version is "cold" (mappings and handle caches empty), the rest "warm".

The script starts its own gpupoold (--gpupoold) with a pool of twice the dict plus slack,
and finds libgpupool-client next to it in a build tree (or at --library /
$GPUPOOL_LIBRARY), as bench/py_handoff.py does. --device cpu runs the same three ways with
CPU tensors (shared memory for torch, the host backend for gpupool). Exits 77 when torch (or
CUDA, for a cuda device) is missing.

    python3 bench/weight_sync.py --gpupoold build-gpu/daemon/gpupoold --versions 30
"""

import json
import multiprocessing as mp
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from _common import arg_parser, percentile, pool_spec, run_pair, sync, torch_on, use_library  # noqa: E402

MiB = 1 << 20


def llama_layout():
    """(name, shape) of a Llama-3.2-1B-like state dict: 146 tensors."""
    h, inter, kv, vocab = 2048, 8192, 512, 128256
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(16):
        p = "model.layers.%d." % i
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    return out


def small_layout():
    """1,000 tensors of 64 KiB (float32 128x128)."""
    return [("t%04d" % i, (128, 128)) for i in range(1000)]


WORKLOADS = {
    "llama": (llama_layout, "bfloat16"),
    "small": (small_layout, "float32"),
}


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


# --- helpers shared by the processes ---------------------------------------------------------
def _int_view(torch, t):
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[t.element_size()]
    return t.reshape(-1).view(bits)


def checksum(torch, tensors):
    """A position-weighted sum of every tensor's bits (int64, on the tensors' device)."""
    sums = torch.stack([_int_view(torch, t).sum(dtype=torch.int64) for t in tensors])
    w = torch.arange(1, len(tensors) + 1, dtype=torch.int64, device=sums.device)
    return int((sums * w).sum().item())


def initial_values(torch, layout, dtype, device):
    """The trainer's version-0 weights (deterministic)."""
    g = torch.Generator(device=device)
    g.manual_seed(1234)
    dt = getattr(torch, dtype)
    return [torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dt)
            for _, shape in layout]


def touch(tensors, version):
    """The trainer's update for `version`: a few tensors get a version-dependent value."""
    n = len(tensors)
    for i in sorted({0, n // 2, n - 1, version % n}):
        tensors[i].fill_(version * 0.5 + i * 0.25)


# --- way (i): torch.multiprocessing ----------------------------------------------------------
def mp_trainer(device, workload, versions, q, ctl):
    torch = torch_on(device)
    layout_fn, dtype = WORKLOADS[workload]
    layout = layout_fn()
    ts = initial_values(torch, layout, dtype, device)
    if not device.startswith("cuda"):
        for t in ts:
            t.share_memory_()
    names = [n for n, _ in layout]
    for v in range(1, versions + 1):
        # One copy of the weights: wait until the consumer is done with the previous version
        # (checked and dropped) before writing this one.
        ctl.recv()
        touch(ts, v)
        want = checksum(torch, ts)
        sync(torch, device)
        t0 = time.perf_counter_ns()
        q.put(dict(zip(names, ts)))
        ctl.send((t0, want))
    ctl.recv()


def mp_consumer(device, workload, versions, q, ctl, out):
    torch = torch_on(device)
    lat, bad = [], 0
    for v in range(1, versions + 1):
        ctl.send("ready")
        d = q.get()
        sync(torch, device)
        t1 = time.perf_counter_ns()
        t0, want = ctl.recv()
        lat.append((t1 - t0) / 1e3)
        bad += checksum(torch, list(d.values())) != want
        del d
    ctl.send("done")
    out.put({"lat_us": lat, "bad": bad})


# --- way (ii): one flattened bucket ----------------------------------------------------------
def bucket_trainer(device, workload, versions, q, ctl):
    torch = torch_on(device)
    layout_fn, dtype = WORKLOADS[workload]
    layout = layout_fn()
    init = initial_values(torch, layout, dtype, device)
    total = sum(numel(s) for _, s in layout)
    flat = torch.empty(total, dtype=getattr(torch, dtype), device=device)
    if not device.startswith("cuda"):
        flat.share_memory_()
    offsets, o = [], 0
    for (_, shape), t in zip(layout, init):
        n = numel(shape)
        flat[o:o + n].view(shape).copy_(t)
        offsets.append(o)
        o += n
    del init
    ts = [flat[o:o + numel(s)].view(s) for o, (_, s) in zip(offsets, layout)]
    for v in range(1, versions + 1):
        ctl.recv()  # one bucket: the consumer is done with the previous version
        touch(ts, v)
        want = checksum(torch, ts)
        sync(torch, device)
        t0 = time.perf_counter_ns()
        if v == 1:
            q.put((v, flat, [(n, s, o) for (n, s), o in zip(layout, offsets)]))
        else:
            q.put((v, None, None))
        ctl.send((t0, want))
    ctl.recv()


def bucket_consumer(device, workload, versions, q, ctl, out):
    torch = torch_on(device)
    lat, bad = [], 0
    flat = index = None
    for v in range(1, versions + 1):
        ctl.send("ready")
        ver, f, idx = q.get()
        if f is not None:
            flat, index = f, idx
        d = {n: flat[o:o + numel(s)].view(s) for n, s, o in index}
        sync(torch, device)
        t1 = time.perf_counter_ns()
        t0, want = ctl.recv()
        lat.append((t1 - t0) / 1e3)
        bad += (ver != v) + (checksum(torch, list(d.values())) != want)
        del d
    ctl.send("done")
    del flat
    out.put({"lat_us": lat, "bad": bad})


# --- way (iii): gpupool bundles, double-buffered ---------------------------------------------
def gp_trainer(socket, device, workload, versions, name, ctl):
    import gpupool

    torch = torch_on(device)
    layout_fn, dtype = WORKLOADS[workload]
    layout = layout_fn()
    c = gpupool.Client(socket, name="weight-sync-trainer")
    gp_dev = device if device.startswith("cuda") else "cpu"
    spec = {n: (s, dtype) for n, s in layout}
    init = initial_values(torch, layout, dtype, device)
    bundles = [c.alloc_dict(spec, device=gp_dev), c.alloc_dict(spec, device=gp_dev)]
    views = [list(b.torch().values()) for b in bundles]
    for t, x in zip(views[0], init):  # version 0; version 1 goes to bundles[1]
        t.copy_(x)
    del init
    copy_all = getattr(torch, "_foreach_copy_", None) or (
        lambda dst, src: [a.copy_(b) for a, b in zip(dst, src)])
    stream = torch.cuda.current_stream() if device.startswith("cuda") else None
    for v in range(1, versions + 1):
        # The consumer has version v-1 and has let go of v-2, whose bundle this one is; it
        # keeps reading v-1 while v is written into the other bundle. As in the other ways,
        # nothing is written while a handoff is being timed: a trainer writing 2.5 GB on the
        # same GPU during the consumer's get would time-share the GPU with it.
        ctl.recv()
        cur, prev = views[v % 2], views[(v - 1) % 2]
        copy_all(cur, prev)              # the whole state of version v-1 ...
        touch(cur, v)                    # ... and this version's changes
        want = checksum(torch, cur)
        sync(torch, device)
        t0 = time.perf_counter_ns()
        got = c.publish_dict(name, bundles[v % 2], stream=stream)
        t_pub = time.perf_counter_ns()
        ctl.send((t0, want, got, t_pub))
    ctl.recv()
    del views
    for b in bundles:
        b.release()
    c.unpublish(name)
    c.close()


def gp_consumer(socket, device, workload, versions, name, reuse, ctl, out):
    import gpupool

    torch = torch_on(device)
    c = gpupool.Client(socket, name="weight-sync-consumer")
    cuda = device.startswith("cuda")
    stream = torch.cuda.Stream() if cuda else None
    lat, bad = [], 0
    parts = {"publish call": [], "publish to get_dict return": [], "torch()": [],
             "stream sync": []}
    last, held = 0, None
    for v in range(1, versions + 1):
        ctl.send("ready")
        if cuda:
            with torch.cuda.stream(stream):
                td = c.get_dict(name, newer_than=last, timeout=60, stream=stream,
                                keep_mapped=True, reuse_views=reuse)
                t_got = time.perf_counter_ns()
                d = td.torch()
                t_views = time.perf_counter_ns()
                stream.synchronize()
        else:
            td = c.get_dict(name, newer_than=last, timeout=60, keep_mapped=True,
                            reuse_views=reuse)
            t_got = time.perf_counter_ns()
            d = td.torch()
            t_views = time.perf_counter_ns()
        t1 = time.perf_counter_ns()
        t0, want, published, t_pub = ctl.recv()
        lat.append((t1 - t0) / 1e3)
        if v > 1:
            for k, x in (("publish call", t_pub - t0), ("publish to get_dict return", t_got - t0),
                         ("torch()", t_views - t_got), ("stream sync", t1 - t_views)):
                parts[k].append(x / 1e3)
        bad += (td.version != published) + (checksum(torch, list(d.values())) != want)
        last = td.version
        # Keep version v (as an inference server would until v+1), let go of v-1.
        if held is not None:
            held[0].release()
        held = (td, d)
        del d
    ctl.send("done")
    held[0].release()
    held = None
    c.close()
    out.put({"lat_us": lat, "bad": bad,
             "parts_p50_ms": {k: percentile(x, 50) / 1e3 for k, x in parts.items()}})


# --- driver ----------------------------------------------------------------------------------
def summarize(res):
    lat = res.pop("lat_us")
    warm = lat[1:]
    res.update(cold_ms=lat[0] / 1e3, p50_ms=percentile(warm, 50) / 1e3,
               p99_ms=percentile(warm, 99) / 1e3, n=len(lat))
    return res


def table(results):
    lines = ["Weight sync on %s (torch %s): trainer -> consumer, %d versions per way; times "
             "in ms, warm = versions 2..N" % (results["gpu"], results["torch"],
                                              results["versions"]), "",
             "| workload | tensors | bytes | way | cold | warm p50 | warm p99 | bad |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for wl, row in results["workloads"].items():
        for way in ("torch.mp", "bucket", "gpupool", "gpupool+reuse"):
            v = row.get(way)
            if v is None:
                continue
            lines.append("| %s | %d | %.2f GB | %s | %.2f | %.3f | %.3f | %d |" % (
                wl, row["tensors"], row["bytes"] / 1e9, way, v["cold_ms"], v["p50_ms"],
                v["p99_ms"], v["bad"]))
    lines += ["", "| workload | gpupool way | warm p50: torch.mp / gpupool | bucket / gpupool | "
              "cold: torch.mp / gpupool |", "| --- | --- | --- | --- | --- |"]
    for wl, row in results["workloads"].items():
        for gw in ("gpupool", "gpupool+reuse"):
            g = row.get(gw)
            if not g:
                continue
            t, b = row.get("torch.mp"), row.get("bucket")
            lines.append("| %s | %s | %s | %s | %s |" % (
                wl, gw, "%.2fx" % (t["p50_ms"] / g["p50_ms"]) if t else "-",
                "%.2fx" % (b["p50_ms"] / g["p50_ms"]) if b else "-",
                "%.2fx" % (t["cold_ms"] / g["cold_ms"]) if t else "-"))
    parts = [("%s, %s" % (wl, gw), row[gw]["parts_p50_ms"])
             for wl, row in results["workloads"].items() for gw in ("gpupool", "gpupool+reuse")
             if "parts_p50_ms" in row.get(gw, {})]
    if parts:
        keys = list(parts[0][1])
        lines += ["", "Where a warm gpupool version goes (p50 of each part, ms; from t0):", "",
                  "| workload | " + " | ".join(keys) + " |",
                  "| --- |" + " --- |" * len(keys)]
        for wl, p in parts:
            lines.append("| %s | %s |" % (wl, " | ".join("%.3f" % p[k] for k in keys)))
    lines.append("")
    lines.append(">1 means gpupool is faster. Targets (issue 12): warm >= 10x torch.mp and >= 2x "
                 "bucket; cold no slower than torch.mp.")
    return "\n".join(lines) + "\n"


def run_ways(args, wl, ways, size, d, ctx, tctx, pair, run):
    """One run of every way for workload wl: its row of results."""
    n, nbytes = size
    row = {"tensors": n, "bytes": nbytes}
    print("weight_sync: run %d: %s: %d tensors, %d bytes (%.2f GB)" % (
        run + 1, wl, n, nbytes, nbytes / 1e9), flush=True)
    for way in ways:
        t_start = time.monotonic()
        if way == "torch.mp":
            q = tctx.Queue()
            res = run_pair(tctx, mp_trainer, (args.device, wl, args.versions, q),
                           mp_consumer, (args.device, wl, args.versions, q), **pair)
        elif way == "bucket":
            q = tctx.Queue()
            res = run_pair(tctx, bucket_trainer, (args.device, wl, args.versions, q),
                           bucket_consumer, (args.device, wl, args.versions, q), **pair)
        elif way in ("gpupool", "gpupool+reuse"):
            name = "weight-sync/%s/%s/%d" % (wl, way, run)
            res = run_pair(ctx, gp_trainer, (d.socket, args.device, wl, args.versions, name),
                           gp_consumer, (d.socket, args.device, wl, args.versions, name,
                                         way == "gpupool+reuse"), **pair)
        else:
            raise SystemExit("unknown way %r" % way)
        row[way] = summarize(res)
        print("weight_sync: run %d: %s %s: cold %.2f ms, warm p50 %.3f ms, p99 %.3f ms, "
              "bad %d (%.0f s)" % (run + 1, wl, way, row[way]["cold_ms"], row[way]["p50_ms"],
                                   row[way]["p99_ms"], row[way]["bad"],
                                   time.monotonic() - t_start), flush=True)
        if "parts_p50_ms" in row[way]:
            print("weight_sync: run %d: %s %s: where a warm version goes (p50, ms): %s" % (
                run + 1, wl, way, ", ".join("%s %.3f" % kv
                                            for kv in row[way]["parts_p50_ms"].items())),
                  flush=True)
    return row


def spread(results):
    """The warm p50 of every way in every run, its spread, and each gpupool way's ratio to
    the bucket per run (issue 23: plain get_dict(...).torch() at least 3x the bucket in
    every run)."""
    runs = results["runs"]
    if len(runs) < 2:
        return ""
    lines = ["", "Across %d runs (fresh processes each; the tables above are the last run): "
             "warm p50 in ms, each run, then min - max" % len(runs), "",
             "| workload | way | " + " | ".join("run %d" % (i + 1) for i in range(len(runs)))
             + " | min - max |", "| --- | --- |" + " --- |" * (len(runs) + 1)]
    for wl in runs[0]:
        for way in ("torch.mp", "bucket", "gpupool", "gpupool+reuse"):
            vals = [r[wl][way]["p50_ms"] for r in runs if way in r.get(wl, {})]
            if len(vals) == len(runs):
                lines.append("| %s | %s | %s | %.3f - %.3f |" % (
                    wl, way, " | ".join("%.3f" % v for v in vals), min(vals), max(vals)))
    for wl in runs[0]:
        for way in ("gpupool", "gpupool+reuse"):
            if not all("bucket" in r[wl] and way in r[wl] for r in runs):
                continue
            ratios = [r[wl]["bucket"]["p50_ms"] / r[wl][way]["p50_ms"] for r in runs]
            lines.append("")
            lines.append("%s, %s: bucket / %s per run %s (min %.2fx)%s" % (
                wl, way, way, ", ".join("%.2fx" % x for x in ratios), min(ratios),
                "; target >= 3x in every run: %s" % ("met" if min(ratios) >= 3 else "missed")
                if way == "gpupool" else ""))
    return "\n".join(lines) + "\n"


def main():
    ap = arg_parser(__doc__)
    ap.add_argument("--versions", type=int, default=30, help="versions per way (>= 2)")
    ap.add_argument("--workloads", default="llama,small", help="llama, small or both")
    ap.add_argument("--ways", default="torch.mp,bucket,gpupool,gpupool+reuse",
                    help="gpupool+reuse: the consumer asks get_dict(reuse_views=True)")
    ap.add_argument("--runs", type=int, default=5,
                    help="repeat every way this many times (fresh processes each run) and "
                         "report the spread of the warm p50 across runs")
    ap.add_argument("--table", help="also write the markdown table to this file")
    args = ap.parse_args()
    if args.versions < 2:
        ap.error("--versions must be at least 2 (one cold, one warm)")
    if args.runs < 1:
        ap.error("--runs must be at least 1")

    use_library(args.library, args.gpupoold)

    try:
        import torch
    except ImportError as e:
        print("weight_sync: SKIP: torch is not installed for %s (%s)" % (sys.executable, e))
        return 77
    from gpupool.testing import Daemon

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("weight_sync: SKIP: torch %s sees no CUDA device (--device cpu compares on the "
              "host backend)" % torch.__version__)
        return 77
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    sizes = {}
    for wl in workloads:
        layout_fn, dtype = WORKLOADS[wl]
        layout = layout_fn()
        item = 2 if dtype == "bfloat16" else 4
        sizes[wl] = (len(layout), sum(numel(s) for _, s in layout) * item)
    slab = 256 * MiB
    biggest = max(b for _, b in sizes.values())
    # Two bundles (double buffering), each rounded up to whole slabs, plus slack.
    cap = (2 * ((biggest + slab - 1) // slab) + 4) * slab
    dev_index = (torch.device(args.device).index or 0) if cuda else 0
    pool = pool_spec(cuda, dev_index, cap, slab)

    import torch.multiprocessing as tmp

    ctx = mp.get_context("spawn")
    tctx = tmp.get_context("spawn")
    pair = dict(timeout=1200, join_s=60, role="trainer")
    results = {"device": args.device, "torch": torch.__version__, "versions": args.versions,
               "gpu": torch.cuda.get_device_name(dev_index) if cuda else "cpu",
               "workloads": {}}
    all_runs = []
    with Daemon(args.gpupoold, backend="cuda" if cuda else "host", pools=[pool]) as d:
        print("weight_sync: gpupoold %s backend, pool %d MiB; %s; torch %s; %d versions"
              % ("cuda" if cuda else "host", cap // MiB, results["gpu"], torch.__version__,
                 args.versions), flush=True)
        for run in range(args.runs):
            results["workloads"] = {}
            for wl in workloads:
                row = run_ways(args, wl, ways, sizes[wl], d, ctx, tctx, pair, run)
                results["workloads"][wl] = row
            all_runs.append(results["workloads"])
    results["runs"] = all_runs
    text = table(results) + spread(results)
    print()
    print(text)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "weight-sync-table.md"), "w") as f:
            f.write(text)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    bad = sum(v["bad"] for rows in all_runs for row in rows.values() for v in row.values()
              if isinstance(v, dict))
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
