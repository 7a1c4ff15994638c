"""The Python package agrees with include/gpupool/gpupool.h: error codes and names, flags,
timeouts, memory kinds and limits, and the ctypes prototype of every function _lib binds
(it must be declared, with as many arguments, of matching types). The header is parsed here,
so a value or a signature changed on one side only fails this test."""

import ctypes
import os
import re
import unittest

import gpupool
from gpupool import _errors, _lib
from support import REPO

HEADER = os.path.join(REPO, "include", "gpupool", "gpupool.h")

# Python name in _lib -> macro or enumerator in gpupool.h (without the GPUPOOL_ prefix).
CONSTANTS = {
    "NAME_MAX": "NAME_MAX",
    "MAX_NDIM": "MAX_NDIM",
    "TOKEN_SIZE": "TOKEN_SIZE",
    "READ_ONLY": "READ_ONLY",
    "TIMEOUT_FOREVER": "TIMEOUT_FOREVER",
    "TIMEOUT_DEFAULT": "TIMEOUT_DEFAULT",
    "CONNECT_TIMEOUT_DEFAULT_MS": "CONNECT_TIMEOUT_DEFAULT_MS",
    "FILE_HOST_ONLY": "FILE_HOST_ONLY",
    "KEEP_MAPPED": "KEEP_MAPPED",
    "TARGET_DEVICE": "TARGET_DEVICE",
    "BUNDLE_MAX_MEMBERS": "BUNDLE_MAX_MEMBERS",
    "MEM_HOST": "MEM_HOST",
    "MEM_DEVICE": "MEM_DEVICE",
    "MEM_HOST_NUMA": "MEM_HOST_NUMA",
}


def parse_header(text):
    """({name: value} of the integer macros and enumerators, {error name: code})."""
    values = {}
    for m in re.finditer(r"^#define GPUPOOL_(\w+)\s+\(?(0x[0-9a-fA-F]+|-?[0-9]+)[uU]?\)?\s*$",
                         text, re.M):
        values[m.group(1)] = int(m.group(2), 0)
    for m in re.finditer(r"\bGPUPOOL_(\w+)\s*=\s*(0x[0-9a-fA-F]+|-?[0-9]+)", text):
        values.setdefault(m.group(1), int(m.group(2), 0))
    emap = re.search(r"#define GPUPOOL_ERRNO_MAP\(X\)(.*?)\n\s*\n", text, re.S)
    if emap is None:
        raise AssertionError("GPUPOOL_ERRNO_MAP not found in %s" % HEADER)
    errors = {m.group(1): int(m.group(2))
              for m in re.finditer(r"X\((\w+),\s*(-?[0-9]+),", emap.group(1))}
    return values, errors


def parse_functions(text):
    """{name: (return type, [parameter types])} of every GPUPOOL_EXTERN declaration, types as
    written (parameter names dropped); a parameter the simple C grammar below does not cover
    (an array pointer) is kept whole."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    funcs = {}
    for m in re.finditer(r"GPUPOOL_EXTERN\s+([^;(]*?)\b(gpupool_\w+)\s*\((.*?)\)\s*;", text, re.S):
        ret = " ".join((m.group(1) + " ").replace("*", " * ").split())
        params = []
        args = " ".join(m.group(3).split())
        if args not in ("", "void"):
            for a in args.split(","):
                a = a.strip()
                pm = re.fullmatch(r"(.*?[\s*])(\w+)", a)
                params.append(" ".join(pm.group(1).replace("*", " * ").split()) if pm else a)
        funcs[m.group(2)] = (ret, params)
    return funcs


# C types of the header -> their ctypes mirrors in _lib (pointers are built on these).
def _base_types():
    return {
        "int": ctypes.c_int, "unsigned": ctypes.c_uint, "size_t": ctypes.c_size_t,
        "uint64_t": ctypes.c_uint64, "gpupool_mem_kind": ctypes.c_int,
        "gpupool_client": _lib.ClientHandle, "gpupool_buffer": _lib.Buffer,
        "gpupool_bundle": _lib.BundleHandle, "gpupool_pending": _lib.PendingHandle,
        "gpupool_file": _lib.File, "gpupool_file_info": _lib.FileInfo,
        "gpupool_tensor_meta": _lib.TensorMeta, "gpupool_token": _lib.Token,
        "gpupool_daemon_stats": _lib.DaemonStats, "gpupool_pool_stats": _lib.PoolStats,
        "gpupool_member": _lib.Member, "gpupool_member_spec": _lib.MemberSpec,
        "gpupool_member_ref": _lib.MemberRef,
    }


# Tables _lib passes as raw addresses (packed with the struct module): void * stands for them.
RAW_TABLES = {"gpupool_member", "gpupool_member_spec", "gpupool_member_ref"}


def expected_ctypes(ctype):
    """The ctypes types a binding may declare for a C type: a set (void * where the C side
    takes a table _lib packs itself), or raises for a type this test does not know."""
    if re.fullmatch(r"char \(\*\w+\)\[GPUPOOL_NAME_MAX \+ 1\]", " ".join(ctype.split())):
        return {ctypes.c_void_p}  # a table of names the binding allocates (a string buffer)
    words = [w for w in ctype.split() if w != "const"]
    depth = words.count("*")
    base = " ".join(w for w in words if w != "*")
    if depth == 0 and base == "void":
        return {None}
    if depth == 1 and base == "void":
        return {ctypes.c_void_p}
    if depth == 2 and base == "void":
        return {ctypes.POINTER(ctypes.c_void_p)}  # a table of addresses
    if depth == 1 and base == "char":
        return {ctypes.c_char_p}
    bases = _base_types()
    if base not in bases:
        raise AssertionError("no ctypes mirror known for C type %r" % ctype)
    t = bases[base]
    for _ in range(depth):
        t = ctypes.POINTER(t)
    return {t, ctypes.c_void_p} if depth == 1 and base in RAW_TABLES else {t}


class Header(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(HEADER) as f:
            text = f.read()
        cls.values, cls.errors = parse_header(text)
        cls.functions = parse_functions(text)

    def test_parsed_something(self):
        # A parser that finds nothing would pass every comparison below.
        self.assertGreaterEqual(len(self.errors), 20)
        self.assertIn("NAME_MAX", self.values)

    def test_constants(self):
        for py, c in CONSTANTS.items():
            self.assertIn(c, self.values, "GPUPOOL_%s is not in gpupool.h" % c)
            self.assertEqual(getattr(_lib, py), self.values[c], "%s vs GPUPOOL_%s" % (py, c))

    def test_parsed_functions(self):
        # As above: a parser that finds no declaration would check nothing.
        self.assertGreaterEqual(len(self.functions), 50)
        self.assertEqual(self.functions["gpupool_buffer_release"],
                         ("int", ["gpupool_buffer *", "void *"]))

    def test_bindings_are_declared(self):
        for name in _lib._PROTOTYPES:
            self.assertTrue(name in self.functions,
                            "_lib binds %s, which gpupool.h does not declare" % name)

    def test_binding_prototypes(self):
        for name, (res, args) in _lib._PROTOTYPES.items():
            if name not in self.functions:
                continue  # reported by test_bindings_are_declared
            cret, cparams = self.functions[name]
            with self.subTest(function=name):
                self.assertEqual(len(args), len(cparams),
                                 "%s: _lib declares %d arguments, gpupool.h %d (%s)"
                                 % (name, len(args), len(cparams), ", ".join(cparams)))
                self.assertIn(res, expected_ctypes(cret), "%s returns %s" % (name, cret))
                for i, (a, c) in enumerate(zip(args, cparams)):
                    self.assertIn(a, expected_ctypes(c),
                                  "%s argument %d: gpupool.h says %s, _lib %r" % (name, i, c, a))

    def test_memory_kind_names(self):
        self.assertEqual(set(_lib.MEM_KIND_NAMES),
                         {v for k, v in self.values.items() if k.startswith("MEM_")})

    def test_error_codes(self):
        try:
            _lib.lib()
        except gpupool.LibraryNotFoundError as e:
            self.skipTest(str(e))
        self.assertEqual(_errors.codes(), self.errors)
        # The list ends where the header says it does.
        self.assertEqual(min(self.errors.values()) - 1, self.values["ERRNO_MIN"])


if __name__ == "__main__":
    unittest.main()
