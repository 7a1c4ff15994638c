"""examples/python/producer.py and consumer.py, run as the separate processes they are."""

import os
import subprocess
import sys
import unittest

from support import REPO, DaemonTestCase, child_env

EXAMPLES = os.path.join(REPO, "examples", "python")


class Examples(DaemonTestCase):
    def run_example(self, script, *args, expect_rc=0):
        p = subprocess.run([sys.executable, os.path.join(EXAMPLES, script),
                            "--socket", self.socket] + [str(a) for a in args],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=child_env(self.socket), timeout=120)
        self.assertEqual(p.returncode, expect_rc, "%s %s:\n%s%s" % (script, args, p.stdout,
                                                                    p.stderr))
        return p.stdout + p.stderr

    def test_producer_then_consumer(self):
        if not os.path.isdir(EXAMPLES):
            self.skipTest("examples/python is not in this tree")
        base = self.stats()
        out = self.run_example("producer.py", "--name", "ex", "--count", 3, "--size", 65536,
                               "--mode", "numpy")
        self.assertEqual(out.count("no copy"), 3, out)
        self.assertEqual(self.stats()["names"], base["names"] + 3)
        out = self.run_example("consumer.py", "--name", "ex", "--count", 3, "--size", 65536,
                               "--mode", "numpy", "--timeout", 5)
        self.assertEqual(out.count("bit-exact"), 3, out)
        self.assertIn("3 of 3 tensors matched", out)
        # The consumer unpublished what it read: everything went back.
        self.wait_stats(lambda st: (st["names"], st["buffers"], st["holds"]) ==
                        (base["names"], base["buffers"], base["holds"]), "the baseline")

    def test_consumer_reports_missing_tensor(self):
        if not os.path.isdir(EXAMPLES):
            self.skipTest("examples/python is not in this tree")
        out = self.run_example("consumer.py", "--name", "nothing", "--count", 1, "--mode",
                               "numpy", "--timeout", 0.2, expect_rc=1)
        self.assertIn("ETIMEDOUT", out)


if __name__ == "__main__":
    unittest.main()
