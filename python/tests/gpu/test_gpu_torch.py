"""GPU tests: a torch producer process, torch and CuPy consumers, bit-exact, with stream
semantics (consumers work on non-default streams of their own while the producer's fill is
still queued behind a long kernel). Skipped with a message without torch+CUDA."""

import gc
import os
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
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

try:
    import cupy
except ImportError:
    cupy = None

import gpupool  # noqa: E402
from gpupool import _dlpack  # noqa: E402
from gpupool.testing import Daemon  # noqa: E402
from support import child_env  # noqa: E402

PEER = os.path.join(HERE, "gpu_peer.py")
N = 1 << 20


def expected(n, i, device="cuda:0"):
    return torch.arange(n, device=device, dtype=torch.float32).mul_(float(i + 1))


@unittest.skipUnless(HAVE_TORCH_CUDA, "GPU Python tests need torch with CUDA: " + WHY)
class TorchProducer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.environ.get("GPUPOOLD"):
            raise unittest.SkipTest("set GPUPOOLD to a gpupoold built with CUDA")
        try:
            cls.daemon = Daemon(backend="cuda", pools=(
                "name=gpu0,kind=device,device=0,capacity=2G,slab=256M",)).start()
        except RuntimeError as e:
            raise unittest.SkipTest("gpupoold cannot run its CUDA backend here: %s" % e)
        cls.socket = cls.daemon.socket

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def setUp(self):
        self.client = gpupool.Client(self.socket, name=self.id())
        self.addCleanup(self.client.close)

    def producer(self, cmd, name, count=1):
        p = subprocess.Popen([sys.executable, PEER, cmd, name, str(N), str(count)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=child_env(self.socket))
        self.addCleanup(p.kill)
        return p

    def wait_published(self, p):
        lines = []
        while True:
            line = p.stdout.readline()
            if not line:
                self.fail("producer exited early:\n%s%s" % ("".join(lines), p.stderr.read()))
            lines.append(line)
            if line.startswith("published"):
                return lines

    def test_torch_consumer_own_stream(self):
        p = self.producer("inplace", "t/a", 2)
        lines = self.wait_published(p)
        ids = [int(l.split()[1]) for l in lines if l.startswith("buffer")]
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for i in range(2):
                t = self.client.get("t/a/%d" % i, timeout=30, stream=s)
                self.assertEqual(t.buffer_id, ids[i], "published in place")
                self.assertEqual(t.device, "cuda:0")
                self.assertEqual(t.__dlpack_device__(), (_dlpack.kDLCUDA, 0))
                x = torch.from_dlpack(t)
                self.assertEqual(x.data_ptr(), t.buffer_ptr, "zero copy")
                # Compared on s, which waited on the ready event: the fill, not the zeros.
                self.assertTrue(bool(torch.equal(x, expected(N, i))), "bit-exact")
                del x
                t.release()
        self.assertEqual(p.wait(60), 0, p.stderr.read())
        for i in range(2):
            self.client.unpublish("t/a/%d" % i)

    def test_dlpack_stream_other_than_get_stream(self):
        p = self.producer("inplace", "t/b")
        self.wait_published(p)
        # get() on the legacy default stream; the consumer then imports on its own stream:
        # __dlpack__(stream=...) must order that stream after the ready event too.
        t = self.client.get("t/b/0", timeout=30)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x = torch.from_dlpack(t)
            self.assertTrue(bool(torch.equal(x, expected(N, 0))))
        del x
        t.release()
        self.assertEqual(p.wait(60), 0, p.stderr.read())
        self.client.unpublish("t/b/0")

    def test_foreign_torch_tensor_is_copied_and_compacted(self):
        p = self.producer("copy", "t/c")
        self.wait_published(p)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            t = self.client.get("t/c/0", timeout=30, stream=s)
            self.assertTrue(t.is_contiguous())
            self.assertEqual(t.shape, (N,))
            x = torch.from_dlpack(t)
            self.assertTrue(bool(torch.equal(x, expected(N, 0))))
        del x
        t.release()
        self.assertEqual(p.wait(60), 0, p.stderr.read())
        self.client.unpublish("t/c/0")

    def test_same_process_zero_copy_publish(self):
        t = self.client.alloc((4, 256), "float32", device="cuda:0")
        x = torch.from_dlpack(t)
        x.copy_(torch.arange(1024, device="cuda:0", dtype=torch.float32).view(4, 256))
        self.client.publish("t/d", x[1:3, ::2])
        g = self.client.get("t/d", timeout=1)
        self.assertEqual(g.buffer_id, t.buffer_id)
        self.assertEqual(g.strides, (256, 2))
        y = torch.from_dlpack(g)
        self.assertTrue(bool(torch.equal(y, x[1:3, ::2])))
        del y, x
        g.release()
        t.release()
        self.client.unpublish("t/d")

    def test_holds_return_after_release(self):
        base = self.client.stats()
        t = self.client.alloc((N,), "float32", device="cuda:0")
        x = torch.from_dlpack(t)
        x.fill_(1.0)
        del t
        gc.collect()
        self.assertEqual(self.client.stats()["holds"], base["holds"] + 1, "x keeps it")
        del x
        gc.collect()
        deadline = time.monotonic() + 10
        while self.client.stats()["holds"] != base["holds"]:
            self.assertLess(time.monotonic(), deadline, "hold never released")
            time.sleep(0.05)

    @unittest.skipIf(cupy is None, "CuPy is not installed")
    def test_cupy_consumer_own_stream(self):
        p = self.producer("inplace", "t/e")
        self.wait_published(p)
        with cupy.cuda.Device(0):
            cs = cupy.cuda.Stream(non_blocking=True)
            with cs:
                t = self.client.get("t/e/0", timeout=30, stream=cs)
                x = cupy.from_dlpack(t)
                self.assertEqual(x.data.ptr, t.buffer_ptr, "zero copy")
                want = cupy.arange(N, dtype=cupy.float32) * cupy.float32(1)
                got = cupy.asnumpy(x, stream=cs)
                want_h = cupy.asnumpy(want, stream=cs)
                cs.synchronize()
        self.assertEqual(got.tobytes(), want_h.tobytes(), "bit-exact")
        del x
        t.release()
        self.assertEqual(p.wait(60), 0, p.stderr.read())
        self.client.unpublish("t/e/0")


if __name__ == "__main__":
    unittest.main()
