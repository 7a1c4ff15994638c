"""What survives a crash of the daemon, from Python: under ``gpupoold --supervise`` (its own
fd store) a kill -9 of the daemon keeps the names a client published, with their bytes and
versions, and Client.lost_names() reports only what the new daemon does not have (a published
file: its fd is not kept)."""

import os
import signal
import tempfile
import time
import unittest

import numpy as np

import gpupool
from gpupool.testing import Daemon


def _child(pid):
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            kids = f.read().split()
    except OSError:
        return 0
    return int(kids[0]) if kids else 0


class Survive(unittest.TestCase):
    def setUp(self):
        if not os.environ.get("GPUPOOLD"):
            raise unittest.SkipTest("set GPUPOOLD to the gpupoold binary (ctest does)")
        os.environ["GPUPOOL_SUPERVISE_MAX_DELAY_MS"] = "50"
        self.daemon = Daemon(pools=("name=main,kind=host,capacity=64M,slab=4M",), args=("--supervise",)).start()
        self.addCleanup(self.daemon.stop)

    def wait_child(self, old):
        end = time.monotonic() + 10
        while time.monotonic() < end:
            c = _child(self.daemon.proc.pid)
            if c and c != old:
                return c
            time.sleep(0.01)
        self.fail("the supervisor did not start the daemon again:\n" + self.daemon.log())

    def test_names_survive_kill9_and_lost_names_says_what_did_not(self):
        fd, path = tempfile.mkstemp(prefix="gpupool-survive-")
        os.write(fd, b"x" * 8192)
        os.close(fd)
        self.addCleanup(os.unlink, path)
        data = np.arange(10000, dtype=np.float32)
        with gpupool.Client(self.daemon.socket, name="survivor") as c:
            c.publish("weights", data)
            v2 = c.publish("weights", data * 2)
            c.publish_file("notes", path)
            daemon = self.wait_child(0)
            os.kill(daemon, signal.SIGKILL)
            self.wait_child(daemon)
            t = c.get("weights", timeout=10)
            np.testing.assert_array_equal(np.asarray(t), data * 2)
            self.assertEqual(c.lost_names(), ["notes"])
            self.assertEqual(c.lost_names(), [])  # reported once
            self.assertIsNotNone(v2)


if __name__ == "__main__":
    unittest.main()
