"""A three-node tree A -> B -> C: B fetches A's version, C fetches B's copy of it (the name
"A:w" on B, asked for as "B:A:w"), so A sends the version once however many nodes get it.
C lists only B as a peer; A never hears of C. Versions go down the tree with their numbers,
and a new version on A reaches C through B.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from cluster import MIB, Cluster, pattern, run_tests  # noqa: E402

SIZE = 256 * MIB


def configure(cl):
    cl["A"].peer_names = ["B"]
    cl["B"].peer_names = ["A", "C"]
    cl["C"].peer_names = ["B"]


def test_tree():
    with Cluster(("A", "B", "C"), configure=configure) as cl:
        a, b, c = cl["A"], cl["B"], cl["C"]
        ca, cb, cc = a.client(), b.client(), c.client()
        try:
            for v in (1, 2):
                assert ca.publish("w", pattern(v, SIZE)) == v
                tb = cb.get("A:w", timeout=120, newer_than=v - 1)
                assert tb.version == v
                tc = cc.get("B:A:w", timeout=120, newer_than=v - 1)
                assert tc.version == v, "C got version %d of B's copy, not %d" % (tc.version, v)
                assert np.array_equal(tc.numpy(), pattern(v, SIZE)), "C's bytes differ"
                tb.release()
                tc.release()
            # A sent each version once (to B); B sent each once (to C).
            assert a.peer("B")["versions_served"] == 2, a.peer("B")
            assert b.peer("C")["versions_served"] == 2, b.peer("C")
            assert 2 * SIZE <= b.peer("A")["bytes_fetched"] < 3 * SIZE, b.peer("A")
            assert 2 * SIZE <= c.peer("B")["bytes_fetched"] < 3 * SIZE, c.peer("B")
            assert "C" not in a.peers(), a.peers()
        finally:
            ca.close()
            cb.close()
            cc.close()


if __name__ == "__main__":
    run_tests([(k, v) for k, v in globals().items() if k.startswith("test_")])
