"""Refit an engine's own tensors from a sharded trainer, each rank its own process.

    python refit.py [--socket PATH] [--world 4] [--tp 2] [--versions 3]

Starts `world` trainer ranks (this script with --rank R), each holding dim-0 (FSDP) slices of
a small Llama-shaped model; every version, each publishes its slices as its part
(``publish_shard``). The engine (this process, tensor-parallel rank 1 of --tp, or 0 when tp
is 1) plans once and refits its fused qkv / gate_up and row-parallel o / down arrays in place
for every version (``refit_plan``, ``plan.refit``), checking every element. NumPy, any backend.
"""

import argparse
import subprocess
import sys

import numpy as np

import gpupool

H, KV, FF, LAYERS = 64, 16, 96, 2


def weights(version):
    rng = np.random.default_rng(version)
    w = {"norm": rng.standard_normal(H).astype(np.float32)}
    for i in range(LAYERS):
        p = "layers.%d." % i
        for k, s in (("q", (H, H)), ("k", (KV, H)), ("v", (KV, H)), ("o", (H, H)),
                     ("gate", (FF, H)), ("up", (FF, H)), ("down", (H, FF))):
            w[p + k] = rng.standard_normal(s).astype(np.float32)
    return w


def trainer(c, rank, world, versions):
    for v in range(1, versions + 1):
        part = {}
        for k, t in weights(v).items():
            chunk = -(-t.shape[0] // world)
            lo, hi = min(rank * chunk, t.shape[0]), min((rank + 1) * chunk, t.shape[0])
            if hi > lo:
                part[k] = (t[lo:hi], (slice(lo, hi),), t.shape)
        c.publish_shard("policy", part, rank, world, version=v)
        # Stay connected until the version is complete (a rank that leaves first takes its
        # pending version with it), then go on with the next step.
        c.get_dict("policy", newer_than=v - 1, timeout=60).release()


def engine(c, tp, world, versions):
    r = 1 if tp > 1 else 0
    q, kv, ff = H // tp, KV // tp, FF // tp
    rows = lambda n: (slice(n * r, n * (r + 1)),)  # noqa: E731
    cols = lambda n: (slice(None), slice(n * r, n * (r + 1)))  # noqa: E731
    mine, targets = {"norm": np.zeros(H, np.float32)}, {}
    targets["norm"] = (mine["norm"], ["norm"])
    for i in range(LAYERS):
        p = "layers.%d." % i
        mine[p + "qkv"] = np.zeros((q + 2 * kv, H), np.float32)
        mine[p + "o"] = np.zeros((H, q), np.float32)
        mine[p + "gate_up"] = np.zeros((2 * ff, H), np.float32)
        mine[p + "down"] = np.zeros((H, ff), np.float32)
        targets[p + "qkv"] = (mine[p + "qkv"], [(p + "q", rows(q)), (p + "k", rows(kv)), (p + "v", rows(kv))])
        targets[p + "o"] = (mine[p + "o"], [(p + "o", cols(q))], 1)
        targets[p + "gate_up"] = (mine[p + "gate_up"], [(p + "gate", rows(ff)), (p + "up", rows(ff))])
        targets[p + "down"] = (mine[p + "down"], [(p + "down", cols(ff))], 1)
    addresses = {k: a.ctypes.data for k, a in mine.items()}
    plan = c.refit_plan("policy", targets, timeout=60)
    version = 0
    while version < versions:
        version = plan.refit(timeout=60)
        w = weights(version)
        for i in range(LAYERS):
            p = "layers.%d." % i
            want = {p + "qkv": np.concatenate([w[p + "q"][rows(q)], w[p + "k"][rows(kv)], w[p + "v"][rows(kv)]]),
                    p + "o": w[p + "o"][cols(q)],
                    p + "gate_up": np.concatenate([w[p + "gate"][rows(ff)], w[p + "up"][rows(ff)]]),
                    p + "down": w[p + "down"][cols(ff)]}
            for k, a in want.items():
                if not np.array_equal(mine[k], a):
                    sys.exit("version %d: %s differs" % (version, k))
        if not np.array_equal(mine["norm"], w["norm"]) or \
                any(a.ctypes.data != addresses[k] for k, a in mine.items()):
            sys.exit("version %d: norm differs, or a tensor moved" % version)
        info = plan.info()
        print("refit version %d from %d ranks into tp rank %d of %d: ok, in place (%d copies, %d "
              "bytes, planned %d time(s))" % (version, world, r, tp, info["copies"], info["bytes"],
                                               info["plans"]))
    plan.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2, choices=(1, 2, 4, 8, 16))
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    with gpupool.Client(a.socket, name="refit-example") as c:
        if a.rank is not None:
            trainer(c, a.rank, a.world, a.versions)
            return
        args = [sys.executable, __file__, "--world", str(a.world), "--versions", str(a.versions)]
        if a.socket:
            args += ["--socket", a.socket]
        ranks = [subprocess.Popen(args + ["--rank", str(r)]) for r in range(a.world)]
        try:
            engine(c, a.tp, a.world, a.versions)
        finally:
            for p in ranks:
                if p.wait(timeout=120) != 0:
                    sys.exit("trainer rank exited with status %d" % p.returncode)
        c.unpublish("policy")


if __name__ == "__main__":
    main()
