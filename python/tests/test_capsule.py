"""The DLPack capsule protocol of gpupool's exports, without a daemon: who calls the
deleter, and what the structs say."""

import ctypes
import gc
import unittest

import support  # noqa: F401  (puts the source tree first on sys.path)
from gpupool import _dlpack, _dtypes


class Owner:
    freed = 0

    def __del__(self):
        Owner.freed += 1


class Capsules(unittest.TestCase):
    def setUp(self):
        self.buf = (ctypes.c_int32 * 12)(*range(12))
        self.addr = ctypes.addressof(self.buf)
        Owner.freed = 0
        self.live0 = _dlpack.live_exports()

    def capsule(self, versioned, read_only=False):
        return _dlpack.make_capsule(self.addr, (_dlpack.kDLCPU, 0), _dtypes.dtype("int32"),
                                    (3, 4), (4, 1), Owner(), versioned, read_only=read_only)

    def test_unconsumed_capsule_calls_deleter(self):
        for versioned in (True, False):
            c = self.capsule(versioned)
            self.assertEqual(_dlpack.live_exports(), self.live0 + 1)
            del c
            gc.collect()
            self.assertEqual(_dlpack.live_exports(), self.live0)
        self.assertEqual(Owner.freed, 2)

    def test_consumed_capsule_belongs_to_consumer(self):
        for versioned, name, used in ((True, b"dltensor_versioned", b"used_dltensor_versioned"),
                                      (False, b"dltensor", b"used_dltensor")):
            c = self.capsule(versioned)
            p = _dlpack._capsule_get_pointer(id(c), name)
            # What a consumer does: rename, then call the deleter when done.
            self.assertEqual(_dlpack._capsule_set_name(id(c), used), 0)
            del c
            gc.collect()
            self.assertEqual(_dlpack.live_exports(), self.live0 + 1,
                             "a consumed capsule's destructor must not call the deleter")
            cls = _dlpack.DLManagedTensorVersioned if versioned else _dlpack.DLManagedTensor
            m = cls.from_address(p)
            ctypes.CFUNCTYPE(None, ctypes.c_void_p)(m.deleter)(p)
            self.assertEqual(_dlpack.live_exports(), self.live0)
        self.assertEqual(Owner.freed, 2)

    def test_struct_contents(self):
        c = self.capsule(True, read_only=True)
        d = _dlpack.describe_capsule(c)
        self.assertEqual(d.data, self.addr)
        self.assertEqual(d.device, (_dlpack.kDLCPU, 0))
        self.assertEqual(d.dtype.name, "int32")
        self.assertEqual(d.shape, (3, 4))
        self.assertEqual(d.strides, (4, 1))
        self.assertTrue(d.read_only)
        p = _dlpack._capsule_get_pointer(id(c), b"dltensor_versioned")
        m = _dlpack.DLManagedTensorVersioned.from_address(p)
        self.assertEqual((m.version.major, m.version.minor), _dlpack.VERSION)
        self.assertEqual(m.flags, _dlpack.FLAG_READ_ONLY)
        self.assertEqual(ctypes.sizeof(_dlpack.DLTensor), 48)
        self.assertEqual(ctypes.sizeof(_dlpack.DLManagedTensorVersioned), 80)
        self.assertEqual(ctypes.sizeof(_dlpack.DLManagedTensor), 64)

    def test_numpy_consumes(self):
        try:
            import numpy as np
        except ImportError:
            self.skipTest("numpy not installed")

        class Exporter:
            def __init__(s, cap):
                s.cap = cap

            def __dlpack__(s, stream=None, **kw):
                return s.cap

            def __dlpack_device__(s):
                return (_dlpack.kDLCPU, 0)

        a = np.from_dlpack(Exporter(self.capsule(False)))
        self.assertEqual(a.tolist(), [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
        self.assertEqual(a.__array_interface__["data"][0], self.addr)
        self.assertEqual(_dlpack.live_exports(), self.live0 + 1)
        del a
        gc.collect()
        self.assertEqual(_dlpack.live_exports(), self.live0)
        self.assertEqual(Owner.freed, 1)

    def test_describe_numpy_views(self):
        try:
            import numpy as np
        except ImportError:
            self.skipTest("numpy not installed")
        a = np.arange(24, dtype=np.int16).reshape(4, 6)
        d = _dlpack.describe(a[1:, ::-2])
        self.assertEqual(d.shape, (3, 3))
        self.assertEqual(d.strides, (6, -2))
        self.assertFalse(d.is_contiguous())
        lo, span = d.span()
        self.assertEqual(lo, -4 * 2)
        self.assertEqual(d.data, a[1:, ::-2].__array_interface__["data"][0])
        self.assertEqual(_dlpack.describe(np.zeros((2, 3), dtype=bool)).dtype.name, "bool")


class Dtypes(unittest.TestCase):
    def test_names(self):
        for d in _dtypes.ALL:
            self.assertIs(_dtypes.dtype(d.name), d)
            self.assertIs(_dtypes.from_dlpack_code(d.code, d.bits, d.lanes), d)
        self.assertEqual(_dtypes.dtype("torch.bfloat16").code, 4)
        self.assertEqual(_dtypes.dtype("bool").bits, 8)
        self.assertEqual(_dtypes.dtype("complex128").itemsize, 16)
        with self.assertRaises(ValueError):
            _dtypes.dtype("float128")

    def test_numpy_dtypes(self):
        try:
            import numpy as np
        except ImportError:
            self.skipTest("numpy not installed")
        self.assertEqual(_dtypes.dtype(np.float32).name, "float32")
        self.assertEqual(_dtypes.dtype(np.dtype("uint16")).name, "uint16")
        self.assertEqual(_dtypes.dtype(np.bool_).name, "bool")


if __name__ == "__main__":
    unittest.main()
