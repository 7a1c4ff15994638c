"""Exceptions: every failure is a GpupoolError of its code's subclass, which also derives from
the builtin a Python user catches (TimeoutError, LookupError, MemoryError, ...); shown through
real daemon calls where the daemon can produce the code, and for every code by the factory."""

import pickle
import unittest

import gpupool
from gpupool import _errors
from support import DaemonTestCase

# What each builtin catches, as documented in gpupool/_errors.py and the README, written out
# again on purpose: a change of the mapping must be a deliberate change here too. Every
# code not listed under a builtin must not be an instance of it.
CAUGHT_BY = {
    TimeoutError: {"ETIMEDOUT"},
    LookupError: {"ENOENT"},
    FileNotFoundError: {"ENOENT"},
    FileExistsError: {"EEXIST"},
    PermissionError: {"EPERM", "ERDONLY"},
    MemoryError: {"ENOMEM", "ENOSPC"},
    ValueError: {"EINVAL", "ENAME", "EMETA"},
    ConnectionError: {"ECONNECT", "EIO", "EPEER"},
    OSError: {"ETIMEDOUT", "ENOENT", "EEXIST", "EPERM", "ERDONLY", "ECONNECT", "EIO", "EPEER"},
}


def _library_or_skip(test):
    try:
        gpupool._lib.lib()
    except gpupool.LibraryNotFoundError as e:
        test.skipTest(str(e))


class Factory(unittest.TestCase):
    def setUp(self):
        _library_or_skip(self)

    def test_every_code(self):
        codes = _errors.codes()
        self.assertIn("ENOENT", codes)
        for name, code in codes.items():
            e = _errors.error(code, "why and what to do")
            self.assertIsInstance(e, gpupool.GpupoolError)
            self.assertIs(type(e), getattr(gpupool.GpupoolError, name))
            self.assertEqual((e.code, e.name, e.message), (code, name, "why and what to do"))
            self.assertEqual(str(e), "%s: why and what to do" % name)
            for builtin, names in CAUGHT_BY.items():
                self.assertEqual(isinstance(e, builtin), name in names,
                                 "%s as %s" % (name, builtin.__name__))
            # By name as by number; and it survives pickling (multiprocessing).
            self.assertIs(type(_errors.error(name, "m")), type(e))
            back = pickle.loads(pickle.dumps(e))
            self.assertIs(type(back), type(e))
            self.assertEqual((back.code, back.name, back.message), (e.code, e.name, e.message))

    def test_mapped_codes_exist(self):
        # A code renamed or removed in gpupool.h must not leave a dead row behind.
        for names in CAUGHT_BY.values():
            for name in names:
                self.assertIn(name, _errors.codes())

    def test_unknown_attribute(self):
        with self.assertRaises(AttributeError):
            gpupool.GpupoolError.ENOSUCHCODE  # noqa: B018
        with self.assertRaises(AttributeError):
            gpupool.GpupoolError.lowercase  # noqa: B018


class Names(unittest.TestCase):
    def test_old_module_path(self):
        # The objects moved out of gpupool.client; code importing them from there still works.
        from gpupool.client import Client, GpupoolError, Tensor, TensorDict, stream_handle

        self.assertIs(Client, gpupool.Client)
        self.assertIs(Tensor, gpupool.Tensor)
        self.assertIs(TensorDict, gpupool.TensorDict)
        self.assertIs(GpupoolError, gpupool.GpupoolError)
        self.assertEqual(stream_handle(7), 7)


class ThroughTheDaemon(DaemonTestCase):
    def test_missing_name_is_lookup_error(self):
        with self.assertRaises(LookupError) as cm:
            self.client.get("errors/missing", timeout=0)
        e = cm.exception
        self.assertIsInstance(e, FileNotFoundError)
        self.assertIsInstance(e, gpupool.GpupoolError.ENOENT)
        self.assertEqual(e.name, "ENOENT")
        self.assertIn("errors/missing", str(e))

    def test_timeout_is_timeout_error(self):
        with self.assertRaises(TimeoutError) as cm:
            self.client.get("errors/late", timeout=0.1)
        self.assertIsInstance(cm.exception, gpupool.GpupoolError.ETIMEDOUT)
        self.assertEqual(cm.exception.name, "ETIMEDOUT")

    def test_full_pool_is_memory_error(self):
        t = self.client.alloc((200 << 20,), "uint8")
        self.addCleanup(t.release)
        with self.assertRaises(MemoryError) as cm:
            self.client.alloc((200 << 20,), "uint8", timeout=0)
        self.assertEqual(cm.exception.name, "ENOSPC")

    def test_bad_name_is_value_error(self):
        with self.assertRaises(ValueError) as cm:
            self.client.get("a\0b", timeout=0)
        self.assertIsInstance(cm.exception, gpupool.GpupoolError.ENAME)
        with self.assertRaises(ValueError) as cm:
            self.client.get("", timeout=0)
        self.assertIsInstance(cm.exception, gpupool.GpupoolError)

    def test_closed_client_is_only_gpupool_error(self):
        c = gpupool.Client(self.socket)
        c.close()
        with self.assertRaises(gpupool.GpupoolError) as cm:
            c.alloc((4,), "float32")
        self.assertIsInstance(cm.exception, gpupool.GpupoolError.ECLOSED)
        self.assertNotIsInstance(cm.exception, (OSError, ValueError))

    def test_no_daemon_is_connection_error(self):
        with self.assertRaises(ConnectionError) as cm:
            gpupool.Client(self.socket + ".absent")
        self.assertEqual(cm.exception.name, "ECONNECT")


if __name__ == "__main__":
    unittest.main()
