"""Sharded versions and refit plans from Python (NumPy, host backend): trainer ranks publish
their slices as parts of a version, seen only once complete; an engine's own arrays (fused
qkv and gate_up column-parallel, row-parallel o and down, another dtype) are refitted in
place version after version by one plan; a rank that goes away mid-publish leaves nothing."""

import os
import subprocess
import sys
import unittest

import numpy as np

from support import REPO, DaemonTestCase, child_env
import gpupool

EXAMPLE = os.path.join(REPO, "examples", "python", "refit.py")


def model(version, rng_seed=0):
    rng = np.random.default_rng(rng_seed + version)
    shapes = {"q": (8, 6), "k": (4, 6), "v": (4, 6), "o": (6, 8), "gate": (10, 6), "up": (10, 6),
              "down": (6, 10), "norm": (6,)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def fsdp_part(weights, rank, world):
    """FSDP: dim-0 chunks of ceil(n / world) rows (uneven; empty slices left out)."""
    out = {}
    for k, w in weights.items():
        chunk = -(-w.shape[0] // world)
        lo, hi = min(rank * chunk, w.shape[0]), min((rank + 1) * chunk, w.shape[0])
        if hi > lo:
            out[k] = (w[lo:hi], (slice(lo, hi),), w.shape)
    return out


def engine(tp, rank, dtype=np.float32):
    q, kv, ff = 8 // tp, 4 // tp, 10 // tp
    arrays = {"qkv": np.zeros((q + 2 * kv, 6), dtype), "o": np.zeros((6, q), dtype),
              "gate_up": np.zeros((2 * ff, 6), dtype), "down": np.zeros((6, ff), dtype),
              "norm": np.zeros((6,), dtype)}
    targets = {
        "qkv": (arrays["qkv"], [("q", (slice(q * rank, q * (rank + 1)),)),
                                ("k", (slice(kv * rank, kv * (rank + 1)),)),
                                ("v", (slice(kv * rank, kv * (rank + 1)),))]),
        "o": (arrays["o"], [("o", (slice(None), slice(q * rank, q * (rank + 1))))], 1),
        "gate_up": (arrays["gate_up"], [("gate", (slice(ff * rank, ff * (rank + 1)),)),
                                        ("up", (slice(ff * rank, ff * (rank + 1)),))]),
        "down": (arrays["down"], [("down", (slice(None), slice(ff * rank, ff * (rank + 1))))], 1),
        "norm": (arrays["norm"], ["norm"]),
    }
    return arrays, targets


def expected(w, tp, rank, dtype=np.float32):
    q, kv, ff = 8 // tp, 4 // tp, 10 // tp
    r = rank
    return {"qkv": np.concatenate([w["q"][q * r:q * (r + 1)], w["k"][kv * r:kv * (r + 1)],
                                   w["v"][kv * r:kv * (r + 1)]]).astype(dtype),
            "o": w["o"][:, q * r:q * (r + 1)].astype(dtype),
            "gate_up": np.concatenate([w["gate"][ff * r:ff * (r + 1)],
                                       w["up"][ff * r:ff * (r + 1)]]).astype(dtype),
            "down": w["down"][:, ff * r:ff * (r + 1)].astype(dtype),
            "norm": w["norm"].astype(dtype)}


class Refit(DaemonTestCase):
    # keep_dedicated: a part larger than a slab, copied per version, reuses its dedicated slab.
    pools = ("name=main,kind=host,capacity=256M,slab=16M,keep_dedicated=4",)

    def publish(self, name, version, world, ranks=None):
        weights = model(version)
        clients = [gpupool.Client(self.socket, name="rank%d" % r) for r in range(world)]
        try:
            done = []
            for r in (ranks if ranks is not None else range(world)):
                done.append(clients[r].publish_shard(name, fsdp_part(weights, r, world), r, world,
                                                     version))
            return weights, done
        finally:
            for c in clients:
                c.close()

    def test_fsdp_to_tp_in_place(self):
        base = self.stats()
        w, done = self.publish("policy", 1, 3)
        self.assertEqual(done, [False, False, True])
        for tp in (1, 2):
            for rank in range(tp):
                arrays, targets = engine(tp, rank)
                ptrs = {k: a.ctypes.data for k, a in arrays.items()}
                with self.client.refit_plan("policy", targets) as plan:
                    self.assertEqual(plan.refit(), 1)
                    want = expected(w, tp, rank)
                    for k in arrays:
                        np.testing.assert_array_equal(arrays[k], want[k], err_msg=k)
                        self.assertEqual(arrays[k].ctypes.data, ptrs[k])
                    info = plan.info()
                    self.assertEqual((info["plans"], info["refits"]), (1, 1))
                    self.assertGreater(info["copies"], 0)
        # The next versions, into the same arrays by the same plan.
        arrays, targets = engine(2, 1)
        plan = self.client.refit_plan("policy", targets)
        self.assertEqual(plan.refit(), 1)
        for v in (2, 3):
            w, _ = self.publish("policy", v, 3)
            self.assertEqual(plan.refit(timeout=10), v)
            want = expected(w, 2, 1)
            for k in arrays:
                np.testing.assert_array_equal(arrays[k], want[k], err_msg=k)
        self.assertEqual(plan.info()["plans"], 1)
        plan.close()
        self.client.unpublish("policy")
        self.wait_stats(lambda st: (st["buffers"], st["holds"]) == (base["buffers"], base["holds"]),
                        "buffers and holds back at baseline")

    def test_later_refits_map_nothing(self):
        # The engine maps the slabs versions come in once: later versions in the same slabs
        # (the trainer's pool reuses them) cost no mapping (no IPC open on CUDA).
        self.publish("maps", 1, 2)
        c = gpupool.Client(self.socket, name="engine-maps")
        try:
            arrays, targets = engine(2, 0)
            plan = c.refit_plan("maps", targets)
            self.assertEqual(plan.refit(), 1)
            first = c.slab_maps
            self.assertGreater(first, 0)
            for v in range(2, 8):
                w, _ = self.publish("maps", v, 2)
                self.assertEqual(plan.refit(timeout=10), v)
                want = expected(w, 2, 0)
                for k in arrays:
                    np.testing.assert_array_equal(arrays[k], want[k], err_msg=k)
            self.assertEqual(c.slab_maps, first)
            plan.close()
        finally:
            c.close()

    def test_later_refits_of_large_parts_map_nothing(self):
        # Parts larger than the pool's slab size (a dedicated slab each), copied per version:
        # with keep_dedicated the next version goes into the slab the last one left, and the
        # engine maps each slab once, not once per version.
        rng = np.random.default_rng(5)
        big = (20 << 20) // 4  # 20 MiB of float32 per part, over the 16 MiB slab
        c = gpupool.Client(self.socket, name="engine-big")
        ranks = [gpupool.Client(self.socket, name="big%d" % r) for r in range(2)]
        try:
            plan, maps = None, []
            for v in range(1, 7):
                w = rng.standard_normal(2 * big).astype(np.float32)
                for r, rc in enumerate(ranks):
                    rc.publish_shard("big", {"w": (w[r * big:(r + 1) * big], (slice(r * big, (r + 1) * big),),
                                                   (2 * big,))}, r, 2, v)
                dst = dst if plan else np.zeros(2 * big, np.float32)
                plan = plan or c.refit_plan("big", {"w": (dst, ["w"])})
                self.assertEqual(plan.refit(timeout=10), v)
                np.testing.assert_array_equal(dst, w)
                maps.append(c.slab_maps)
            plan.close()
            self.assertEqual(maps[-1], maps[1], "slab maps per version: %r" % (maps,))
        finally:
            for rc in ranks:
                rc.close()
            c.close()

    def test_cast_to_float16(self):
        w, _ = self.publish("half", 1, 2)
        arrays, targets = engine(2, 0, np.float16)
        plan = self.client.refit_plan("half", targets)
        plan.refit()
        want = expected(w, 2, 0, np.float16)
        for k in arrays:  # rounded to nearest even, as NumPy rounds
            np.testing.assert_array_equal(arrays[k].view(np.uint16), want[k].view(np.uint16), err_msg=k)
        self.assertGreater(plan.info()["cast_copies"], 0)
        plan.close()

    def test_partial_version_never_seen(self):
        base = self.stats()
        # Ranks 0 and 1 of 3 publish, then close their connections: version 1 never appears.
        _, done = self.publish("partial", 1, 3, ranks=[0, 1])
        self.assertEqual(done, [False, False])
        with self.assertRaises(gpupool.GpupoolError):
            self.client.get_dict("partial", timeout=0)
        self.wait_stats(lambda st: (st["buffers"], st["holds"], st["names"]) ==
                        (base["buffers"], base["holds"], base["names"]),
                        "nothing left of the partial version")

    def test_in_place_publish(self):
        # Slices that already live in gpupool memory of the rank's client (a Tensor from
        # alloc, a member of an alloc_dict) are published in place: no new buffer.
        w = model(7)
        ranks = [gpupool.Client(self.socket, name="rank%d" % r) for r in range(2)]
        try:
            parts = [fsdp_part(w, r, 2) for r in range(2)]
            for r, c in enumerate(ranks):
                shards = {}
                d = c.alloc_dict({k: (t.shape, "float32") for k, (t, _, _) in parts[r].items()
                                  if k != "norm"})
                for k, (t, sl, g) in parts[r].items():
                    if k == "norm":
                        dst = c.alloc(t.shape, "float32")
                    else:
                        dst = d[k]
                    np.asarray(dst)[...] = t
                    shards[k] = (dst, sl, g)
                before = self.stats()["buffers"]
                done = c.publish_shard("inplace", shards, r, 2, 1)
                self.assertEqual(done, r == 1)
                self.assertEqual(self.stats()["buffers"], before)
            arrays, targets = engine(2, 1)
            with self.client.refit_plan("inplace", targets) as plan:
                self.assertEqual(plan.refit(), 1)
            want = expected(w, 2, 1)
            for k in arrays:
                np.testing.assert_array_equal(arrays[k], want[k], err_msg=k)
        finally:
            for c in ranks:
                c.close()

    def test_example_processes(self):
        # examples/python/refit.py: 3 trainer rank processes, the engine in another, 3 versions.
        base = self.stats()
        p = subprocess.run([sys.executable, EXAMPLE, "--socket", self.socket, "--world", "3",
                            "--tp", "2", "--versions", "3"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=child_env(self.socket),
                           timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("refit version 3 from 3 ranks into tp rank 1 of 2: ok, in place", p.stdout)
        self.assertIn("planned 1 time(s)", p.stdout)
        self.wait_stats(lambda st: (st["buffers"], st["holds"], st["names"]) ==
                        (base["buffers"], base["holds"], base["names"]), "back at baseline")

    def test_bad_input(self):
        w, _ = self.publish("bad", 1, 1)
        arrays, targets = engine(1, 0)
        targets["norm"] = (arrays["norm"], ["ln_f"])
        with self.assertRaisesRegex(gpupool.GpupoolError, "no tensor 'ln_f'"):
            self.client.refit_plan("bad", targets)
        with self.assertRaisesRegex(gpupool.GpupoolError, "not newer|greater"):
            self.client.publish_shard("bad", {"norm": (w["norm"],)}, 0, 1, 1)


if __name__ == "__main__":
    unittest.main()
