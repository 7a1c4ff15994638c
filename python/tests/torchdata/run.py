"""Runs the tests of gpupool.torch_data (DataLoader batches already pinned) on the host
backend, or exits 77 (ctest's "skipped") saying what is missing: they need torch (CPU is
enough), a gpupoold ($GPUPOOLD) and libgpupool-client ($GPUPOOL_LIBRARY)."""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def missing():
    if not os.environ.get("GPUPOOLD"):
        return "GPUPOOLD is not set (the gpupoold binary to test)"
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return "torch is not installed for %s (%s); set GPUPOOL_PYTHON_TORCH to an " \
               "interpreter that has it" % (sys.executable, e)
    return None


def main():
    why = missing()
    if why:
        print("SKIP: gpupool.torch_data tests not run: %s" % why, flush=True)
        return 77
    suite = unittest.defaultTestLoader.discover(HERE, pattern="test*.py", top_level_dir=HERE)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
