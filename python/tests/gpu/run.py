"""Runs the GPU Python tests, or exits 77 (ctest's "skipped") saying what is missing.

They need torch with a usable CUDA device, a gpupoold built with the CUDA backend ($GPUPOOLD)
and libgpupool-client ($GPUPOOL_LIBRARY). CuPy is optional: its tests skip without it.
"""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def missing():
    if not os.environ.get("GPUPOOLD"):
        return "GPUPOOLD is not set (the gpupoold binary to test)"
    try:
        import torch
    except ImportError as e:
        return "torch is not installed for %s (%s)" % (sys.executable, e)
    if not torch.cuda.is_available():
        return "torch %s sees no CUDA device" % torch.__version__
    return None


def main():
    why = missing()
    if why:
        print("SKIP: GPU Python tests not run: %s" % why, flush=True)
        return 77
    suite = unittest.defaultTestLoader.discover(HERE, pattern="test*.py", top_level_dir=HERE)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
