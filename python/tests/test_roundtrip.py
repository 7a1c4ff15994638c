"""Tensors published by one process and read by another: every dtype, strided and offset
views, and the DLPack forms a consumer may ask for."""

import ctypes
import unittest

import numpy as np

from support import DaemonTestCase
import peer
from gpupool import _dlpack


NUMPY_VERSION = tuple(int(x) for x in np.__version__.split(".")[:2])


def as_numpy(t):
    """A NumPy view of a host tensor through DLPack where this NumPy can, else through the
    array interface: NumPy < 1.25 cannot import bool over DLPack (and leaks the capsule
    trying)."""
    if t.dtype == "bool" and NUMPY_VERSION < (1, 25):
        return np.asarray(t)
    return np.from_dlpack(t)


class DtypeRoundTrip(DaemonTestCase):
    def test_every_dtype(self):
        out = self.run_peer("dtypes", "dt")
        self.assertIn("published", out)
        for name in peer.NUMPY_DTYPES:
            with self.subTest(dtype=name):
                want = peer.sample_array(name)
                with self.client.get("dt/" + name, timeout=5) as t:
                    self.assertEqual(t.dtype, name)
                    self.assertEqual(t.shape, want.shape)
                    self.assertTrue(t.is_contiguous())
                    got = np.asarray(t)
                    self.assertEqual(got.dtype, want.dtype)
                    # Bit-exact, NaN and -0.0 included.
                    self.assertEqual(got.tobytes(), want.tobytes())
                    self.assertEqual(as_numpy(t).tobytes(), want.tobytes())
                    self.assertEqual(t.numpy().tobytes(), want.tobytes())

    def test_scalar_and_empty(self):
        self.run_peer("dtypes", "se")
        with self.client.get("se/scalar", timeout=5) as t:
            self.assertEqual(t.shape, ())
            self.assertEqual(float(np.asarray(t)), 3.5)
        with self.client.get("se/empty", timeout=5) as t:
            self.assertEqual(t.shape, (0, 4))
            self.assertEqual(np.asarray(t).size, 0)

    def test_bfloat16_via_dlpack_codes(self):
        self.run_peer("dtypes", "bf")
        with self.client.get("bf/bfloat16", timeout=5) as t:
            self.assertEqual(t.dtype, "bfloat16")
            self.assertEqual(t.dlpack_dtype, (4, 16, 1))
            self.assertEqual(t.shape, (3, 4))
            bits = t.numpy(raw=True)
            self.assertEqual(bits.dtype, np.uint16)
            self.assertEqual(bits.ravel().tolist(), peer.bf16_bits(12).tolist())
            # What a DLPack consumer sees: kDLBfloat, 16 bits, the same memory.
            for versioned in (True, False):
                cap = t.__dlpack__(max_version=(1, 0) if versioned else None)
                d = _dlpack.describe_capsule(cap)
                self.assertEqual((d.dtype.code, d.dtype.bits, d.dtype.lanes), (4, 16, 1))
                self.assertEqual(d.shape, (3, 4))
                self.assertEqual(d.data, t.data_ptr)
                del cap
            with self.assertRaises(TypeError):
                np.asarray(t)  # NumPy has no bfloat16: said plainly, not garbage


class Layouts(DaemonTestCase):
    """Non-contiguous tensors that are not in gpupool memory are copied and arrive
    C-contiguous (compacted); views of gpupool memory are published in place with their
    strides and offset."""

    def test_strided_views(self):
        out = self.run_peer("strided", "st")
        producer_buffer = int(out.split("buffer", 1)[1].split()[0])
        base = np.arange(6 * 8, dtype=np.int32).reshape(6, 8)
        cases = {
            "slice": base[::2, 1::3],
            "reversed": base[::-1, ::-1],
            "fortran": np.asfortranarray(base.astype(np.float64)),
        }
        for name, want in cases.items():
            with self.subTest(view=name):
                with self.client.get("st/" + name, timeout=5) as t:
                    self.assertEqual(t.shape, want.shape)
                    self.assertTrue(t.is_contiguous(), "copies are compacted")
                    self.assertEqual(t.byte_offset, 0)
                    self.assertTrue(np.array_equal(np.asarray(t), want))
                    self.assertEqual(t.nbytes, want.nbytes)
        with self.client.get("st/inplace", timeout=5) as t:
            want = (base * 10)[1:5, ::2]
            self.assertEqual(t.buffer_id, producer_buffer, "published in place, no copy")
            self.assertEqual(t.shape, (4, 4))
            self.assertEqual(t.strides, (8, 2))
            self.assertEqual(t.byte_offset, 1 * 8 * 4)
            self.assertFalse(t.is_contiguous())
            got = as_numpy(t)
            self.assertEqual(got.strides, (32, 8))
            self.assertEqual(got.__array_interface__["data"][0], t.buffer_ptr + 32)
            self.assertTrue(np.array_equal(got, want))

    def test_offset_view_of_alloc_in_same_process(self):
        t = self.client.alloc((16,), "float64")
        v = t.numpy()
        v[...] = np.arange(16)
        self.client.publish("off/tail", v[4:])
        with self.client.get("off/tail", timeout=1) as g:
            self.assertEqual(g.buffer_id, t.buffer_id)
            self.assertEqual(g.byte_offset, 32)
            self.assertEqual(g.data_ptr, g.buffer_ptr + 32)
            self.assertEqual(np.asarray(g).tolist(), list(range(4, 16)))
        self.client.unpublish("off/tail")

    def test_dlpack_forms(self):
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        self.client.publish("forms/a", a)
        with self.client.get("forms/a", timeout=1) as t:
            self.assertEqual(t.__dlpack_device__(), (_dlpack.kDLCPU, 0))
            v = t.__dlpack__(max_version=(1, 0))
            self.assertTrue(_dlpack._capsule_is_valid(id(v), b"dltensor_versioned"))
            m = _dlpack.DLManagedTensorVersioned.from_address(
                _dlpack._capsule_get_pointer(id(v), b"dltensor_versioned"))
            self.assertEqual((m.version.major, m.version.minor), (1, 0))
            self.assertEqual(m.flags, 0)
            self.assertEqual(m.dl_tensor.byte_offset, 0)
            self.assertEqual([m.dl_tensor.strides[i] for i in range(2)], [4, 1])
            del m, v
            v = t.__dlpack__(max_version=(1, 7))
            m = _dlpack.DLManagedTensorVersioned.from_address(
                _dlpack._capsule_get_pointer(id(v), b"dltensor_versioned"))
            self.assertEqual((m.version.major, m.version.minor), _dlpack.VERSION)
            del m, v
            legacy = t.__dlpack__()
            self.assertTrue(_dlpack._capsule_is_valid(id(legacy), b"dltensor"))
            del legacy
            # copy=True: a private copy of host memory, flagged as such.
            c = t.__dlpack__(max_version=(1, 0), copy=True)
            p = _dlpack._capsule_get_pointer(id(c), b"dltensor_versioned")
            m = _dlpack.DLManagedTensorVersioned.from_address(p)
            self.assertEqual(m.flags, _dlpack.FLAG_IS_COPIED)
            self.assertNotEqual(m.dl_tensor.data, t.data_ptr)
            self.assertEqual(_dlpack.describe_capsule(c).data, m.dl_tensor.data)
            self.assertEqual(ctypes.string_at(m.dl_tensor.data, 48),
                             ctypes.string_at(t.data_ptr, 48))
            del m, c
            with self.assertRaises(BufferError):
                t.__dlpack__(dl_device=(_dlpack.kDLCUDA, 0))
            self.assertEqual(np.from_dlpack(t).tolist(), a.tolist())
        self.client.unpublish("forms/a")

    def test_read_only_hold(self):
        a = np.arange(8, dtype=np.int64)
        self.client.publish("ro/a", a)
        with self.client.get("ro/a", timeout=1, read_only=True) as t:
            self.assertTrue(t.read_only)
            v = np.asarray(t)
            self.assertFalse(v.flags.writeable)
            self.assertEqual(v.tolist(), a.tolist())
            cap = t.__dlpack__(max_version=(1, 0))
            d = _dlpack.describe_capsule(cap)
            self.assertTrue(d.read_only)
            del cap
            with self.assertRaises(BufferError) as cm:
                t.__dlpack__()
            self.assertIn("read-only", str(cm.exception))
        self.client.unpublish("ro/a")

    def test_publish_gpupool_tensor_in_place_same_buffer(self):
        t = self.client.alloc((2, 3), "int16")
        np.asarray(t)[...] = [[1, 2, 3], [4, 5, 6]]
        self.client.publish("inplace/t", t)
        with self.client.get("inplace/t", timeout=1) as g:
            self.assertEqual(g.buffer_id, t.buffer_id)
            self.assertEqual(np.asarray(g).tolist(), [[1, 2, 3], [4, 5, 6]])
        # A copy of foreign memory lands in a new buffer.
        self.client.publish("inplace/copy", np.ones(3, dtype=np.int16))
        with self.client.get("inplace/copy", timeout=1) as g:
            self.assertNotEqual(g.buffer_id, t.buffer_id)
        self.client.unpublish("inplace/t")
        self.client.unpublish("inplace/copy")


if __name__ == "__main__":
    unittest.main()
