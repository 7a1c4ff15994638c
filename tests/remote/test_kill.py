"""A fetch killed on either side leaves nothing behind, the getter is told why, and the next
fetch works. The links are capped (netns.sh GPUPOOL_NETNS_RATE) so that a 1 GiB fetch lasts
seconds and the kill lands in its middle: the tests wait until the fetch is in flight on B
and A holds the version for it, then SIGKILL.

- The source daemon (A) dies mid-fetch: B's getter gets an error naming peer A and saying to
  retry; B is back to its baseline (buffers, holds, names, pool bytes); A restarted and the
  name published again, the next fetch is bit-exact.
- The getter process on B dies mid-fetch: B drops the fetch and A lets go of the version it
  held for it (A's holds back to baseline); B back to baseline; a new getter fetches it.
- The source stops just after serving, 30 times over: B stays up through each.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cluster import GIB, Cluster, pattern, run_tests, wait_for  # noqa: E402

RATE = "800mbit"  # about 100 MB/s: 1 GiB takes about 10 s
SIZE = GIB
SEED = 42


def publish_big(node):
    p = node.worker("publish", "big", SIZE, SEED)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0 and out.startswith("published"), (out, err)
    return int(out.split()[1])


def mid_fetch(a, b, base_a):
    """Wait until B's fetch from A is under way: in flight on B, and A holding the version for
    it (A answered and the pull runs; on the capped link it lasts seconds). Returns B's bytes
    fetched then, which only a completed fetch raises."""
    wait_for(lambda: b.peer(a.name)["fetches_in_flight"] >= 1 and
             a.usage()["holds"] > base_a["holds"],
             "a fetch from %s in flight, %s holding the version" % (a.name, a.name),
             timeout=120, interval=0.05)
    return b.peer(a.name)["bytes_fetched"]


def test_source_killed_mid_fetch():
    with Cluster(("A", "B"), rate=RATE) as cl:
        a, b = cl["A"], cl["B"]
        publish_big(a)
        base_a, base_b = a.usage(), b.usage()
        getter = b.worker("get", "A:big", 600)
        assert getter.stdout.readline().strip() == "started"
        fetched = mid_fetch(a, b, base_a)
        a.kill(signal.SIGKILL)
        out, err = getter.communicate(timeout=120)
        assert getter.returncode == 3, (getter.returncode, out, err)
        assert out.startswith("error "), out
        assert "peer A" in out and "retry" in out, "the getter was not told why: " + out
        wait_for(lambda: b.peer("A")["fetches_in_flight"] == 0, "B's fetch from A ended", 30)
        wait_for(lambda: b.usage() == base_b, "B back to %r" % base_b, 30)
        assert b.peer("A")["bytes_fetched"] == fetched, "the fetch completed before the kill"
        assert b.peer("A")["state"] != "connected", b.peer("A")
        # A comes back (its names are gone with it): published again, fetched whole.
        a.start()
        publish_big(a)
        getter = b.worker("get", "A:big", 600, SEED)
        out, err = getter.communicate(timeout=600)
        assert getter.returncode == 0 and "ok" in out, (out, err)
        assert b.peer("A")["state"] == "connected", b.peer("A")


def test_getter_killed_mid_fetch():
    with Cluster(("A", "B"), rate=RATE) as cl:
        a, b = cl["A"], cl["B"]
        publish_big(a)
        base_a, base_b = a.usage(), b.usage()
        served = a.peer("B")["versions_served"]
        getter = b.worker("get", "A:big", 600)
        assert getter.stdout.readline().strip() == "started"
        mid_fetch(a, b, base_a)
        getter.send_signal(signal.SIGKILL)
        getter.communicate()
        wait_for(lambda: b.peer("A")["fetches_in_flight"] == 0, "B's fetch from A ended", 60)
        wait_for(lambda: b.usage() == base_b, "B back to %r" % base_b, 60)
        wait_for(lambda: a.usage() == base_a, "A back to %r" % base_a, 60)
        # Nothing was published from the abandoned fetch (it may have run to its end).
        assert b.stats()["names"] == base_b["names"], b.stats()
        assert b.peer("A")["state"] == "connected", b.peer("A")
        # The next fetch works, and is a fetch of its own.
        before = b.peer("A")["bytes_fetched"]
        getter = b.worker("get", "A:big", 600, SEED)
        out, err = getter.communicate(timeout=600)
        assert getter.returncode == 0 and "ok" in out, (out, err)
        assert b.peer("A")["bytes_fetched"] - before >= SIZE, b.peer("A")
        assert a.peer("B")["versions_served"] >= served + 1, a.peer("B")


def test_source_stopped_after_fetches():
    """A source that stops (SIGTERM) just after serving, 30 times over, at three points (at
    once, after the getter read the copy, after it let go of it): the fetching daemon stays
    up, says the peer is gone, and fetches again once it is back. Each restart makes B's UCX
    connect anew, and the stop lands while that connection may still be settling."""
    with Cluster(("A", "B")) as cl:
        a, b = cl["A"], cl["B"]
        for round_ in range(30):
            with a.client() as ca:
                ca.publish_dict("state", {"x%d" % i: pattern(round_ * 100 + i, 4096)
                                          for i in range(16)})
            with b.client() as cb:
                td = cb.get_dict("A:state", timeout=60, newer_than=0)
                if round_ % 3 == 0:
                    a.stop()
                assert td.numpy()["x7"].tobytes() == pattern(round_ * 100 + 7, 4096).tobytes()
                if round_ % 3 == 1:
                    a.stop()
                td.release()
                cb.unpublish("A:state")
            if round_ % 3 == 2:
                a.stop()
            wait_for(lambda: b.peer("A")["state"] != "connected", "B sees A gone", 30)
            assert b.proc.poll() is None, "B died when A stopped:\n" + b.log()
            a.start()


if __name__ == "__main__":
    run_tests([(k, v) for k, v in globals().items() if k.startswith("test_")])
