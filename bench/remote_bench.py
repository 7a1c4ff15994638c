#!/usr/bin/env python3
"""Remote fetch between two gpupoolds in two network namespaces, against what the same link
gives to UCX alone and to torch.distributed.

Two namespaces joined by veth pairs on a bridge (tests/remote/netns.sh), one gpupoold in each
(tests/remote/cluster.py: A serves, B fetches; UCX over TCP unless --tls says otherwise). Three
halves, each printed with its figures; the ratios last:

1. ucx_perftest between the same namespaces, same UCX_TLS and UCX_NET_DEVICES: -t ucp_get at
   the bundle's member size and at its whole size (the target's reference), and -t ucp_am_bw
   at the size of the daemon's own messages (--msg-size; the serving daemon sends a version as
   UCX active messages): what UCX itself moves over this link.
2. torch.distributed broadcast (gloo, GLOO_SOCKET_IFNAME the node's veth) of the 146 tensors
   of bench/weight_sync.py's Llama-3.2-1B-shaped state dict (bf16, about 2.5 GB) from rank 0
   in A's namespace to rank 1 in B's: rank 1's time from a barrier to the last tensor in.
   Needs torch (--torch-python; default: this interpreter); skipped, with the reason, without.
3. gpupool: A's client publishes a bundle (--size, default 1 GiB, in --members members) and
   the 146-tensor state dict; B's client asks get_dict("A:NAME", newer_than=last): timed from
   the get to the bundle in hand, version after version (A publishes the same bundle again:
   each version is a full fetch). The first version is checked bit-exact. Needs a gpupoold
   with peer support (`gpupoold --version` prints `peers: ucx ...`); skipped without.

Ratios: remote 1 GiB fetch / ucx_perftest ucp_get at the same size (target >= 0.90), the
same against the best perftest figure and against ucp_am_bw, and gloo
broadcast time / remote fetch time of the state dict (> 1: gpupool faster).

As root (namespaces), from the repository root, on a build tree:

    python3 bench/remote_bench.py --build build/release
    python3 bench/remote_bench.py --build build-gpu --device cuda --tls tcp,cuda_copy  # GPU

UCX_* variables of the environment (UCX_TCP_TX_SEG_SIZE, ...) reach ucx_perftest and both
daemons alike; the output names them. --device cuda gives both daemons a device pool on GPU 0
(ucx_perftest then uses -m cuda, which needs a UCX built with CUDA, such as the libucx-cu13
wheel's: --perftest $W/bin/ucx_perftest with LD_LIBRARY_PATH=$W/lib); a daemon that does not
fetch device pools answers ENOTSUP and that half says so. On a GPU machine --device cpu
measures the same host path as here. Figures are medians of --reps runs; the remote fetch's
come after --warmup versions (reported apart: their local copies go in memory new to the
pool, which the later versions reuse). --json FILE writes them. Needs numpy in the interpreter that runs it (/usr/bin/python3 on Debian).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "remote"))
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, HERE)

GIB, MIB = 1 << 30, 1 << 20
PERF_PORT = 13337
GLOO_PORT = 29555


def log(*a):
    print(*a, flush=True)


def llama():
    from weight_sync import llama_layout

    return llama_layout()


# ---- 1. ucx_perftest --------------------------------------------------------------------

def perftest(cl, test, size, iters, tls, mem, binary):
    """MB/s (10^6 bytes) that ucx_perftest -t test moves from A's namespace to B's: ucp_get
    reads A's memory from B (the client in B), ucp_am_bw sends from A (the client in A)."""
    a, b = cl.nodes[0], cl.nodes[1]
    if test != "ucp_get":
        a, b = b, a  # the server is where the data goes
    mflag = ["-m", "%s,%s" % (mem, mem)] if mem != "host" else []
    env = dict(os.environ, UCX_TLS=tls)
    srv = subprocess.Popen(["ip", "netns", "exec", a.ns, "env", "UCX_NET_DEVICES=" + a.dev,
                            binary, "-p", str(PERF_PORT)] + mflag,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for attempt in range(50):
            r = subprocess.run(["ip", "netns", "exec", b.ns, "env", "UCX_NET_DEVICES=" + b.dev,
                                binary, a.addr, "-p", str(PERF_PORT), "-t", test,
                                "-s", str(size), "-n", str(iters), "-w", "1"] + mflag,
                               env=env, capture_output=True, text=True, timeout=900)
            m = re.search(r"^Final:\s+(.*)$", r.stdout, re.M)
            if m:
                cols = m.group(1).split()
                # iterations, latency 50%/avg/overall (us), bandwidth avg/overall (MiB/s), ...
                return float(cols[5]) * MIB / 1e6
            if srv.poll() is not None:
                raise RuntimeError("ucx_perftest server exited: %s" % srv.stdout.read())
            time.sleep(0.2)  # the server is not listening yet
        raise RuntimeError("ucx_perftest client failed: %s%s" % (r.stdout, r.stderr))
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.communicate()


# ---- 2. torch.distributed over gloo -----------------------------------------------------

def gloo_rank(args):
    """One rank of the gloo broadcast (run inside its namespace by gloo_half)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://%s:%d" % (args.gloo_addr, GLOO_PORT),
                            rank=args.gloo_rank, world_size=2)
    rank = args.gloo_rank
    tensors = [torch.full(shape, i + 1 if rank == 0 else 0, dtype=torch.bfloat16)
               for i, (_, shape) in enumerate(llama())]
    # Gloo has no 16-bit float broadcast everywhere: the raw bytes travel (the same bytes).
    raw = [t.view(torch.uint8) for t in tensors]
    times = []
    for rep in range(args.reps):
        if rank == 0:
            for i, t in enumerate(tensors):
                t.fill_(i + 1 + rep)
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.broadcast(t, 0, async_op=True) for t in raw]
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t0)
        if rank == 1:
            bad = [i for i, t in enumerate(tensors)
                   if float(t.view(-1)[0]) != i + 1 + rep or float(t.view(-1)[-1]) != i + 1 + rep]
            if bad:
                raise SystemExit("gloo broadcast: tensor %d arrived wrong" % bad[0])
    dist.destroy_process_group()
    if rank == 1:
        print("GLOO " + json.dumps({"times": times, "bytes": sum(t.numel() for t in raw)}),
              flush=True)


def gloo_half(cl, args):
    py = args.torch_python
    r = subprocess.run([py, "-c", "import torch, torch.distributed as d; "
                        "print(torch.__version__, d.is_gloo_available())"],
                       capture_output=True, text=True)
    if r.returncode != 0 or "True" not in r.stdout:
        return None, "no torch with gloo in %s (--torch-python): %s" % (
            py, (r.stderr.strip().splitlines() or ["gloo not available"])[-1])
    procs = []
    for rank, node in enumerate(cl.nodes[:2]):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=node.dev, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", node.ns, py, os.path.abspath(__file__), "--gloo-rank",
             str(rank), "--gloo-addr", cl.nodes[0].addr, "--reps", str(args.reps)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError("gloo rank failed (%d):\n%s%s" % (p.returncode, o, e))
    m = re.search(r"^GLOO (.*)$", outs[1][0], re.M)
    d = json.loads(m.group(1))
    return {"median_s": statistics.median(d["times"]), "bytes": d["bytes"],
            "times_s": d["times"], "torch": r.stdout.split()[0]}, None


# ---- 3. gpupool remote fetch --------------------------------------------------------------

def peers_support(gpupoold):
    out = subprocess.run([gpupoold, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"^peers: (.*)$", out, re.M)
    if not m:
        return "gpupoold has no peer support (no 'peers:' line in --version)"
    if not m.group(1).startswith("ucx"):
        return "gpupoold was built without UCX (%s)" % m.group(0)
    return None


def fetch_series(ca, cb, name, td, reps, warmup, check):
    """Publish td on A warmup + reps times; B fetches each version: seconds per fetch of the
    first warmup versions and of the reps after them. B's local copy of a version goes in
    memory new to the pool until the one two versions back is freed (its slabs are kept for
    the next version of the same sizes): the first versions pay for that memory (on a host
    pool, the kernel zeroing every page), the later ones measure the transfer."""
    times = []
    for rep in range(warmup + reps):
        v = ca.publish_dict(name, td)
        t0 = time.perf_counter()
        got = cb.get_dict("A:" + name, newer_than=v - 1, timeout=1800)
        times.append(time.perf_counter() - t0)
        if got.version != v:
            raise RuntimeError("B got version %d of A:%s, expected %d" % (got.version, name, v))
        if rep == 0:
            check(got)
        got.release()
    return times[:warmup], times[warmup:]


def remote_half(cl, args, cuda):
    import numpy as np

    for n in cl.nodes:
        n.start()
    a, b = cl.nodes[0], cl.nodes[1]
    dev = "cuda:0" if cuda else "cpu"
    out = {}
    with a.client("bench-A") as ca, b.client("bench-B") as cb:
        # The bundle: --members equal members of --size bytes in all.
        msize = args.size // args.members
        td = ca.alloc_dict({"m%03d" % i: ((msize,), "uint8") for i in range(args.members)},
                           device=dev)
        fill(td, cuda, lambda i: (i * 37 + 11) & 0xFF)

        def check_bundle(got):
            want = {k: (i * 37 + 11) & 0xFF for i, k in enumerate(got.keys())}
            bad = [k for k, arr in host_views(got, cuda).items()
                   if not bool(np.all(arr == want[k]))]
            if bad:
                raise RuntimeError("member %s of the fetched bundle differs" % bad[0])

        first, times = fetch_series(ca, cb, "bundle", td, args.reps, args.warmup, check_bundle)
        out["bundle"] = {"bytes": msize * args.members, "median_s": statistics.median(times),
                         "times_s": times, "first_versions_s": first}
        td.release()
        ca.unpublish("bundle")

        layout = llama()
        sd = ca.alloc_dict({k: (s, "bfloat16") for k, s in layout}, device=dev)
        fill(sd, cuda, lambda i: i + 1)

        def check_sd(got):
            bad = [k for i, (k, arr) in enumerate(host_views(got, cuda).items())
                   if not bool(np.all(arr == i + 1))]
            if bad:
                raise RuntimeError("tensor %s of the fetched state dict differs" % bad[0])

        first, times = fetch_series(ca, cb, "state", sd, args.reps, args.warmup, check_sd)
        out["state_dict"] = {"bytes": sd.nbytes, "tensors": len(layout),
                             "median_s": statistics.median(times), "times_s": times,
                             "first_versions_s": first}
        sd.release()
    out["peer_B_sees_A"] = b.peer("A")
    return out


def fill(td, cuda, value):
    if cuda:
        import torch

        for i, t in enumerate(td.torch().values()):
            t.view(torch.int16 if t.element_size() == 2 else torch.uint8).fill_(value(i))
        torch.cuda.synchronize()
    else:
        for i, arr in enumerate(td.numpy(raw=True).values()):
            arr[...] = value(i)


def host_views(got, cuda):
    if cuda:
        import torch

        return {k: t.view(torch.int16 if t.element_size() == 2 else torch.uint8).cpu().numpy()
                for k, t in got.torch().items()}
    return got.numpy(raw=True)


# ---- main -----------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build/release",
                    help="build tree with daemon/gpupoold, tools/gpupoolctl, client/ (default "
                         "build/release)")
    ap.add_argument("--size", type=int, default=GIB, help="bundle bytes (default 1 GiB)")
    ap.add_argument("--members", type=int, default=16, help="bundle members (default 16)")
    ap.add_argument("--reps", type=int, default=3, help="versions per figure (default 3)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="versions fetched before those timed, reported apart (default 2: "
                         "the first two local copies go in memory new to the pool)")
    ap.add_argument("--msg-size", type=int, default=MIB,
                    help="ucx_perftest -t ucp_am_bw at this size too: the daemon's own messages "
                         "(active messages of 1 MiB, the default; 0: not)")
    ap.add_argument("--tls", default="tcp", help="UCX_TLS for everything (default tcp)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--perftest", default="ucx_perftest",
                    help="the ucx_perftest to run (default: on PATH; the libucx-cu13 wheel has "
                         "one in libucx/bin, run with LD_LIBRARY_PATH at libucx/lib)")
    ap.add_argument("--torch-python", default=sys.executable,
                    help="interpreter with torch for the gloo half (default: this one)")
    ap.add_argument("--skip", default="", help="comma list of halves to leave out: "
                                               "perftest,gloo,remote")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--gloo-rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--gloo-addr", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gloo_rank is not None:
        return gloo_rank(args)
    if os.geteuid() != 0:
        log("remote_bench: needs root (network namespaces)")
        return 77
    build = os.path.abspath(args.build)
    os.environ.setdefault("GPUPOOLD", os.path.join(build, "daemon", "gpupoold"))
    os.environ.setdefault("GPUPOOLCTL", os.path.join(build, "tools", "gpupoolctl"))
    os.environ.setdefault("GPUPOOL_LIBRARY", os.path.join(build, "client",
                                                          "libgpupool-client.so"))
    from cluster import Cluster

    cuda = args.device == "cuda"
    skip = set(filter(None, args.skip.split(",")))
    # UCX_* variables of the environment reach ucx_perftest and both daemons alike.
    ucx_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
    res = {"tls": args.tls, "device": args.device, "size": args.size, "members": args.members,
           "reps": args.reps, "warmup": args.warmup, "ucx_env": ucx_env}
    log("UCX_TLS=%s, device %s%s" % (args.tls, args.device, "".join(
        ", %s=%s" % kv for kv in ucx_env.items())))
    cl = Cluster(("A", "B"), capacity="%dG" % (3 * args.size // GIB + 8), slab_size="1G",
                 backend="cuda" if cuda else "host", tls=args.tls)
    try:
        cl.up()
        perftest_bin = shutil.which(args.perftest)
        if "perftest" not in skip and not perftest_bin:
            res["perftest_skipped"] = "no %s (ucx-utils, or --perftest PATH)" % args.perftest
            log("ucx_perftest: SKIPPED: " + res["perftest_skipped"])
        elif "perftest" not in skip:
            msize = args.size // args.members
            mem = "cuda" if cuda else "host"
            res["perftest_MBps"] = {}
            runs = [("ucp_get", msize, max(2, 4 * args.members)), ("ucp_get", args.size, 4)]
            if args.msg_size:
                runs.append(("ucp_am_bw", args.msg_size, max(16, 2 * args.size // args.msg_size)))
            for test, size, iters in runs:
                mbps = perftest(cl, test, size, iters, args.tls, mem, perftest_bin)
                res["perftest_MBps"]["%s %d" % (test, size)] = mbps
                log("ucx_perftest %-9s %11d B x %4d (%s): %8.1f MB/s" % (test, size, iters,
                                                                         args.tls, mbps))
        if "gloo" not in skip:
            g, why = gloo_half(cl, args)
            if g:
                res["gloo"] = g
                log("gloo broadcast, 146 tensors %.2f GB: %.3f s median (%.1f MB/s), torch %s"
                    % (g["bytes"] / 1e9, g["median_s"], g["bytes"] / g["median_s"] / 1e6,
                       g["torch"]))
            else:
                res["gloo_skipped"] = why
                log("gloo broadcast: SKIPPED: " + why)
        if "remote" not in skip:
            r = None
            why = peers_support(os.environ["GPUPOOLD"])
            if not why:
                import gpupool

                try:
                    r = remote_half(cl, args, cuda)
                except gpupool.GpupoolError as e:
                    if e.name != "ENOTSUP":  # device pools the daemon does not fetch
                        raise
                    why = e.message
            if r is None:
                res["remote_skipped"] = why
                log("gpupool remote fetch: SKIPPED: " + why)
            else:
                res["remote"] = r
                for k in ("bundle", "state_dict"):
                    log("gpupool remote fetch, %s %.2f GB: %.3f s median (%.1f MB/s); "
                        "first %d version(s): %s s"
                        % (k, r[k]["bytes"] / 1e9, r[k]["median_s"],
                           r[k]["bytes"] / r[k]["median_s"] / 1e6, len(r[k]["first_versions_s"]),
                           " ".join("%.3f" % t for t in r[k]["first_versions_s"]) or "-"))
    finally:
        cl.__exit__(*sys.exc_info())

    ratios = {}
    if "remote" in res and "perftest_MBps" in res:
        pt = res["perftest_MBps"]
        got = res["remote"]["bundle"]["bytes"] / res["remote"]["bundle"]["median_s"] / 1e6
        ratios["remote_bundle_vs_perftest_get_same_size"] = got / pt["ucp_get %d" % args.size]
        ratios["remote_bundle_vs_perftest_best"] = got / max(pt.values())
        if "ucp_am_bw %d" % args.msg_size in pt:
            ratios["remote_bundle_vs_perftest_am_bw"] = got / pt["ucp_am_bw %d" % args.msg_size]
    if "remote" in res and "gloo" in res:
        ratios["gloo_time_over_remote_time_state_dict"] = (
            res["gloo"]["median_s"] / res["remote"]["state_dict"]["median_s"])
    res["ratios"] = ratios
    for k, v in ratios.items():
        log("RATIO %s = %.3f" % (k, v))
    if not ratios:
        log("RATIO none: a ratio needs the remote half (and perftest or gloo)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
