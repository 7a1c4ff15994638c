"""200 local consumers of one remote version cause one transfer: B fetches A's version once
(B's bytes fetched grow by one version's size, A serves one version) and all 200 read the
same local copy, bit-exact. Then the 200 wait with newer_than for A's next version: again
one transfer for all of them.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cluster import MIB, Cluster, run_tests, wait_for  # noqa: E402

N = 200
SIZE = 64 * MIB


def publish(node, seed):
    p = node.worker("publish", "w", SIZE, seed)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.startswith("published"), (out, err)
    return int(out.split()[1])


def consume(b, newer_than, seed, before_publish=None):
    p = b.worker("consumers", N, "A:w", 300, newer_than, seed)
    assert p.stdout.readline().strip() == "started"
    if before_publish:
        # Every consumer waits in the daemon before the version exists on A.
        wait_for(lambda: b.stats()["clients"] >= N, "%d consumers connected" % N, 60)
        before_publish()
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0 and out.startswith("ok"), (out, err)
    _, versions, n, buffers = out.split()
    assert int(n) == N and buffers == "1", "%s consumers saw %s local copies" % (n, buffers)
    return int(versions)


def test_200_consumers_one_transfer():
    with Cluster(("A", "B")) as cl:
        a, b = cl["A"], cl["B"]
        assert publish(a, 1) == 1
        fetched0 = b.peer("A")["bytes_fetched"]
        fetches0 = b.peer("A")["fetches"]
        served0 = a.peer("B")["versions_served"]
        assert consume(b, 0, 1) == 1
        moved = b.peer("A")["bytes_fetched"] - fetched0
        assert SIZE <= moved < 2 * SIZE, "200 consumers moved %d bytes for one %d-byte version" \
            % (moved, SIZE)
        assert a.peer("B")["versions_served"] - served0 == 1, a.peer("B")
        assert b.peer("A")["fetches"] - fetches0 == 1, b.peer("A")

        # Waiting for the next version: all 200 wait on B, A publishes once, one transfer.
        assert consume(b, 1, 2, before_publish=lambda: publish(a, 2)) == 2
        moved = b.peer("A")["bytes_fetched"] - fetched0
        assert 2 * SIZE <= moved < 3 * SIZE, "two versions moved %d bytes" % moved
        assert a.peer("B")["versions_served"] - served0 == 2, a.peer("B")
        assert b.peer("A")["fetches"] - fetches0 == 2, b.peer("A")


if __name__ == "__main__":
    run_tests([(k, v) for k, v in globals().items() if k.startswith("test_")])
