"""Two gpupoolds in their own network namespaces, UCX over TCP, host backend: what B's clients
get from A is what A's clients published, bit for bit -- a buffer with its description, a
bundle of 1,000 members of every kind, a 1 GiB bundle -- and versions and newer_than work
across: B's version numbers are A's. Errors: a name A does not have, a peer that is not there.
"""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from cluster import GIB, MIB, Cluster, pattern, run_tests, wait_for  # noqa: E402
import gpupool  # noqa: E402

DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
          "float32", "float64", "bool", "complex64", "complex128")


def member(i):
    """Member i of the 1,000-member bundle: a dtype, a shape (some empty) and values."""
    dt = np.dtype(DTYPES[i % len(DTYPES)])
    shape = [(), (i % 7,), (3, i % 5 + 1), (2, 3, i % 4 + 1)][i % 4]
    n = int(np.prod(shape)) if shape else 1
    raw = pattern(1000 + i, n * dt.itemsize)
    if dt.kind == "b":
        a = (raw[:n] & 1).astype(bool)
    elif dt.kind in "fc":
        # Raw bits would give NaNs, which compare unequal: use exact small values.
        a = ((raw[:n].astype(np.int64) - 128) / 8).astype(dt)
    else:
        a = raw.view(dt)[:n].copy()
    return "layers.%d.%s" % (i, dt.name), a.reshape(shape)


def stats_equal_after(node, base, what):
    wait_for(lambda: node.usage() == base, "%s back to %r (%s)" % (node.name, base, what),
             timeout=30)


def test_buffer_bit_exact():
    with Cluster(("A", "B")) as cl:
        a, b = cl["A"], cl["B"]
        base_b = b.usage()
        x = pattern(7, 3 * 5 * 4096 * 4).view(np.float32).reshape(3, 5, 4096)
        with a.client() as ca:
            assert ca.publish("weights", x) == 1
        with b.client() as cb:
            t = cb.get("A:weights", timeout=60)
            assert t.version == 1, t.version
            assert t.shape == (3, 5, 4096) and str(t.dtype) == "float32", (t.shape, t.dtype)
            assert np.array_equal(t.numpy().view(np.uint32), x.view(np.uint32)), "bytes differ"
            t.release()
        st = b.peer("A")
        assert st["state"] == "connected", st
        assert st["bytes_fetched"] >= x.nbytes, st
        assert a.peer("B")["versions_served"] >= 1, a.peer("B")
        # The local copy belongs to B's pool: it counts there while held or named.
        assert b.usage()["used"] >= base_b["used"], b.usage()


def test_bundle_1000_members():
    with Cluster(("A", "B")) as cl:
        a, b = cl["A"], cl["B"]
        members = dict(member(i) for i in range(1000))
        with a.client() as ca:
            assert ca.publish_dict("state", members) == 1
        with b.client() as cb:
            td = cb.get_dict("A:state", timeout=60)
            assert td.version == 1
            got = td.numpy()
            assert list(got) == list(members), "member order or names differ"
            for k, v in members.items():
                g = got[k]
                assert g.dtype == v.dtype and g.shape == v.shape, (k, g.dtype, g.shape)
                assert g.tobytes() == v.tobytes(), "member %s differs" % k
            td.release()


def test_bundle_1gib():
    with Cluster(("A", "B")) as cl:
        a, b = cl["A"], cl["B"]
        n, size = 16, GIB // 16
        with a.client() as ca:
            spec = {"w%02d" % i: ((size,), "uint8") for i in range(n)}
            td = ca.alloc_dict(spec, device="cpu")
            views = td.numpy()
            for i in range(n):
                views["w%02d" % i][:] = pattern(100 + i, size)
            assert ca.publish_dict("big", td) == 1
            td.release()
        with b.client() as cb:
            got = cb.get_dict("A:big", timeout=300)
            views = got.numpy()
            for i in range(n):
                if not np.array_equal(views["w%02d" % i], pattern(100 + i, size)):
                    raise AssertionError("member w%02d of the 1 GiB bundle differs" % i)
            got.release()
        assert b.peer("A")["bytes_fetched"] >= GIB, b.peer("A")
        # A fetch moves each byte once.
        assert b.peer("A")["bytes_fetched"] < 2 * GIB, b.peer("A")


def test_versions_newer_than():
    with Cluster(("A", "B")) as cl:
        a, b = cl["A"], cl["B"]
        ca, cb = a.client(), b.client()
        try:
            for v in (1, 2, 3):
                assert ca.publish("step", pattern(v, MIB)) == v
            t = cb.get("A:step", timeout=60)
            assert t.version == 3, "B must see A's current version number, got %d" % t.version
            assert np.array_equal(t.numpy(), pattern(3, MIB))
            t.release()
            # Already newer: at once.
            t = cb.get("A:step", timeout=60, newer_than=2)
            assert t.version == 3
            t.release()
            # Not yet: waits for A's next version, then gets exactly that one.
            got = {}

            def waiter():
                try:
                    got["t"] = cb2.get("A:step", timeout=60, newer_than=3)
                except gpupool.GpupoolError as e:
                    got["e"] = e

            cb2 = b.client()
            th = threading.Thread(target=waiter)
            th.start()
            wait_for(lambda: b.stats()["clients"] >= 3 and not got, "the waiter is waiting",
                     timeout=10)
            assert ca.publish("step", pattern(4, MIB)) == 4
            th.join(60)
            assert "t" in got, got
            assert got["t"].version == 4 and np.array_equal(got["t"].numpy(), pattern(4, MIB))
            got["t"].release()
            cb2.close()
            # A version that does not come: ETIMEDOUT, as locally.
            try:
                cb.get("A:step", timeout=1, newer_than=4)
                raise AssertionError("newer_than=4 returned with no version 5 on A")
            except gpupool.GpupoolError as e:
                assert e.name == "ETIMEDOUT", (e.name, e.message)
        finally:
            ca.close()
            cb.close()


def map_inode(addr):
    """The inode of this process's file mapping that holds addr: a host slab is a memfd of
    its own, so two buffers lie in one slab exactly when their mappings share an inode."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return int(parts[4])
    raise AssertionError("no mapping of this process holds %#x" % addr)


def test_versions_reuse_memory():
    """Each version of a name fetched again and again goes in the memory of the version two
    back once nobody holds that (its slab is kept for the next version of the same size), not
    in new memory the kernel must zero first; never under a holder of an older version; and
    an operator's trim gives the kept memory back."""
    size = 80 * MIB  # over the 64M slabs: each local copy a slab of its own
    with Cluster(("A", "B"), slab_size="64M") as cl:
        a, b = cl["A"], cl["B"]
        ca, cb = a.client(), b.client()
        try:
            inodes = {}
            held = None
            for v in range(1, 7):
                assert ca.publish("ckpt", pattern(v, size)) == v
                t = cb.get("A:ckpt", timeout=120, newer_than=v - 1)
                assert t.version == v, t.version
                if not np.array_equal(t.numpy(), pattern(v, size)):
                    raise AssertionError("version %d fetched into a kept slab differs" % v)
                inodes[v] = map_inode(t.data_ptr)
                if v == 4:
                    held = t  # a holder of version 4 while 5 and 6 come
                else:
                    t.release()
            # v1 and v2 took new memory (the name still holds the version before when the
            # next is fetched); v3 lies where v1 did, v4 where v2 did, v5 where v1 and v3
            # did; v6 needs new memory: v5 is named, and a client holds v4.
            assert inodes[3] == inodes[1], ("version 3 not in version 1's freed slab: new "
                                            "memory for every version fetched", inodes)
            assert inodes[4] == inodes[2] and inodes[5] == inodes[1], inodes
            assert inodes[6] not in (inodes[4], inodes[5]), (
                "version 6 fetched into the slab of a version still held", inodes)
            assert np.array_equal(held.numpy(), pattern(4, size)), "version 4 changed under its holder"
            held.release()
            pools = b.stats()["pools"]
            assert sum(p["slabs"] for p in pools) <= 3, pools
            cb.unpublish("A:ckpt")
        finally:
            ca.close()
            cb.close()
        # Kept slabs are memory nobody uses: trim gives them back.
        b.ctl("trim")
        wait_for(lambda: sum(p["reserved"] for p in b.stats()["pools"]) == 0,
                 "B's pools back at 0 reserved bytes after trim", timeout=30)


def test_errors():
    with Cluster(("A", "B", "C")) as cl:
        a, b, c = cl["A"], cl["B"], cl["C"]
        base_b = b.usage()
        with b.client() as cb:
            try:
                cb.get("A:nosuch", timeout=0)
                raise AssertionError("a name A does not have was found")
            except gpupool.GpupoolError as e:
                assert e.name == "ENOENT", (e.name, e.message)
            # C stops: its peers get told where, why and what to check.
            c.stop()
            try:
                cb.get("C:anything", timeout=5)
                raise AssertionError("a fetch from a stopped peer succeeded")
            except gpupool.GpupoolError as e:
                msg = e.message
                assert "peer C" in msg and "unreachable" in msg and c.addr in msg, msg
            assert b.peer("C")["state"] != "connected", b.peer("C")
            assert b.peer("C")["last_error"], b.peer("C")
            # A name that is no peer's stays a local name.
            try:
                cb.get("Z:x", timeout=0)
                raise AssertionError("Z:x was found")
            except gpupool.GpupoolError as e:
                assert e.name == "ENOENT", (e.name, e.message)
        stats_equal_after(b, base_b, "failed fetches leave nothing on B")
        del a


if __name__ == "__main__":
    run_tests([(k, v) for k, v in globals().items() if k.startswith("test_")])
