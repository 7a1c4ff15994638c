"""PinnedLoader (gpupool.torch_data) on the host backend: batches bit-exact against torch's
own DataLoader, in its order, with persistent workers, a worker killed, an early exit from
the loop, and every batch's buffer back in the pool once the batch is freed."""

import gc
import os
import re
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                    # loader_samples (spawned workers import it too)
sys.path.insert(0, os.path.dirname(HERE))   # python/tests: support

import torch  # noqa: E402
from multiprocessing.reduction import ForkingPickler  # noqa: E402
import torch.multiprocessing  # noqa: E402,F401  (registers its reductions)

import gpupool  # noqa: E402
from gpupool.torch_data import PinnedLoader  # noqa: E402
from support import DaemonTestCase  # noqa: E402

import loader_samples as datasets  # noqa: E402


def leaves(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from leaves(v)


class PinnedLoaderTest(DaemonTestCase):
    pools = ("name=main,kind=host,capacity=256M,slab=16M",)

    def setUp(self):
        super().setUp()
        gc.collect()
        self.base = self.wait_stats(lambda s: s["holds"] == 0, "no holds left by earlier tests")

    def loader(self, dataset, **kw):
        return PinnedLoader(dataset, socket=self.socket, **kw)

    def assertSame(self, a, b, where="batch"):
        self.assertIs(type(a), type(b), where)
        if isinstance(a, torch.Tensor):
            self.assertEqual(a.dtype, b.dtype, where)
            self.assertEqual(a.shape, b.shape, where)
            self.assertTrue(torch.equal(a, b), where)
        elif isinstance(a, dict):
            self.assertEqual(list(a), list(b), where)
            for k in a:
                self.assertSame(a[k], b[k], "%s[%r]" % (where, k))
        elif isinstance(a, (list, tuple)):
            self.assertEqual(len(a), len(b), where)
            for i, (x, y) in enumerate(zip(a, b)):
                self.assertSame(x, y, "%s[%d]" % (where, i))
        else:
            self.assertEqual(a, b, where)

    def assertBatches(self, got, want):
        self.assertEqual(len(got), len(want))
        for i, (a, b) in enumerate(zip(got, want)):
            self.assertSame(a, b, "batch %d" % i)

    def back_to_baseline(self):
        gc.collect()
        self.wait_stats(lambda s: s["buffers"] == self.base["buffers"] and s["holds"] == 0,
                        "the buffers and holds there were before the loader (%d, 0)"
                        % self.base["buffers"])

    # --- what arrives ---------------------------------------------------------------------
    def test_bit_exact_against_dataloader(self):
        ds = datasets.Samples()
        for workers in (0, 2):
            with self.subTest(workers=workers):
                want = list(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=workers))
                got = list(self.loader(ds, batch_size=4, num_workers=workers))
                self.assertBatches(got, want)
                del got, want
                self.back_to_baseline()

    def test_batches_are_gpupool_buffers_not_torch_shared_memory(self):
        # Every storage that torch's reductions would send through shared memory (an fd or
        # a file name) fails the worker that tries: with PinnedLoader none may.
        def refuse(storage):
            raise AssertionError("a storage went through torch's shared-memory reduction")

        saved = dict(ForkingPickler._extra_reducers)
        for cls in list(saved):
            if isinstance(cls, type) and "Storage" in cls.__name__:
                ForkingPickler._extra_reducers[cls] = refuse
        try:
            got = list(self.loader(datasets.Samples(), batch_size=4, num_workers=2))
        finally:
            ForkingPickler._extra_reducers.clear()
            ForkingPickler._extra_reducers.update(saved)
        self.assertEqual(len(got), 10)
        for b in got:
            for t in leaves(b):
                self.assertFalse(t.is_shared(), "a batch tensor in torch's shared memory")
        # One buffer (and one hold) of the daemon per batch the main process keeps.
        st = self.stats()
        self.assertEqual(st["buffers"] - self.base["buffers"], len(got))
        self.assertEqual(st["holds"], len(got))
        del got, b, t
        self.back_to_baseline()

    def test_order_with_workers_out_of_step(self):
        ds = datasets.Samples(n=60, delay_every=3)
        for kw in ({}, {"shuffle": True}, {"batch_size": None}):
            with self.subTest(**kw):
                args = dict(batch_size=4, num_workers=3)
                args.update(kw)
                if kw.get("shuffle"):
                    want = list(torch.utils.data.DataLoader(
                        ds, generator=torch.Generator().manual_seed(7), **args))
                    got = list(self.loader(ds, generator=torch.Generator().manual_seed(7),
                                           **args))
                else:
                    want = list(torch.utils.data.DataLoader(ds, **args))
                    got = list(self.loader(ds, **args))
                self.assertBatches(got, want)
        del got, want
        self.back_to_baseline()

    def test_custom_collate_fn(self):
        ds = datasets.Samples()
        want = list(torch.utils.data.DataLoader(ds, batch_size=5, num_workers=2,
                                                collate_fn=datasets.custom_collate))
        got = list(self.loader(ds, batch_size=5, num_workers=2,
                               collate_fn=datasets.custom_collate))
        self.assertBatches(got, want)
        self.assertFalse(got[0][0].is_shared())
        del got, want
        self.back_to_baseline()

    def test_spawned_workers(self):
        ds = datasets.Samples(n=12)
        want = list(torch.utils.data.DataLoader(ds, batch_size=4))
        got = list(self.loader(ds, batch_size=4, num_workers=1,
                               multiprocessing_context="spawn"))
        self.assertBatches(got, want)
        del got, want
        self.back_to_baseline()

    # --- workers' lives -------------------------------------------------------------------
    def test_persistent_workers(self):
        ds = datasets.WorkerIds()
        dl = self.loader(ds, batch_size=2, num_workers=2, persistent_workers=True,
                         worker_init_fn=datasets.record_worker)
        epochs = [list(dl) for _ in range(3)]
        want = list(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2,
                                                worker_init_fn=datasets.record_worker))
        for e in epochs:
            # Same samples, same worker for each batch (the user's worker_init_fn ran)...
            self.assertEqual([b[:, :2].tolist() for b in e], [b[:, :2].tolist() for b in want])
        # ... and the same worker processes in every epoch.
        pids = [sorted({int(p) for b in e for p in b[:, 2]}) for e in epochs]
        self.assertEqual(len(pids[0]), 2)
        self.assertEqual(pids[0], pids[1])
        self.assertEqual(pids[1], pids[2])
        # Early exit from a persistent loader: the next epoch starts over, complete.
        for i, b in enumerate(dl):
            if i == 1:
                break
        again = list(dl)
        self.assertEqual([b[:, :2].tolist() for b in again], [b[:, :2].tolist() for b in want])
        del epochs, again, b, e, dl
        self.back_to_baseline()

    def test_worker_killed(self):
        ds = datasets.Samples(n=40, kill_at=13)
        pattern = (r"DataLoader worker \(pid\(?s?\)? [0-9, ]+\) "
                   r"(is killed by signal|exited unexpectedly)")
        # torch's own loader says so too, unless the kill lands while a batch's fd is being
        # passed (then the fd's transfer fails first, with an OSError): no batch fd here.
        with self.assertRaises(Exception) as cm:
            for b in torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2):
                pass
        if isinstance(cm.exception, RuntimeError):
            self.assertRegex(str(cm.exception), pattern)
        with self.assertRaisesRegex(RuntimeError, pattern):
            for b in self.loader(ds, batch_size=2, num_workers=2):
                pass
        b = cm = None
        self.back_to_baseline()

    def test_worker_exception(self):
        ds = datasets.Samples(n=20, fail_at=9)
        for make in (torch.utils.data.DataLoader, self.loader):
            with self.assertRaisesRegex(ValueError, "sample 9 is broken"):
                list(make(ds, batch_size=2, num_workers=2))
        self.back_to_baseline()

    def test_loaders_in_a_row(self):
        # One loader after another in one process, each with a client of its own, while a
        # batch of an earlier one lives on: later clients map slabs earlier ones map, and
        # trims in between give empty slabs back so that later ones are new.
        ds = datasets.Samples(n=24)
        want = list(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=0))
        dl = self.loader(ds, batch_size=4, num_workers=2, persistent_workers=True)
        for epoch in range(2):
            for b in dl:
                pass
        kept = b
        del dl, b
        gc.collect()
        with self.assertRaisesRegex(ValueError, "sample 5 is broken"):
            list(self.loader(datasets.Samples(n=24, fail_at=5), batch_size=4, num_workers=2))
        for k in range(3):
            with gpupool.Client(self.socket) as c:
                c.trim()
            got = list(self.loader(ds, batch_size=4, num_workers=2, prefetch_factor=4))
            self.assertBatches(got, want)
            del got
        self.assertSame(kept, want[-1], "a batch of the first loader after the others")
        del kept
        self.back_to_baseline()

    def test_early_exit(self):
        dl = self.loader(datasets.Big(), batch_size=4, num_workers=2, prefetch_factor=4)
        it = iter(dl)
        first = next(it)
        self.assertTrue(torch.equal(first[3], torch.full((64, 1024), 3.0)))
        # The workers have made more than was taken; leaving the loop leaves none behind.
        self.wait_stats(lambda s: s["buffers"] > self.base["buffers"] + 1, "batches made ahead")
        del it
        del first, dl
        self.back_to_baseline()

    def test_buffers_return_when_batches_are_freed(self):
        for workers in (0, 2):
            with self.subTest(workers=workers):
                kept = []
                for i, b in enumerate(self.loader(datasets.Big(), batch_size=4,
                                                  num_workers=workers)):
                    if i % 2 == 0:
                        kept.append(b)
                    del b
                    gc.collect()
                    # Only the batches kept are held, and the few the workers made ahead
                    # (prefetch_factor 2 each) or whose opening they have not heard of yet:
                    # a bound that does not grow with the batches seen.
                    self.assertLessEqual(self.stats()["holds"], len(kept) + 4 * workers + 2)
                self.assertEqual(len(kept), 8)
                self.wait_stats(lambda s: s["holds"] == len(kept), "one hold per batch kept")
                self.assertTrue(torch.equal(kept[1][0], torch.full((64, 1024), 8.0)))
                del kept
                self.back_to_baseline()

    def test_forked_worker_leaves_the_main_process_holds_alone(self):
        # A forked worker inherits the main process's objects, gpupool holds among them,
        # with the main process's connection. Garbage that the main process has not
        # collected yet (a batch in a reference cycle) must not be released from a worker:
        # that release would go out on the main process's connection.
        batch = next(iter(self.loader(datasets.Big(), batch_size=4)))
        gc.collect()
        gc.disable()
        try:
            cycle = [batch]
            cycle.append(cycle)
            del batch, cycle
            held = self.stats()["holds"]
            self.assertGreaterEqual(held, 1)
            got = [b.item() for b in self.loader(datasets.Collecting(), batch_size=None,
                                                 num_workers=1, timeout=20)]
            self.assertEqual(got, [0, 1, 2, 3])
            self.assertEqual(self.stats()["holds"], held, "a worker released a hold of the "
                             "main process")
            gc.enable()
            gc.collect()
            self.assertEqual(self.stats()["holds"], held - 1)
        finally:
            gc.enable()
        self.back_to_baseline()

    def test_pool_choice(self):
        self.assertEqual(self.loader(datasets.Big()).pool, "main")
        with self.assertRaisesRegex(gpupool.GpupoolError, "no pool 'nope'"):
            self.loader(datasets.Big(), pool="nope")


if __name__ == "__main__":
    unittest.main()
