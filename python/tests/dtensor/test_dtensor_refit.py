"""Sharded versions from torch DTensors (host backend, CPU, gloo): 2 and 4 rank processes
publish state dicts of DTensors (Shard(0), Shard(1), Replicate(), on 1-D meshes and a 2x2
mesh, with uneven sizes: 7 rows and 2 rows over 4 ranks) as they are; each rank refits
DTensor targets of other placements in place (checked with full_tensor() in the ranks), and
an engine here refits plain tensors of a tensor-parallel layout and whole tensors, bit for
bit. A replicated weight is published by one rank; ranks with nothing of their own publish
nothing and the version is complete without them; local tensors in gpupool memory are
published in place. Partial and _StridedShard placements are refused with the placement
named (in the ranks: they need a process group)."""

import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                    # dtensor_ranks (spawned ranks import it too)
sys.path.insert(0, os.path.dirname(HERE))   # python/tests: support

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from support import DaemonTestCase  # noqa: E402


def unavailable():
    """Why DTensors on CPU cannot run here, or None."""
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this torch build"
    try:
        from torch.distributed.tensor import DTensor  # noqa: F401
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401
    except ImportError as e:
        return "torch %s has no torch.distributed.tensor DTensor (%s)" % (torch.__version__, e)
    return None


WHY = unavailable()
if WHY is None:
    import dtensor_ranks as ranks  # noqa: E402


def chunks(n, parts):
    """torch.chunk's sizes of n over parts (the last ones smaller, or none)."""
    size = -(-n // parts)
    return [max(0, min(size, n - i * size)) for i in range(parts)]


@unittest.skipIf(WHY is not None, WHY or "")
class DTensorRefit(DaemonTestCase):
    pools = ("name=main,kind=host,capacity=256M,slab=16M",)

    def spawn(self, world, layout):
        """Run the ranks; what each returned, by rank."""
        import torch.multiprocessing as mp

        tmp = tempfile.mkdtemp(prefix="gpupool-dtensor-")
        store = os.path.join(tmp, "store")
        mp.spawn(ranks.main, args=(world, layout, self.socket, store, tmp), nprocs=world,
                 join=True)
        out = []
        for r in range(world):
            with open(os.path.join(tmp, "rank%d.json" % r)) as f:
                out.append(json.load(f))
        return out

    def members(self, name):
        d = self.client.get_dict(name, timeout=0)
        try:
            keys = list(d.keys())
        finally:
            d.release()
        count = {}
        for k in keys:
            count[k.split("@")[0]] = count.get(k.split("@")[0], 0) + 1
        return count

    def same(self, a, b, what):
        self.assertTrue(ranks.same_bits(a, b), "%s: %r != %r" % (what, a, b))

    def engine(self, name, tp, want):
        """Plain tensors of a TP layout (rows of q, columns of o and emb) for each rank of
        tp, and every weight whole, refitted in place from the version published now."""
        for r in range(tp):
            q = 8 // tp
            lo = sum(chunks(5, tp)[:r])
            hi = lo + chunks(5, tp)[r]
            arrays = {"q": torch.zeros(q, 6), "o": torch.zeros(6, q), "emb": torch.zeros(7, hi - lo)}
            targets = {"q": (arrays["q"], [("q", (slice(q * r, q * (r + 1)),))]),
                       "o": (arrays["o"], [("o", (slice(None), slice(q * r, q * (r + 1))))], 1),
                       "emb": (arrays["emb"], [("emb", (slice(None), slice(lo, hi)))], 1)}
            with self.client.refit_plan(name, targets) as plan:
                plan.refit()
            self.same(arrays["q"], want["q"][q * r:q * (r + 1)], "q tp rank %d" % r)
            self.same(arrays["o"], want["o"][:, q * r:q * (r + 1)], "o tp rank %d" % r)
            self.same(arrays["emb"], want["emb"][:, lo:hi], "emb tp rank %d" % r)
        whole = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in want.items()}
        with self.client.refit_plan(name, {k: (t, [k]) for k, t in whole.items()}) as plan:
            plan.refit()
        for k, t in whole.items():
            self.same(t, want[k], "whole %s" % k)

    def check(self, world, layout, publishers, sparse_publishers):
        got = self.spawn(world, layout)
        name = "policy-%s%d" % (layout, world)
        # One rank completed each version; every rank refitted its DTensors by one plan.
        for v in range(2):
            done = [g["policy"][v] for g in got]
            self.assertEqual(done.count(True), 1, "version %d: %r" % (v + 1, done))
            self.assertEqual([r for r, d in enumerate(done) if d is not None], list(range(world)))
        self.assertEqual([g["plans"] for g in got], [1] * world)
        self.assertEqual([g["plan_version"] for g in got], [1] * world)
        count = self.members(name)
        self.assertEqual((count["norm"], count["step"]), (1, 1), count)  # replicated: once
        self.assertEqual(count, publishers, count)
        self.engine(name, 2, ranks.weights(2))
        # Ranks with no slice of their own return False without publishing.
        sparse = [g["sparse"] for g in got]
        self.assertEqual(sparse.count(True), 1, sparse)
        self.assertIn(sparse.index(True), sparse_publishers, sparse)
        self.assertEqual(self.members("sparse-%s%d" % (layout, world)),
                         {"norm": 1, "tiny": 2})
        w = ranks.weights(2)
        whole = {"norm": torch.zeros(6), "tiny": torch.zeros(2, 3)}
        with self.client.refit_plan("sparse-%s%d" % (layout, world),
                                    {k: (t, [k]) for k, t in whole.items()}) as plan:
            plan.refit()
        for k, t in whole.items():
            self.same(t, w[k], "sparse %s" % k)

    def test_two_ranks(self):
        self.check(2, "1d", {"q": 2, "o": 2, "norm": 1, "emb": 2, "tiny": 2, "cols": 2, "up": 2,
                             "step": 1}, {0, 1})

    def test_four_ranks_uneven(self):
        # 7 rows over 4: 2, 2, 2, 1; 2 rows over 4: ranks 2 and 3 hold none; 7 columns: 2, 2,
        # 2, 1. In the sparse version only ranks 0 and 1 publish.
        self.check(4, "1d", {"q": 4, "o": 4, "norm": 1, "emb": 4, "tiny": 2, "cols": 4, "up": 4,
                             "step": 1}, {0, 1})

    def test_four_ranks_2d_mesh(self):
        # A 2x2 mesh: (Replicate(), Shard(0)) published by mesh row 0 only (2 slices), (Shard(0),
        # Shard(1)) 4 slices, (Shard(1), Shard(1)) of 7 columns 4 (2, 2, 2, 1), (Shard(0),
        # Shard(0)) of 10 rows 4 (3, 2, 3, 2). The sparse version: ranks 0 and 2.
        self.check(4, "2d", {"q": 2, "o": 4, "norm": 1, "emb": 2, "tiny": 2, "cols": 4, "up": 4,
                             "step": 1}, {0, 2})


if __name__ == "__main__":
    unittest.main()
