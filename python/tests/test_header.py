"""The Python package's constants agree with include/gpupool/gpupool.h: error codes and
names, flags, memory kinds and limits. The header is parsed here, so a value changed on one
side only fails this test."""

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
    "FILE_HOST_ONLY": "FILE_HOST_ONLY",
    "KEEP_MAPPED": "KEEP_MAPPED",
    "BUNDLE_MAX_MEMBERS": "BUNDLE_MAX_MEMBERS",
    "MEM_HOST": "MEM_HOST",
    "MEM_DEVICE": "MEM_DEVICE",
    "MEM_HOST_NUMA": "MEM_HOST_NUMA",
}


def parse_header(text):
    """({name: value} of the integer macros and enumerators, {error name: code})."""
    values = {}
    for m in re.finditer(r"^#define GPUPOOL_(\w+)\s+(0x[0-9a-fA-F]+|-?[0-9]+)[uU]?\s*$",
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


class Header(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(HEADER) as f:
            cls.values, cls.errors = parse_header(f.read())

    def test_parsed_something(self):
        # A parser that finds nothing would pass every comparison below.
        self.assertGreaterEqual(len(self.errors), 20)
        self.assertIn("NAME_MAX", self.values)

    def test_constants(self):
        for py, c in CONSTANTS.items():
            self.assertIn(c, self.values, "GPUPOOL_%s is not in gpupool.h" % c)
            self.assertEqual(getattr(_lib, py), self.values[c], "%s vs GPUPOOL_%s" % (py, c))

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
