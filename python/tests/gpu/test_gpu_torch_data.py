"""PinnedLoader on the CUDA backend: workers (spawned: each maps host-NUMA memory through a
CUDA context of its own) collate batches into pinned host-NUMA buffers; the main process
gets them pinned, bit-exact against torch's own DataLoader, copies them to the GPU without
blocking, and every buffer is back once the batches are freed. Skipped without torch+CUDA
(python/tests/gpu/run.py exits 77)."""

import gc
import os
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "torchdata"))  # datasets
sys.path.insert(0, os.path.dirname(HERE))  # python/tests: support
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python: gpupool

try:
    import torch

    HAVE_TORCH_CUDA = torch.cuda.is_available()
    WHY = "" if HAVE_TORCH_CUDA else "torch sees no CUDA device"
except ImportError as e:
    torch = None
    HAVE_TORCH_CUDA = False
    WHY = "torch is not installed (%s)" % e

import gpupool  # noqa: E402
from gpupool.testing import Daemon  # noqa: E402


@unittest.skipUnless(HAVE_TORCH_CUDA, "GPU Python tests need torch with CUDA: " + WHY)
class PinnedLoaderCuda(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.environ.get("GPUPOOLD"):
            raise unittest.SkipTest("set GPUPOOLD to a gpupoold built with CUDA")
        try:
            cls.daemon = Daemon(backend="cuda", pools=(
                "name=pinned,kind=host-numa,device=0,capacity=1G,slab=64M",)).start()
        except RuntimeError as e:
            raise unittest.SkipTest("gpupoold cannot serve a host-NUMA pool here: %s" % e)
        cls.socket = cls.daemon.socket

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def test_batches_pinned_bit_exact_and_returned(self):
        import loader_samples as datasets
        from gpupool.torch_data import PinnedLoader

        torch.cuda.init()  # the main process uses CUDA before the workers start
        ds = datasets.Samples(n=40)
        want = list(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2))
        with gpupool.Client(self.socket) as c:
            base = c.stats()["buffers"]
            dl = PinnedLoader(ds, batch_size=4, num_workers=2, socket=self.socket,
                              persistent_workers=True)
            self.assertEqual(dl.multiprocessing_context.get_start_method(), "spawn")
            for epoch in range(2):
                got = []
                for b in dl:
                    img = b["image"]
                    self.assertTrue(img.is_pinned(), "a batch tensor is not pinned memory")
                    self.assertFalse(img.is_shared())
                    # An asynchronous copy on the current stream, then the batch is freed:
                    # its buffer may be reused only after the copy has read it.
                    g = img.cuda(non_blocking=True)
                    got.append({k: v for k, v in b.items() if k != "image"})
                    got[-1]["image"] = g
                    del b, img
                torch.cuda.synchronize()
                self.assertEqual(len(got), len(want))
                for a, w in zip(got, want):
                    self.assertTrue(torch.equal(a["image"].cpu(), w["image"]))
                    self.assertTrue(torch.equal(a["tokens"], w["tokens"]))
                    self.assertTrue(torch.equal(a["half"], w["half"]))
                    self.assertEqual(a["name"], w["name"])
                del got, a
            with self.assertRaisesRegex(ValueError, "cannot use fork"):
                PinnedLoader(ds, batch_size=4, num_workers=1, socket=self.socket,
                             multiprocessing_context="fork")
            del dl
            gc.collect()
            deadline = time.monotonic() + 20
            while c.stats()["buffers"] != base and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(c.stats()["buffers"], base)

    def test_loaders_in_a_row(self):
        """Loader after loader in one process, each with a client of its own, while batches
        of earlier ones are still alive: the later clients get buffers in slabs the earlier
        ones map (the driver refuses a second import of pinned memory in a process), and a
        client that goes must leave the pool usable for the others."""
        import loader_samples as datasets
        from gpupool.torch_data import PinnedLoader

        torch.cuda.init()
        ds = datasets.Samples(n=48)
        want = list(torch.utils.data.DataLoader(ds, batch_size=6, num_workers=0))
        with gpupool.Client(self.socket) as c:
            base = c.stats()["buffers"]
            dl = PinnedLoader(ds, batch_size=6, num_workers=3, socket=self.socket,
                              persistent_workers=True)
            for epoch in range(2):
                for b in dl:
                    pass
            kept = b  # a loop variable keeps the last batch (and the first loader's client)
            del dl
            gc.collect()
            bad = PinnedLoader(datasets.Samples(n=48, fail_at=13), batch_size=6, num_workers=2,
                               socket=self.socket)
            with self.assertRaisesRegex(ValueError, "sample 13 is broken"):
                for b in bad:
                    pass
            for k in range(2):
                dl = PinnedLoader(ds, batch_size=6, num_workers=2, prefetch_factor=4,
                                  socket=self.socket)
                got = [{"image": b["image"].cuda(non_blocking=True), "name": b["name"]}
                       for b in dl]
                torch.cuda.synchronize()
                self.assertEqual(len(got), len(want))
                for a, w in zip(got, want):
                    self.assertTrue(torch.equal(a["image"].cpu(), w["image"]))
                    self.assertEqual(a["name"], w["name"])
                del got, dl
            self.assertTrue(torch.equal(kept["image"].cuda().cpu(), want[-1]["image"]))
            del kept, bad, b
            gc.collect()
            deadline = time.monotonic() + 20
            while c.stats()["buffers"] != base and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(c.stats()["buffers"], base)


if __name__ == "__main__":
    unittest.main()
