"""The C export functions (gpupool/dlpack.h), called through ctypes on real buffers: what
they describe, and that their deleter gives the hold back exactly once."""

import ctypes
import unittest

import numpy as np

from support import DaemonTestCase
from gpupool import _dlpack, _lib


class CExport(DaemonTestCase):
    def setUp(self):
        super().setUp()
        self.L = _lib.lib()
        if not hasattr(self.L, "gpupool_buffer_to_dlpack_versioned"):
            self.skipTest("libgpupool-client was built without client/dlpack.c")

    def c_get(self, name, read_only=False):
        b = _lib.BufferP()
        _lib.check(self.L.gpupool_get(self.client._conn.handle, name.encode(), 1000,
                                      _lib.READ_ONLY if read_only else 0, None,
                                      ctypes.byref(b)))
        return b

    def c_alloc(self, size):
        b = _lib.BufferP()
        _lib.check(self.L.gpupool_alloc(self.client._conn.handle, None, size, 0, None,
                                        ctypes.byref(b)))
        return b

    def export(self, b, versioned=True):
        out = ctypes.c_void_p()
        fn = (self.L.gpupool_buffer_to_dlpack_versioned if versioned
              else self.L.gpupool_buffer_to_dlpack)
        rc = fn(b, ctypes.byref(out))
        if rc < 0:
            raise _lib.error(rc)
        cls = _dlpack.DLManagedTensorVersioned if versioned else _dlpack.DLManagedTensor
        return cls.from_address(out.value), out.value

    @staticmethod
    def delete(m, addr):
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(m.deleter)(addr)

    def test_raw_buffer_is_1d_uint8(self):
        base = self.stats()["holds"]
        b = self.c_alloc(1000)
        ptr = self.L.gpupool_buffer_ptr(b)
        size = self.L.gpupool_buffer_size(b)
        m, addr = self.export(b)
        t = m.dl_tensor
        self.assertEqual((m.version.major >= 1, m.flags), (True, 0))
        self.assertEqual((t.device.device_type, t.device.device_id), (_dlpack.kDLCPU, 0))
        self.assertEqual((t.dtype.code, t.dtype.bits, t.dtype.lanes), (1, 8, 1))
        self.assertEqual(t.ndim, 1)
        self.assertEqual(t.shape[0], size)
        self.assertEqual(t.strides[0], 1)
        self.assertEqual(t.data, ptr)
        self.assertEqual(t.byte_offset, 0)
        self.assertEqual(self.stats()["holds"], base + 1)
        self.delete(m, addr)
        # The deleter released the hold the export took over.
        self.assertEqual(self.stats()["holds"], base)

    def test_published_description(self):
        a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
        t = self.client.alloc((2, 3, 4), "float32")
        np.asarray(t)[...] = a
        self.client.publish("c/strided", np.asarray(t)[:, 1:, ::2])
        b = self.c_get("c/strided")
        ptr = self.L.gpupool_buffer_ptr(b)
        for versioned in (True, False):
            if not versioned:
                b = self.c_get("c/strided")
            m, addr = self.export(b, versioned)
            d = m.dl_tensor
            self.assertEqual(d.ndim, 3)
            self.assertEqual([d.shape[i] for i in range(3)], [2, 2, 2])
            self.assertEqual([d.strides[i] for i in range(3)], [12, 4, 2])
            self.assertEqual((d.dtype.code, d.dtype.bits, d.dtype.lanes), (2, 32, 1))
            self.assertEqual(d.data, ptr + 4 * 4)  # element 0 is a[0, 1, 0]
            self.assertEqual(d.byte_offset, 0)
            got = ctypes.c_float.from_address(d.data + 4 * (1 * 12 + 1 * 4 + 1 * 2)).value
            self.assertEqual(got, a[1, 2, 2])
            self.delete(m, addr)
        self.client.unpublish("c/strided")

    def test_read_only_flag_and_legacy_refusal(self):
        self.client.publish("c/ro", np.zeros(4, dtype=np.int8))
        base = self.stats()["holds"]
        b = self.c_get("c/ro", read_only=True)
        with self.assertRaises(_lib.GpupoolError) as cm:
            self.export(b, versioned=False)
        self.assertEqual(cm.exception.name, "ERDONLY")
        self.assertIn("read-only", cm.exception.message)
        # Refused: the caller still owns the hold.
        self.assertEqual(self.stats()["holds"], base + 1)
        m, addr = self.export(b, versioned=True)
        self.assertEqual(m.flags & _dlpack.FLAG_READ_ONLY, _dlpack.FLAG_READ_ONLY)
        self.assertEqual(m.dl_tensor.shape[0], 4)
        self.assertEqual((m.dl_tensor.dtype.code, m.dl_tensor.dtype.bits), (0, 8))
        self.delete(m, addr)
        self.assertEqual(self.stats()["holds"], base)
        self.client.unpublish("c/ro")

    def test_null_arguments(self):
        out = ctypes.c_void_p()
        rc = self.L.gpupool_buffer_to_dlpack_versioned(None, ctypes.byref(out))
        self.assertEqual(rc, _lib.CODES["EINVAL"])
        self.assertIn("non-NULL", self.L.gpupool_last_error().decode())
        rc = self.L.gpupool_buffer_to_dlpack(None, ctypes.byref(out))
        self.assertEqual(rc, _lib.CODES["EINVAL"])


if __name__ == "__main__":
    unittest.main()
