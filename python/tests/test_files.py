"""Read-only file objects from Python: a file published by one process is viewed by another
through NumPy without a copy, ranges and offsets included; bad input and a file that changed
after publishing raise GpupoolError with the reason."""

import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import gpupool
from support import DaemonTestCase, child_env

CONSUMER = r"""
import sys
import numpy as np
import gpupool
with gpupool.Client(name="file-consumer") as c:
    t = c.get_file_array(sys.argv[1], "float32", shape=(256, 1024), timeout=10)
    a = np.asarray(t)
    assert not a.flags.writeable
    print("sum", float(a.astype(np.float64).sum()), a.shape, t.read_only, t.device)
"""


class Files(DaemonTestCase):
    def setUp(self):
        super().setUp()
        fd, self.path = tempfile.mkstemp(prefix="gpupool-file-", suffix=".bin")
        os.close(fd)
        self.addCleanup(os.unlink, self.path)
        self.data = np.arange(256 * 1024, dtype=np.float32)
        with open(self.path, "wb") as f:
            f.write(b"HEAD" * 1024)  # 4096 bytes of header before the array
            f.write(self.data.tobytes())

    def test_numpy_view_across_processes(self):
        info = self.client.publish_file("weights", self.path, offset=4096)
        self.addCleanup(self.client.unpublish, "weights")
        self.assertEqual(info["length"], self.data.nbytes)
        p = subprocess.run([sys.executable, "-c", CONSUMER, "weights"], env=child_env(self.socket),
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("sum %r" % float(self.data.astype(np.float64).sum()), p.stdout)
        self.assertIn("True cpu", p.stdout)

    def test_views_offsets_and_shapes(self):
        self.client.publish_file("w", self.path, offset=4096, length=self.data.nbytes)
        self.addCleanup(self.client.unpublish, "w")
        with self.client.get_file_array("w", np.float32) as t:
            self.assertEqual(t.shape, (self.data.size,))
            self.assertTrue(t.read_only)
            a = np.asarray(t)
            self.assertTrue(np.array_equal(a, self.data))
            with self.assertRaises(ValueError):
                a[0] = 1  # read-only view
        t = self.client.get_file_array("w", "int32", shape=(4, 8), offset=400)
        self.assertTrue(np.array_equal(t.numpy(), self.data[100:132].view(np.int32).reshape(4, 8)))
        with self.assertRaises(ValueError):
            self.client.get_file_array("w", np.float32, shape=(self.data.size + 1,))
        with self.assertRaises(gpupool.GpupoolError) as e:
            self.client.get_file_array("w", np.float32, device="cuda")
        self.assertEqual(e.exception.name, "ENOTSUP")

    def test_bad_input(self):
        with self.assertRaises(gpupool.GpupoolError) as e:
            self.client.publish_file("x", self.path + ".missing")
        self.assertEqual(e.exception.name, "ENOENT")
        with self.assertRaises(gpupool.GpupoolError) as e:
            self.client.publish_file("x", os.path.dirname(self.path))
        self.assertEqual(e.exception.name, "EINVAL")
        with self.assertRaises(gpupool.GpupoolError) as e:
            self.client.publish_file("x", self.path, offset=4096, length=self.data.nbytes + 1)
        self.assertEqual(e.exception.name, "EINVAL")
        self.assertIn("past the end", str(e.exception))
        with self.assertRaises(gpupool.GpupoolError) as e:
            self.client.get_file_array("nothing", np.uint8)
        self.assertEqual(e.exception.name, "ENOENT")

    def test_changed_file_is_refused(self):
        self.client.publish_file("c", self.path)
        self.addCleanup(self.client.unpublish, "c")
        os.truncate(self.path, 100)
        with self.assertRaises(gpupool.GpupoolError) as e:
            self.client.get_file_array("c", np.uint8)
        self.assertEqual(e.exception.name, "ESTALE")


if __name__ == "__main__":
    unittest.main()
