"""Who may fetch what: a peer with the wrong secret is refused and both daemons log why; a
tenant that exports nothing is out of reach (the same ENOENT as a name that does not exist,
so nothing leaks about what exists); a tenant that exports only to B is out of C's reach; a
daemon that is not in the serving daemon's [peer] sections is refused.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from cluster import HIDDEN_UID, MIB, Cluster, pattern, run_tests, wait_for  # noqa: E402
import gpupool  # noqa: E402

WRONG_SECRET_LOG = "peer authentication failed"


def expect_error(client, name, code=None, timeout=5):
    try:
        t = client.get(name, timeout=timeout)
    except gpupool.GpupoolError as e:
        if code:
            assert e.name == code, "%s: expected %s, got %s: %s" % (name, code, e.name, e.message)
        return e
    t.release()
    raise AssertionError("%s was fetched" % name)


def test_wrong_secret():
    def configure(cl):
        cl["B"].secret_file = cl.write_secret("other", b"not-the-secret-A-knows-0123456789")

    with Cluster(("A", "B"), configure=configure) as cl:
        a, b = cl["A"], cl["B"]
        with a.client() as ca:
            ca.publish("weights", pattern(1, MIB))
        with b.client() as cb:
            e = expect_error(cb, "A:weights")
            assert "authentication" in e.message and "secret" in e.message, e.message
        # Each daemon logs the refusal as its side of the handshake fails, which may be just
        # after B's client got its answer (and a log line reaches the file within 100 ms).
        for d, who in ((a, "A"), (b, "B")):
            try:
                wait_for(lambda: WRONG_SECRET_LOG in d.log(), "%s logs the refusal" % who, timeout=5)
            except AssertionError:
                raise AssertionError("%s did not log the refusal:\n%s" % (who, d.log())) from None
        assert a.peer("B")["versions_served"] == 0, a.peer("B")
        assert b.peer("A")["bytes_fetched"] == 0, b.peer("A")


def test_secret_file_readable_by_others_refused():
    """A secret readable by group or other is no secret: the daemon refuses to start, whether
    it has [peer] sections or only serves (peer_listen and peer_secret_file, no [peer] yet)."""
    for names in (("A", "B"), ("A",)):
        def configure(cl):
            cl["A"].secret_file = cl.write_secret("loose", b"remote-tests-shared-secret-0123456789")
            os.chmod(cl["A"].secret_file, 0o644)

        cl = Cluster(names, configure=configure)
        try:
            cl.__enter__()
        except AssertionError as e:
            msg = str(e)
            assert "gpupoold of A exited" in msg, msg
            assert "loose" in msg and "chmod 600" in msg, msg
        else:
            cl.__exit__(None, None, None)
            raise AssertionError("gpupoold started with a secret file of mode 0644 (nodes %s)"
                                 % (names,))


def test_tenant_not_exported():
    with Cluster(("A", "B")) as cl:
        a, b = cl["A"], cl["B"]
        # Tenant "hidden" (uid nobody on both nodes) publishes on A and exports to no peer.
        p = a.worker("publish", "secret", MIB, 5, uid=HIDDEN_UID)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and out.startswith("published"), (out, err)
        with a.client() as ca:
            ca.publish("open", pattern(6, MIB))
        with b.client() as cb:
            # By tenant/name from tenant ml: the same answer as for a name that does not exist.
            e1 = expect_error(cb, "A:hidden/secret", "ENOENT", timeout=0)
            e2 = expect_error(cb, "A:hidden/nosuch", "ENOENT", timeout=0)
            assert (e1.message.replace("hidden/secret", "X").replace("secret", "X") ==
                    e2.message.replace("hidden/nosuch", "X").replace("nosuch", "X")), \
                (e1.message, e2.message)
            # Tenant ml's own name is reachable: the refusal above was the export rule.
            t = cb.get("A:open", timeout=30)
            assert np.array_equal(t.numpy(), pattern(6, MIB))
            t.release()
        # Tenant hidden on B asks for its own name on A (plain NAME: the same tenant there).
        p = b.worker("get", "A:secret", 0, uid=HIDDEN_UID)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 3 and out.split("\n")[-2].startswith("error ENOENT"), \
            (p.returncode, out, err)
        # Only A:open moved.
        assert MIB <= b.peer("A")["bytes_fetched"] < 2 * MIB, b.peer("A")


def test_export_to_some_peers():
    def configure(cl):
        cl["A"].exports = "B"

    with Cluster(("A", "B", "C"), configure=configure) as cl:
        a, b, c = cl["A"], cl["B"], cl["C"]
        with a.client() as ca:
            ca.publish("w", pattern(8, MIB))
        with b.client() as cb:
            t = cb.get("A:w", timeout=30)
            assert np.array_equal(t.numpy(), pattern(8, MIB))
            t.release()
        with c.client() as cc:
            expect_error(cc, "A:w", "ENOENT", timeout=0)


def test_unknown_peer_refused():
    """C lists A as a peer with the right secret, but A does not list C: refused."""
    def configure(cl):
        cl["A"].peer_names = ["B"]

    with Cluster(("A", "B", "C"), configure=configure) as cl:
        a, c = cl["A"], cl["C"]
        with a.client() as ca:
            ca.publish("w", pattern(9, MIB))
        with c.client() as cc:
            e = expect_error(cc, "A:w")
            assert "peer A" in e.message, e.message
        assert c.peer("A")["bytes_fetched"] == 0, c.peer("A")
        assert c.addr in a.log() or "not configured" in a.log() or "unknown peer" in a.log(), \
            "A did not log the refused peer:\n" + a.log()


if __name__ == "__main__":
    run_tests([(k, v) for k, v in globals().items() if k.startswith("test_")])
