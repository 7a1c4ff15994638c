"""A trainer rank for the GPU refit tests: holds FSDP dim-0 shards of a model's weights on
cuda:0 and publishes them as one part of each version it is told to, as a separate process.

    python3 refit_trainer.py SPEC.json RANK WORLD MODE NAME

SPEC.json: {"shapes": {key: [dims]}}. MODE: "copy" (the shards come from torch's allocator:
publish_shard copies them into gpupool memory) or "inplace" (the shards live in
gpupool.torch.empty tensors, two sets used in turn, published without a copy). Reads a
version number per line on stdin, fills its shards with that version's weights
(weights(), the same in every process), publishes its part and answers "ok VERSION
COMPLETE" (COMPLETE: 1 on the rank whose part completed the version). "quit" ends it.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python: gpupool

import gpupool  # noqa: E402
import gpupool.torch as gt  # noqa: E402


def weight(key, shape, version, index, device="cuda:0", dtype=torch.bfloat16):
    """Global tensor `key` of `version`: deterministic on one GPU and torch build, so that
    every process computes the same bits."""
    g = torch.Generator(device=device)
    g.manual_seed(version * 100003 + index)
    w = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if "norm" in key:
        w = 1.0 + 0.1 * w
    else:
        w = 0.05 * w
    return w.to(dtype)


def weights(shapes, version, device="cuda:0"):
    return {k: weight(k, s, version, i, device) for i, (k, s) in enumerate(sorted(shapes.items()))}


def fsdp_rows(n, rank, world):
    """FSDP: dim-0 chunks of ceil(n / world) rows; (lo, hi), empty for the ranks past the end."""
    chunk = -(-n // world)
    return min(rank * chunk, n), min((rank + 1) * chunk, n)


def main():
    spec, rank, world, mode, name = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                     sys.argv[5])
    with open(spec) as f:
        shapes = {k: tuple(v) for k, v in json.load(f)["shapes"].items()}
    torch.cuda.set_device(0)
    c = gpupool.Client(name="trainer%d" % rank)
    sets = [None, None]
    stream = torch.cuda.current_stream()
    print("ready", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if line == "quit":
            break
        version = int(line)
        full = weights(shapes, version)
        parts = {}
        if mode == "inplace":
            held = sets[version % 2]
            if held is None:
                held = sets[version % 2] = {}
            for k, w in full.items():
                lo, hi = fsdp_rows(w.shape[0], rank, world)
                if hi <= lo:
                    continue
                t = held.get(k)
                if t is None:
                    t = held[k] = gt.empty(hi - lo, *w.shape[1:], dtype=w.dtype, device="cuda:0",
                                           client=c)
                t.copy_(w[lo:hi])
                parts[k] = (t, (slice(lo, hi),), tuple(w.shape))
        else:
            for k, w in full.items():
                lo, hi = fsdp_rows(w.shape[0], rank, world)
                if hi > lo:
                    parts[k] = (w[lo:hi].clone(), (slice(lo, hi),), tuple(w.shape))
        done = c.publish_shard(name, parts, rank=rank, world=world, version=version,
                               stream=stream)
        print("ok %d %d" % (version, int(done)), flush=True)
    c.close()


if __name__ == "__main__":
    main()
