"""Shared pieces of the Python tests: a private daemon per test class, helper processes,
and polling of the daemon's counters.

The daemon binary comes from $GPUPOOLD and the library from $GPUPOOL_LIBRARY (ctest sets
both); without GPUPOOLD the tests are skipped with a message saying what to set.
"""

import os
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)
REPO = os.path.dirname(PYROOT)
if PYROOT not in sys.path:
    sys.path.insert(0, PYROOT)

import gpupool  # noqa: E402
from gpupool.testing import Daemon  # noqa: E402

PEER = os.path.join(HERE, "peer.py")


def child_env(socket):
    env = dict(os.environ)
    env["GPUPOOL_SOCKET"] = socket
    env["PYTHONPATH"] = PYROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class DaemonTestCase(unittest.TestCase):
    """Starts one host-backend gpupoold for the class; self.client is connected to it."""

    backend = "host"
    pools = ("name=main,kind=host,capacity=256M,slab=16M",)

    @classmethod
    def setUpClass(cls):
        if not os.environ.get("GPUPOOLD"):
            raise unittest.SkipTest("set GPUPOOLD to the gpupoold binary (ctest does) and "
                                    "GPUPOOL_LIBRARY to libgpupool-client.so")
        cls.daemon = Daemon(backend=cls.backend, pools=cls.pools).start()
        cls.socket = cls.daemon.socket

    @classmethod
    def tearDownClass(cls):
        d = getattr(cls, "daemon", None)
        if d is not None:
            log = d.log()
            d.stop()
            # A daemon that died during the tests fails the class, with its log.
            if d.died is not None:
                raise AssertionError("gpupoold died during the tests with status %s:\n%s"
                                     % (d.died, log))

    def setUp(self):
        self.client = gpupool.Client(self.socket, name=self.id())
        self.addCleanup(self.client.close)

    # --- helpers ---------------------------------------------------------------------
    def peer(self, *args, stdin=False):
        """Start tests/peer.py with args, connected to this class's daemon."""
        p = subprocess.Popen([sys.executable, PEER] + [str(a) for a in args],
                             stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=child_env(self.socket), text=True)
        self.addCleanup(_reap, p)
        return p

    def run_peer(self, *args, timeout=60):
        p = self.peer(*args)
        out, err = p.communicate(timeout=timeout)
        self.assertEqual(p.returncode, 0, "peer %s failed:\n%s%s" % (args, out, err))
        return out

    def read_line(self, p, expect_prefix, timeout=30):
        """The next stdout line of p, which must start with expect_prefix."""
        deadline = time.monotonic() + timeout
        line = p.stdout.readline()
        if not line.startswith(expect_prefix):
            rest_out = ""
            if p.poll() is not None or time.monotonic() > deadline:
                rest_out = p.stdout.read()
            self.fail("peer said %r, expected %r...\n%s%s" % (
                line, expect_prefix, rest_out, p.stderr.read() if p.poll() is not None else ""))
        return line[len(expect_prefix):].strip()

    def stats(self):
        return self.client.stats()

    def wait_stats(self, pred, what, timeout=10.0):
        """Poll the daemon's counters until pred(stats) holds."""
        deadline = time.monotonic() + timeout
        st = self.stats()
        while not pred(st):
            if time.monotonic() > deadline:
                self.fail("daemon counters never reached %s: %r" % (what, {
                    k: v for k, v in st.items() if k != "pools"}))
            time.sleep(0.02)
            st = self.stats()
        return st


def _reap(p):
    if p.poll() is None:
        p.kill()
    p.wait()
    for f in (p.stdin, p.stdout, p.stderr):
        if f:
            f.close()
