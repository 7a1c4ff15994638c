"""Zero copy across processes, hold lifetimes (garbage collection, close, process death),
waiting gets, and errors."""

import gc
import os
import signal
import time
import unittest

import numpy as np

from support import DaemonTestCase
import gpupool
import gpupool._lib


def counters(st):
    return (st["buffers"], st["holds"], st["names"])


class ZeroCopy(DaemonTestCase):
    def test_write_after_publish_is_visible(self):
        p = self.peer("write-after-publish", "zc/a", stdin=True)
        buffer_id = int(self.read_line(p, "buffer"))
        t = self.client.get("zc/a", timeout=10)
        self.assertEqual(t.buffer_id, buffer_id, "the consumer holds the producer's buffer")
        view = np.from_dlpack(t)
        # The consumer's NumPy view is the gpupool mapping itself.
        self.assertEqual(view.__array_interface__["data"][0], t.buffer_ptr)
        self.assertEqual(t.data_ptr, t.buffer_ptr)
        self.assertTrue((view == 1.0).all())
        p.stdin.write("go\n")
        p.stdin.flush()
        self.read_line(p, "written")
        # Same view, no new get: the producer's write after publish shows through.
        self.assertTrue((view == 2.0).all())
        p.stdin.close()
        self.assertEqual(p.wait(30), 0)
        del view
        t.release()
        self.client.unpublish("zc/a")

    def test_two_consumers_share_one_buffer(self):
        a = np.arange(100, dtype=np.int32)
        t = self.client.alloc(a.shape, a.dtype)
        np.asarray(t)[...] = a
        self.client.publish("zc/shared", t)
        with gpupool.Client(self.socket) as other:
            g1 = self.client.get("zc/shared", timeout=1)
            g2 = other.get("zc/shared", timeout=1)
            self.assertEqual(g1.buffer_id, g2.buffer_id)
            np.asarray(t)[7] = -7
            self.assertEqual(int(np.asarray(g2)[7]), -7)
            g2.release()
        g1.release()
        self.client.unpublish("zc/shared")


class Lifetimes(DaemonTestCase):
    def test_gc_releases_holds(self):
        self.client.publish("life/a", np.arange(16, dtype=np.uint8))
        base = counters(self.stats())
        t = self.client.get("life/a", timeout=1)
        self.assertEqual(self.stats()["holds"], base[1] + 1)
        arr = np.from_dlpack(t)
        del t
        gc.collect()
        # The NumPy view still holds the memory.
        self.assertEqual(self.stats()["holds"], base[1] + 1)
        self.assertEqual(arr.tolist(), list(range(16)))
        del arr
        gc.collect()
        self.assertEqual(counters(self.stats()), base)

    def test_release_and_context_manager(self):
        self.client.publish("life/b", np.zeros(4, dtype=np.float32))
        base = counters(self.stats())
        with self.client.get("life/b", timeout=1) as t:
            self.assertEqual(self.stats()["holds"], base[1] + 1)
        self.assertTrue(t.released)
        self.assertEqual(counters(self.stats()), base)
        t2 = self.client.get("life/b", timeout=1)
        t2.release()
        t2.release()  # idempotent
        self.assertEqual(counters(self.stats()), base)
        with self.assertRaises(BufferError):
            t2.__dlpack__()

    def test_alloc_freed_when_dropped(self):
        base = counters(self.stats())
        t = self.client.alloc((1 << 20,), "uint8")
        st = self.stats()
        self.assertEqual(st["buffers"], base[0] + 1)
        del t
        gc.collect()
        self.assertEqual(counters(self.stats()), base)

    def test_unpublish_frees_buffer_after_last_holder(self):
        base = counters(self.stats())
        self.client.publish("life/c", np.ones(8, dtype=np.int64))
        t = self.client.get("life/c", timeout=1)
        self.client.unpublish("life/c")
        self.assertEqual(self.stats()["buffers"], base[0] + 1, "the holder keeps it")
        self.assertEqual(np.asarray(t).tolist(), [1] * 8)
        t.release()
        self.assertEqual(counters(self.stats()), base)

    def test_process_death_releases_holds(self):
        self.client.publish("life/d", np.arange(32, dtype=np.float64))
        base = counters(self.stats())
        p = self.peer("get-and-hold", "life/d", 3)
        self.assertEqual(self.read_line(p, "held"), "3")
        self.assertEqual(self.stats()["holds"], base[1] + 3)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        self.wait_stats(lambda st: counters(st) == base, "the baseline %r" % (base,))

    def test_close_waits_for_exported_views(self):
        base = self.stats()
        c = gpupool.Client(self.socket, name="closer")
        self.assertEqual(self.stats()["clients"], base["clients"] + 1)
        c.publish("life/e", np.full(4, 9, dtype=np.int32))
        t = c.get("life/e", timeout=1)
        arr = np.from_dlpack(t)
        c.close()
        self.assertTrue(t.released, "close releases the client's tensors")
        # The exported view keeps its memory (and the connection) until it goes.
        self.assertEqual(arr.tolist(), [9] * 4)
        self.assertEqual(self.stats()["clients"], base["clients"] + 1)
        with self.assertRaises(gpupool.GpupoolError) as cm:
            c.get("life/e", timeout=0)
        self.assertEqual(cm.exception.name, "ECLOSED")
        del arr
        gc.collect()
        self.wait_stats(lambda st: st["clients"] == base["clients"], "one client fewer")
        self.client.unpublish("life/e")

    def test_names_outlive_the_producer(self):
        self.run_peer("publish-later", "life/f", 0)
        with self.client.get("life/f", timeout=5) as t:
            self.assertEqual(np.asarray(t).tolist(), list(range(10)))
        self.client.unpublish("life/f")


class Tokens(DaemonTestCase):
    def test_kept_share_outlives_its_client_and_opens_once(self):
        maker = gpupool.Client(self.socket, name="maker")
        t = maker.alloc(1000, "uint8", device="cpu")
        np.asarray(t)[:] = np.arange(1000) % 251
        token = maker.share(t)              # kept: the daemon holds the buffer for it
        plain = maker.share(t, keep=False)  # dies with the last hold
        t.release()
        maker.close()
        o = self.client.open(token)
        self.assertTrue(np.array_equal(np.asarray(o), (np.arange(1000) % 251).astype(np.uint8)))
        with self.assertRaises(gpupool.GpupoolError.ENOENT):
            self.client.open(token)         # a kept share opens once
        o2 = self.client.open(plain)        # the buffer lives (o holds it): a plain token opens
        self.assertEqual(o2.buffer_id, o.buffer_id)
        o.release()
        o2.release()
        with self.assertRaises(gpupool.GpupoolError.ENOENT):
            self.client.open(plain)
        with self.assertRaises(ValueError):
            self.client.open(b"short")


class WaitsAndErrors(DaemonTestCase):
    def test_get_waits_for_a_later_publish(self):
        p = self.peer("publish-later", "wait/a", 0.5)
        t0 = time.monotonic()
        with self.client.get("wait/a", timeout=20) as t:
            waited = time.monotonic() - t0
            self.assertEqual(np.asarray(t).tolist(), list(range(10)))
        self.assertGreater(waited, 0.3)
        self.assertEqual(p.wait(30), 0)
        self.client.unpublish("wait/a")

    def test_get_times_out(self):
        t0 = time.monotonic()
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.get("wait/never", timeout=0.3)
        self.assertGreaterEqual(time.monotonic() - t0, 0.25)
        e = cm.exception
        self.assertEqual(e.name, "ETIMEDOUT")
        self.assertEqual(e.code, -10)
        self.assertIn("wait/never", str(e))
        self.assertTrue(e.message)

    def test_get_missing_without_waiting(self):
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.get("wait/missing", timeout=0)
        self.assertEqual(cm.exception.name, "ENOENT")
        self.assertIn("wait/missing", str(cm.exception))

    def test_bad_names(self):
        for bad in ("", "x" * 300, "a\0b"):
            with self.subTest(name=bad[:10]):
                with self.assertRaises(gpupool.GpupoolError) as cm:
                    self.client.publish(bad, np.zeros(1))
                self.assertIn(cm.exception.name, ("ENAME", "EINVAL"))
                self.assertTrue(cm.exception.message)
                with self.assertRaises(gpupool.GpupoolError) as cm:
                    self.client.get(bad, timeout=0)
                self.assertIn(cm.exception.name, ("ENAME", "EINVAL"))

    def test_republish_and_missing(self):
        # Publishing a name again makes its next version; unpublishing twice fails.
        self.client.publish("err/dup", np.zeros(2))
        self.client.publish("err/dup", np.ones(2))
        t = self.client.get("err/dup", timeout=0)
        self.assertEqual(t.numpy().tolist(), [1.0, 1.0])
        t.release()
        self.client.unpublish("err/dup")
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.unpublish("err/dup")
        self.assertEqual(cm.exception.name, "ENOENT")

    def test_no_pool_for_device(self):
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.alloc((4,), "float32", device="cuda:0")
        self.assertEqual(cm.exception.name, "ENOENT")
        self.assertIn("cuda:0", str(cm.exception))
        with self.assertRaises(ValueError):
            self.client.alloc((4,), "float128")

    def test_too_big(self):
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.alloc((1 << 40,), "uint8")
        self.assertIn(cm.exception.name, ("ETOOBIG", "ENOSPC"))
        self.assertTrue(cm.exception.message)

    def test_stats(self):
        st = self.client.stats()
        for k in ("clients", "buffers", "holds", "names", "requests", "uptime_s"):
            self.assertIn(k, st)
        self.assertGreaterEqual(st["clients"], 1)
        pools = st["pools"]
        self.assertEqual(len(pools), 1)
        self.assertEqual(pools[0]["name"], "main")
        self.assertEqual(pools[0]["kind"], "host")
        self.assertEqual(pools[0]["capacity"], 256 << 20)


class Connection(unittest.TestCase):
    def test_no_daemon(self):
        try:
            gpupool._lib.lib()
        except gpupool.LibraryNotFoundError as e:
            self.skipTest(str(e))
        with self.assertRaises(gpupool.GpupoolError) as cm:
            gpupool.Client("/nonexistent/gpupool/gpupoold.sock")
        self.assertEqual(cm.exception.name, "ECONNECT")
        self.assertIn("/nonexistent/gpupool/gpupoold.sock", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
