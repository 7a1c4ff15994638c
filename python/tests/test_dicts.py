"""Dicts of tensors handed over in one request (bundles), and versions of a name: produced in
one process and read in another byte for byte, newer_than waits, old versions kept readable
by their holders and freed exactly once, the copy path, and bad input."""

import ctypes
import gc
import os
import signal
import time
import unittest

import numpy as np

from support import DaemonTestCase
import gpupool
import peer
from gpupool import _bundle, _lib


def used(st):
    return st["pools"][0]["used"]


def counters(st):
    return (st["buffers"], st["holds"], st["names"], used(st))


class MemberTables(unittest.TestCase):
    """The struct-packed tables agree with the header's structs (no daemon needed)."""

    def test_layouts(self):
        _lib.check_layouts()

    def test_parse_synthetic_table(self):
        n = 5
        arr = (_lib.Member * n)()
        names = [b"a", b"b.w", b"raw", b"strided", "\u00e9".encode()]
        for i in range(n):
            m = arr[i]
            m.name = names[i]
            m.ptr = 0x10000 + i * 256
            m.size = 64
            m.has_meta = 1
            m.meta.dtype_code, m.meta.dtype_bits, m.meta.dtype_lanes = 2, 32, 1
            m.meta.ndim = 2
            m.meta.shape[0], m.meta.shape[1] = 4, 4
            m.meta.byte_offset = 0
            m.buffer = 0
            m.offset = i * 256
        arr[2].has_meta = 0
        arr[3].meta.strides_present = 1
        arr[3].meta.strides[0], arr[3].meta.strides[1] = 1, 4
        arr[4].meta.byte_offset = 8
        arr[4].meta.ndim = 1
        arr[4].meta.shape[0] = 14
        lay = _bundle.parse_members(arr, n)
        self.assertEqual(lay.names, ["a", "b.w", "raw", "strided", "\u00e9"])
        m = lay.members
        self.assertEqual(m[0], ("a", 0, 0, gpupool.dtype("float32"), (4, 4), None, 64))
        self.assertEqual(m[2].dtype.name, "uint8")
        self.assertEqual(m[2].shape, (64,))
        self.assertEqual(m[3].strides, (1, 4))
        self.assertEqual(m[4].offset, 4 * 256 + 8)
        # The same table at other addresses is the same layout, parsed once.
        for i in range(n):
            arr[i].ptr += 1 << 20
        self.assertIs(_bundle.parse_members(arr, n), lay)
        # Runs: members 0 and 1 have one type and shape 256 bytes apart.
        runs = lay.runs
        self.assertEqual([r[6] for r in runs], [[0, 1], [2], [3], [4]])
        self.assertEqual(runs[0][5], 256)

    def test_runs_of_interleaved_layers(self):
        # A model's layers interleave members of one shape (q and o projections, two
        # norms): each kind repeats with a period and is viewed as a few runs, not pairs.
        bf16 = gpupool.dtype("bfloat16")
        h, kv, inter, layers = 64, 16, 256, 16
        order = [("q", (h, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, h)),
                 ("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter)),
                 ("ln1", (h,)), ("ln2", (h,))]
        members, off = [], 0
        for name, shape in [("embed", (1000, h))] + [
                ("l%d.%s" % (i, n), s) for i in range(layers) for n, s in order] + [
                ("norm", (h,))]:
            size = int(np.prod(shape)) * 2
            members.append(_bundle.Member((name, 0, off, bf16, shape, None, size)))
            off += (size + 255) // 256 * 256
        runs = _bundle.plan_runs(members)
        # embed, q, k, v, o, gate, up, down, ln1, ln2, norm
        self.assertEqual(len(runs), 11)
        self.assertEqual(sorted(i for r in runs for i in r[6]), list(range(len(members))))
        for part, dt, shape, strides, first, step, idx, alone in runs:
            self.assertFalse(alone)
            for k, i in enumerate(idx):
                self.assertEqual(members[i][2], first + k * step)
                self.assertEqual(members[i][4], shape)
        self.assertEqual([r[6][0] for r in runs], sorted(r[6][0] for r in runs))

    def test_numpy_views_of_runs(self):
        n = 6
        region = np.zeros(n * 64, dtype=np.uint8)
        arr = (_lib.Member * n)()
        keep = [("m%d" % i).encode() for i in range(n)]
        for i in range(n):
            m = arr[i]
            m.name = keep[i]
            m.size = 48
            m.has_meta = 1
            m.meta.dtype_code, m.meta.dtype_bits, m.meta.dtype_lanes = 0, 32, 1
            m.meta.ndim = 2
            m.meta.shape[0], m.meta.shape[1] = 3, 4
            m.offset = i * 64
        lay = _bundle.parse_members(arr, n)
        views = _bundle.numpy_views(lay, lambda part: region)
        self.assertEqual(list(views), ["m%d" % i for i in range(n)])
        for i, v in enumerate(views.values()):
            v[...] = i + 1
        for i in range(n):
            got = region[i * 64:i * 64 + 48].view(np.int32)
            self.assertTrue((got == i + 1).all())
            self.assertEqual(region[i * 64 + 48:(i + 1) * 64].sum(), 0, "no spill into padding")


class Dicts(DaemonTestCase):
    def test_produce_in_one_process_get_in_another(self):
        out = self.run_peer("dict-produce", "d/a", 3)
        self.assertIn("version 1", out)
        self.assertIn("buffers 1", out, "a small dict is allocated in one buffer")
        with self.client.get_dict("d/a", timeout=5) as td:
            self.assertEqual(td.version, 1)
            self.assertEqual(td.name, "d/a")
            self.assertEqual(list(td), [n for n, _, _ in peer.DICT_SPEC])
            self.assertEqual(len(td), len(peer.DICT_SPEC))
            for n, shape, dt in peer.DICT_SPEC:
                t = td[n]
                self.assertIsInstance(t, gpupool.Tensor)
                self.assertEqual((t.shape, t.dtype), (shape, dt), n)
                self.assertEqual(t.version, 1)
            self.assertTrue(peer.dict_matches(td, 3))
            # Member Tensors read the same bytes as the dict's NumPy views.
            want = peer.dict_values(3)
            self.assertEqual(np.asarray(td["embed"]).tobytes(), want["embed"].tobytes())
            self.assertEqual(td["layer.0.w"].numpy(raw=True).tobytes(),
                             want["layer.0.w"].tobytes())
            self.assertEqual(np.from_dlpack(td["ids"]).tolist(), want["ids"].tolist())
            # One buffer, members at increasing offsets inside it, each aligned.
            ptrs = [td[n].data_ptr for n, shape, _ in peer.DICT_SPEC if shape != (0, 3)]
            self.assertEqual(len({td[n].buffer_id for n in td}), 1)
            self.assertEqual(ptrs, sorted(ptrs))
        self.client.unpublish("d/a")

    def test_this_process_produces_another_reads(self):
        version, td = peer.produce_dict(self.client, "d/b", 5)
        self.assertEqual(version, 1)
        self.assertEqual(td.version, 0, "an allocation is not a published version")
        out = self.run_peer("dict-check", "d/b", 0, 5)
        self.assertIn("version 1", out)
        self.assertIn("match yes", out)
        td.release()
        self.client.unpublish("d/b")

    def test_zero_copy(self):
        td = self.client.alloc_dict({"x": ((4,), "int32"), "y": ((2, 2), "float64")})
        views = td.numpy()
        views["x"][...] = [1, 2, 3, 4]
        self.client.publish_dict("d/zc", td)
        with self.client.get_dict("d/zc", timeout=1) as got:
            self.assertEqual(got["x"].buffer_id, td["x"].buffer_id)
            g = got.numpy()
            self.assertEqual(g["x"].tolist(), [1, 2, 3, 4])
            views["x"][0] = 42  # a write after publish shows through: it is one memory
            self.assertEqual(int(g["x"][0]), 42)
            del g
        # A plain dict of views of gpupool memory is published in place too.
        self.client.publish_dict("d/zc2", {"yy": views["y"], "x": td["x"]})
        with self.client.get_dict("d/zc2", timeout=1) as got:
            self.assertEqual(list(got), ["yy", "x"])
            self.assertEqual(got["yy"].buffer_id, td["y"].buffer_id)
            self.assertEqual(got["x"].data_ptr - got["x"].buffer_ptr,
                             td["x"].data_ptr - td["x"].buffer_ptr)
            self.assertEqual(got.numpy()["x"].tolist(), [42, 2, 3, 4])
        del views
        td.release()
        self.client.unpublish("d/zc")
        self.client.unpublish("d/zc2")

    def test_copy_path_plain_numpy(self):
        base = np.arange(6 * 8, dtype=np.int32).reshape(6, 8)
        src = {
            "slice": base[::2, 1::3],                            # not contiguous
            "reversed": base[::-1, ::-1],                        # negative strides
            "fortran": np.asfortranarray(base.astype(np.float64)),
            "scalar": np.array(2.5, dtype=np.float32),
            "empty": np.zeros((0, 4), dtype=np.int16),
        }
        for name in peer.NUMPY_DTYPES:
            src["dt/" + name] = peer.sample_array(name)
        version = self.client.publish_dict("d/copy", src)
        self.assertEqual(version, 1)
        with self.client.get_dict("d/copy", timeout=1) as td:
            self.assertEqual(list(td), list(src))
            got = td.numpy()
            for k, a in src.items():
                self.assertEqual(got[k].shape, a.shape, k)
                self.assertEqual(got[k].dtype, a.dtype, k)
                self.assertTrue(got[k].flags.c_contiguous, "%s arrives compacted" % k)
                self.assertEqual(got[k].tobytes(), np.ascontiguousarray(a).tobytes(), k)
                self.assertTrue(td[k].is_contiguous())
        self.client.unpublish("d/copy")

    def test_one_buffer_through_two_holds(self):
        td = self.client.alloc_dict({"a": ((4,), "int32"), "b": ((4,), "int32")})
        td.numpy()["a"][...] = 7
        self.client.publish_dict("d/two", td)
        again = self.client.get_dict("d/two", timeout=1)   # a second hold on the same buffer
        self.client.publish_dict("d/two-mixed", {"a": td["a"], "b": again["b"]})
        with self.client.get_dict("d/two-mixed", timeout=1) as got:
            self.assertEqual(np.asarray(got["a"]).tolist(), [7] * 4)
            self.assertEqual(got["a"].buffer_id, got["b"].buffer_id)
        again.release()
        td.release()
        self.client.unpublish("d/two")
        self.client.unpublish("d/two-mixed")

    def test_mixed_in_place_and_copied(self):
        t = self.client.alloc((5,), "float32")
        np.asarray(t)[...] = 1.5
        self.client.publish_dict("d/mixed", {"held": t, "plain": np.arange(3)})
        with self.client.get_dict("d/mixed", timeout=1) as td:
            self.assertEqual(td["held"].buffer_id, t.buffer_id, "in place")
            self.assertNotEqual(td["plain"].buffer_id, t.buffer_id, "copied")
            self.assertEqual(np.asarray(td["held"]).tolist(), [1.5] * 5)
            self.assertEqual(np.asarray(td["plain"]).tolist(), [0, 1, 2])
        t.release()
        self.client.unpublish("d/mixed")

    def test_spec_forms(self):
        ex = np.zeros((2, 3), dtype=np.float16)
        for spec in ({"a": ex, "b": ((4,), "uint8")},
                     [("a", ex), ("b", (4,), np.uint8)],
                     [("a", ((2, 3), "float16")), ("b", (4, "uint8"))]):
            with self.client.alloc_dict(spec) as td:
                self.assertEqual(list(td), ["a", "b"])
                self.assertEqual((td["a"].shape, td["a"].dtype), ((2, 3), "float16"))
                self.assertEqual((td["b"].shape, td["b"].dtype), ((4,), "uint8"))
                self.assertFalse(td.read_only)

    def test_alignment(self):
        with self.client.alloc_dict({"a": ((3,), "uint8"), "b": ((3,), "uint8"),
                                     "c": ((1,), "float64")}, alignment=4096) as td:
            for n in td:
                self.assertEqual(td[n].data_ptr % 4096, 0, n)

    def test_single_tensor_name_as_dict(self):
        self.client.publish("d/one", np.arange(4, dtype=np.int16))
        with self.client.get_dict("d/one", timeout=1) as td:
            self.assertEqual(list(td), [""])
            self.assertEqual(np.asarray(td[""]).tolist(), [0, 1, 2, 3])
        self.client.unpublish("d/one")


class Versions(DaemonTestCase):
    def test_publish_returns_versions(self):
        self.assertEqual(self.client.publish("v/t", np.zeros(3, dtype=np.int8)), 1)
        self.assertEqual(self.client.publish("v/t", np.ones(3, dtype=np.int8)), 2)
        with self.client.get("v/t", timeout=1) as t:
            self.assertEqual(t.version, 2)
            self.assertEqual(np.asarray(t).tolist(), [1, 1, 1])
        self.client.unpublish("v/t")
        # Unpublishing forgets the count.
        self.assertEqual(self.client.publish("v/t", np.zeros(1)), 1)
        self.client.unpublish("v/t")

    def test_get_newer_waits_for_the_next_version(self):
        self.client.publish("v/w", np.arange(3, dtype=np.int32))
        p = self.peer("publish-later", "v/w", 0.5)
        t0 = time.monotonic()
        with self.client.get("v/w", newer_than=1, timeout=20) as t:
            waited = time.monotonic() - t0
            self.assertEqual(t.version, 2)
            self.assertEqual(np.asarray(t).tolist(), list(range(10)))
        self.assertGreater(waited, 0.3)
        self.assertEqual(p.wait(30), 0)
        # Asking past the current version without waiting fails at once.
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.get("v/w", newer_than=2, timeout=0)
        self.assertIn(cm.exception.name, ("ENOENT", "ETIMEDOUT"))
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.get("v/w", newer_than=2, timeout=0.2)
        self.assertEqual(cm.exception.name, "ETIMEDOUT")
        self.client.unpublish("v/w")

    def test_get_dict_newer_waits(self):
        version, td = peer.produce_dict(self.client, "v/d", 1)
        self.assertEqual(version, 1)
        p = self.peer("dict-publish-later", "v/d", 0.5, 2)
        t0 = time.monotonic()
        with self.client.get_dict("v/d", newer_than=1, timeout=20) as got:
            self.assertGreater(time.monotonic() - t0, 0.3)
            self.assertEqual(got.version, 2)
            self.assertTrue(peer.dict_matches(got, 2))
        self.assertIn("version 2", p.communicate(timeout=30)[0])
        td.release()
        self.client.unpublish("v/d")

    def test_holder_of_an_old_version_keeps_reading_it(self):
        version, td1 = peer.produce_dict(self.client, "v/h", 1)
        old = self.client.get_dict("v/h", timeout=1)
        old_views = old.numpy(raw=True)
        self.assertEqual(old.version, 1)
        out = self.run_peer("dict-produce", "v/h", 2)   # version 2, in new memory
        self.assertIn("version 2", out)
        with self.client.get_dict("v/h", newer_than=1, timeout=5) as new:
            self.assertEqual(new.version, 2)
            self.assertTrue(peer.dict_matches(new, 2))
            self.assertNotEqual(new["embed"].buffer_id, old["embed"].buffer_id)
        self.assertTrue(peer.dict_matches(old, 1), "version 1 is unchanged")
        want = peer.dict_values(1)
        self.assertTrue(all(old_views[k].tobytes() == want[k].tobytes() for k in want))
        # newer_than=0 is "latest".
        with self.client.get_dict("v/h", timeout=1) as latest:
            self.assertEqual(latest.version, 2)
        old.release()
        td1.release()
        self.client.unpublish("v/h")

    def test_double_buffering(self):
        spec = {"w": ((256,), "float32"), "b": ((4,), "int64")}
        bufs = [self.client.alloc_dict(spec), self.client.alloc_dict(spec)]
        held = []
        for v in range(1, 7):
            td = bufs[v % 2]
            views = td.numpy()
            views["w"][...] = v
            views["b"][...] = -v
            self.assertEqual(self.client.publish_dict("v/db", td), v)
            got = self.client.get_dict("v/db", newer_than=v - 1, timeout=1)
            self.assertEqual(got.version, v)
            g = got.numpy()
            self.assertTrue((g["w"] == v).all() and (g["b"] == -v).all())
            held.append((got, g))
            if len(held) > 1:
                prev, pg = held.pop(0)
                self.assertEqual(prev.version, v - 1)
                self.assertTrue((pg["w"] == v - 1).all(), "the other buffer was not touched")
                prev.release()
        for got, _ in held:
            got.release()
        self.client.unpublish("v/db")

    def test_keep_mapped(self):
        gc.collect()
        base = counters(self.stats())
        spec = {"w": ((1 << 20,), "float32")}   # 4 MiB
        a, b = self.client.alloc_dict(spec), self.client.alloc_dict(spec)
        with gpupool.Client(self.socket, name="keeper") as consumer:
            last = 0
            for v in range(1, 5):
                td = (a, b)[v % 2]
                td.numpy()["w"][:4] = v
                self.client.publish_dict("v/km", td)
                with consumer.get_dict("v/km", newer_than=last, timeout=5,
                                       keep_mapped=True) as got:
                    self.assertEqual(got.version, v)
                    self.assertEqual(got.numpy()["w"][:4].tolist(), [v] * 4)
                    last = got.version
        a.release()
        b.release()
        self.client.unpublish("v/km")
        self.wait_stats(lambda st: counters(st) == base, "the baseline %r" % (base,))

    def test_reuse_views(self):
        # Double buffering with reuse_views: a version in a bundle already viewed gives back
        # the same view objects (reading that version's values); a new layout or new memory
        # builds new ones; the kept views hold their memory until closed.
        gc.collect()
        base = counters(self.stats())
        spec = {"w": ((256,), "float32"), "b": ((4,), "int64")}
        bufs = [self.client.alloc_dict(spec), self.client.alloc_dict(spec)]
        seen = {}
        with gpupool.Client(self.socket, name="reuser") as consumer:
            last = 0
            for v in range(1, 7):
                td = bufs[v % 2]
                views = td.numpy()
                views["w"][...] = v
                views["b"][...] = -v
                self.client.publish_dict("v/rv", td)
                with consumer.get_dict("v/rv", newer_than=last, timeout=1,
                                       reuse_views=True) as got:
                    g = got.numpy()
                    self.assertTrue((g["w"] == v).all() and (g["b"] == -v).all())
                    if v > 2:
                        self.assertIs(g["w"], seen[v % 2]["w"], "views rebuilt for version %d" % v)
                    seen.setdefault(v % 2, g)
                    last = got.version
            self.assertIsNot(seen[0]["w"], seen[1]["w"])
            # Without reuse_views: fresh views every time.
            with consumer.get_dict("v/rv", timeout=1) as got:
                self.assertIsNot(got.numpy()["w"], seen[last % 2]["w"])
            # The kept views keep their memory after the producer lets go.
            for td in bufs:
                td.release()
            self.client.unpublish("v/rv")
            self.assertTrue((seen[0]["w"] == 6).all())
            seen.clear()
            del g, views
        gc.collect()
        self.wait_stats(lambda st: counters(st) == base, "the baseline %r" % (base,))

    def test_consumer_killed_holding_a_version(self):
        base = counters(self.stats())
        version, td = peer.produce_dict(self.client, "v/k", 1)
        td.release()
        p = self.peer("dict-get-and-hold", "v/k")
        self.assertTrue(self.read_line(p, "held").startswith("1 "))
        peer.produce_dict(self.client, "v/k", 2)[1].release()   # version 2 while 1 is held
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        with self.client.get_dict("v/k", timeout=1) as got:
            self.assertEqual(got.version, 2)
            self.assertTrue(peer.dict_matches(got, 2))
        self.client.unpublish("v/k")
        self.wait_stats(lambda st: counters(st) == base, "the baseline %r" % (base,))


class Lifetimes(DaemonTestCase):
    def test_freed_exactly_once_after_the_last_holder(self):
        gc.collect()
        base = counters(self.stats())
        td = self.client.alloc_dict({"a": ((1000,), "float32"), "b": ((10,), "int8")})
        st = self.stats()
        self.assertGreater(used(st), base[3])
        self.assertEqual(st["buffers"], base[0] + td.buffers)
        self.client.publish_dict("l/a", td)
        got = self.client.get_dict("l/a", timeout=1)
        views = got.numpy()
        tensor = got["a"]
        td.release()
        got.release()
        self.client.unpublish("l/a")
        self.assertTrue(tensor.released, "releasing the dict releases its Tensors")
        # The NumPy views still hold the bundle.
        self.assertGreater(used(self.stats()), base[3])
        views["a"][...] = 3.0
        self.assertEqual(float(views["a"][999]), 3.0)
        del views
        self.assertEqual(counters(self.stats()), base, "freed when the last view goes")

    def test_republish_frees_the_old_version(self):
        gc.collect()
        base = counters(self.stats())
        spec = {"a": ((4096,), "uint8")}
        a = self.client.alloc_dict(spec)
        self.client.publish_dict("l/r", a)
        a.release()
        holder = self.client.get_dict("l/r", timeout=1)
        one = used(self.stats())
        b = self.client.alloc_dict(spec)
        self.client.publish_dict("l/r", b)    # version 2: version 1 is held by `holder`
        b.release()
        self.assertGreater(used(self.stats()), one)
        holder.release()                       # version 1's last holder
        self.assertEqual(used(self.stats()), one, "version 1 freed, version 2 kept")
        self.client.unpublish("l/r")
        self.assertEqual(counters(self.stats()), base)

    def test_close_releases_dicts(self):
        base = self.stats()
        c = gpupool.Client(self.socket, name="dict-closer")
        td = c.alloc_dict({"a": ((8,), "int32")})
        arr = td.numpy()["a"]
        c.close()
        self.assertTrue(td.released)
        arr[...] = 7   # still mapped: the view holds the bundle, and so the connection
        del arr
        gc.collect()
        self.wait_stats(lambda st: st["clients"] == base["clients"]
                        and st["buffers"] == base["buffers"], "the client and its dict gone")

    def test_torch_free_member_exports_keep_the_bundle(self):
        gc.collect()
        base = counters(self.stats())
        td = self.client.alloc_dict({"a": ((16,), "int32")})
        arr = td["a"].numpy()
        exported = np.from_dlpack(td["a"])
        td.release()
        arr[...] = 5
        self.assertEqual(exported.tolist(), [5] * 16)
        self.assertGreater(used(self.stats()), base[3])
        del arr
        self.assertGreater(used(self.stats()), base[3])
        del exported
        self.assertEqual(counters(self.stats()), base, "freed without waiting for gc")


class Pipelined(DaemonTestCase):
    """get_many / get_dicts: every request sent before any reply is waited for."""

    def test_get_many(self):
        base = self.stats()["holds"]
        for i in range(3):
            self.client.publish("pm/t%d" % i, np.full(4 + i, i, dtype=np.int16))
        ts = self.client.get_many(["pm/t2", "pm/t0", "pm/t1"], timeout=5)
        self.assertEqual([np.asarray(t).tolist() for t in ts], [[2] * 6, [0] * 4, [1] * 5])
        self.assertEqual([t.version for t in ts], [1, 1, 1])
        self.assertEqual([t.name for t in ts], ["pm/t2", "pm/t0", "pm/t1"])
        self.assertEqual(self.stats()["holds"], base + 3, "each get holds its buffer")
        for t in ts:
            t.release()
        # One version for all, or one per name.
        self.client.publish("pm/t0", np.zeros(1, dtype=np.int16))
        a, b = self.client.get_many(["pm/t0", "pm/t1"], newer_than=[1, 0], timeout=5)
        self.assertEqual((a.version, b.version), (2, 1))
        a.release()
        b.release()
        with self.assertRaises(ValueError):
            self.client.get_many(["pm/t0"], newer_than=[0, 0])
        for i in range(3):
            self.client.unpublish("pm/t%d" % i)
        self.wait_stats(lambda st: st["holds"] == base, "no holds left")

    def test_get_many_waits_for_each(self):
        self.client.publish("pm/now", np.ones(2, dtype=np.int32))
        p = self.peer("publish-later", "pm/later", 0.3)
        now, later = self.client.get_many(["pm/now", "pm/later"], timeout=20)
        self.assertEqual(np.asarray(now).tolist(), [1, 1])
        self.assertEqual(np.asarray(later).tolist(), list(range(10)))
        self.assertEqual(p.wait(30), 0)
        now.release()
        later.release()
        self.client.unpublish("pm/now")
        self.client.unpublish("pm/later")

    def test_failure_gives_the_others_back(self):
        base = self.stats()
        self.client.publish("pm/x", np.zeros(8, dtype=np.uint8))
        self.client.publish("pm/y", np.zeros(8, dtype=np.uint8))
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.get_many(["pm/x", "pm/absent", "pm/y"], timeout=0)
        self.assertEqual(cm.exception.name, "ENOENT")
        self.assertIn("pm/absent", str(cm.exception))
        # pm/x was got and released again, pm/y's reply was cancelled: no hold is left.
        self.wait_stats(lambda st: st["holds"] == base["holds"], "no hold left by the failed get_many")
        with self.assertRaises(gpupool.GpupoolError):
            self.client.get_dicts(["pm/x", "pm/absent"], timeout=0)
        self.wait_stats(lambda st: st["holds"] == base["holds"], "no hold left by the failed get_dicts")
        self.client.unpublish("pm/x")
        self.client.unpublish("pm/y")
        self.wait_stats(lambda st: counters(st) == counters(base), "counters back where they were")

    def test_get_dicts(self):
        v1, a = peer.produce_dict(self.client, "pm/da", 11)
        v2, b = peer.produce_dict(self.client, "pm/db", 12)
        self.assertEqual((v1, v2), (1, 1))
        da, db = self.client.get_dicts(["pm/da", "pm/db"], timeout=5)
        self.assertTrue(peer.dict_matches(da, 11))
        self.assertTrue(peer.dict_matches(db, 12))
        self.assertEqual((da.name, db.name, da.version, db.version), ("pm/da", "pm/db", 1, 1))
        for d in (a, b, da, db):
            d.release()
        self.client.unpublish("pm/da")
        self.client.unpublish("pm/db")

    def test_host_fences_off_on_the_host_backend(self):
        self.assertFalse(self.client.host_fences)


class BadInput(DaemonTestCase):
    def test_duplicate_member_names(self):
        base = counters(self.stats())
        spec = [("dup_member", (4,), "int32"), ("dup_member", (2,), "int32")]
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.alloc_dict(spec)
        e = cm.exception
        self.assertIn(e.name, ("EINVAL", "ENAME"))
        self.assertIn("dup_member", e.message, "the message names the duplicate")
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.publish_dict("bad/dup", [("dup_member", np.zeros(2)),
                                                 ("dup_member", np.ones(2))])
        self.assertIn(cm.exception.name, ("EINVAL", "ENAME"))
        self.assertEqual(counters(self.stats()), base, "nothing allocated or published")

    def test_empty(self):
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.publish_dict("bad/empty", {})
        self.assertEqual(cm.exception.name, "EINVAL")
        self.assertIn("at least one member", str(cm.exception))
        with self.assertRaises(gpupool.GpupoolError):
            self.client.alloc_dict({})

    def test_bad_member_names(self):
        for bad in ("", "x" * 300):
            with self.subTest(name=bad[:10]):
                with self.assertRaises(gpupool.GpupoolError) as cm:
                    self.client.alloc_dict({bad: ((1,), "int8")})
                self.assertIn(cm.exception.name, ("ENAME", "EINVAL"))
                self.assertTrue(cm.exception.message)
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.alloc_dict({"a\0b": ((1,), "int8")})
        self.assertEqual(cm.exception.name, "ENAME")

    def test_unsupported_dtype(self):
        with self.assertRaises(ValueError):
            self.client.alloc_dict({"x": ((2,), "float128")})
        with self.assertRaises((ValueError, TypeError, BufferError)):
            self.client.publish_dict("bad/str", {"s": np.array(["text"])})
        with self.assertRaises(ValueError):
            self.client.alloc_dict({"x": "not a spec"})
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.publish_dict("bad/ndim", {"x": np.zeros((1,) * 17)})
        self.assertEqual(cm.exception.name, "EMETA")

    def test_get_errors(self):
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.get_dict("bad/missing", timeout=0)
        self.assertEqual(cm.exception.name, "ENOENT")
        self.assertIn("bad/missing", str(cm.exception))
        with self.assertRaises(ValueError):
            self.client.get_dict("bad/missing", newer_than=-1)
        # A name holding several members is not a single tensor.
        self.client.publish_dict("bad/multi", {"a": np.zeros(2), "b": np.zeros(3)})
        with self.assertRaises(gpupool.GpupoolError) as cm:
            self.client.get("bad/multi", timeout=0)
        self.assertEqual(cm.exception.name, "EINVAL")
        self.client.unpublish("bad/multi")

    def test_released_dict(self):
        td = self.client.alloc_dict({"a": ((2,), "int8")})
        td.release()
        with self.assertRaises(gpupool.GpupoolError):
            td.numpy()
        with self.assertRaises(gpupool.GpupoolError):
            self.client.publish_dict("bad/released", td)


if __name__ == "__main__":
    unittest.main()
