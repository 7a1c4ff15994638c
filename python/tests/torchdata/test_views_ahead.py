"""get_dict(newer_than=..., keep_mapped=True).torch() with views built ahead: a consumer that
follows versions of a double-buffered producer gets, for every version, tensors of its own,
bit-exact, whose memory is held exactly as long as they live, built before it waited."""

import gc
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # python/tests: support

import torch  # noqa: E402

import gpupool  # noqa: E402
from support import DaemonTestCase  # noqa: E402

SPEC = {"l%d.%s" % (i, n): ((8, 8) if n in "qo" else (8,), "float32")
        for i in range(4) for n in "qkon"}


class ViewsAhead(DaemonTestCase):
    def publish(self, p, b, v):
        for t in b.torch().values():
            t.fill_(float(v))
        p.publish_dict("w", b)

    def test_double_buffered_versions(self):
        p = gpupool.Client(self.socket)
        self.addCleanup(p.close)
        c = gpupool.Client(self.socket)
        self.addCleanup(c.close)
        bundles = [p.alloc_dict(SPEC, device="cpu") for _ in range(3)]
        base = self.stats()["holds"]
        last, kept = 0, []
        # Versions alternate between two bundles, then one lands in a third (no views were
        # built for it: it is viewed the ordinary way), then they alternate again.
        order = [0, 1, 0, 1, 0, 2, 1, 2, 1, 2]
        for v, which in enumerate(order, 1):
            self.publish(p, bundles[which], v)
            td = c.get_dict("w", newer_than=last, timeout=5, keep_mapped=True)
            d = td.torch()
            last = td.version
            self.assertEqual(list(d), list(SPEC))
            for name, t in d.items():
                self.assertTrue(torch.equal(t, torch.full(SPEC[name][0], float(v))), name)
            kept.append(d)
            td.release()
        st = c._torch_ahead
        self.assertGreaterEqual(st["used"], 6, "versions viewed through views built ahead")
        # Every version's tensors are its own objects, and each keeps its version's hold.
        self.assertEqual(len({id(t) for d in kept for t in d.values()}), len(order) * len(SPEC))
        self.assertEqual(self.stats()["holds"], base + len(order))
        # A kept version still reads what it was: later versions went to other memory or
        # (double buffering) were written by the producer, which owns that choice.
        self.assertTrue(torch.equal(kept[-1]["l0.q"], torch.full((8, 8), float(len(order)))))
        del kept, d, t, td
        gc.collect()
        self.wait_stats(lambda s: s["holds"] == base, "only the producer's holds")
        # Views built ahead and never handed out hold nothing.
        self.assertLessEqual(len(st["sets"]), 2)

    def test_not_without_keep_mapped_or_newer_than(self):
        p = gpupool.Client(self.socket)
        self.addCleanup(p.close)
        c = gpupool.Client(self.socket)
        self.addCleanup(c.close)
        b = p.alloc_dict(SPEC, device="cpu")
        for v in range(1, 4):
            self.publish(p, b, v)
            with c.get_dict("w", timeout=5) as td:
                d = td.torch()
                self.assertTrue(torch.equal(d["l3.n"], torch.full((8,), float(v))))
        self.assertEqual(c.__dict__.get("_torch_ahead", {}).get("built", 0), 0)
