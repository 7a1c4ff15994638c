"""Runs the gpupool.torch GPU tests (CUDA tensors through torch.multiprocessing, install()
with and without use_allocator()), or exits 77 (ctest's "skipped") saying what is missing.

They need torch with a usable CUDA device, a gpupoold built with the CUDA backend ($GPUPOOLD),
libgpupool-client ($GPUPOOL_LIBRARY) and libgpupool-torch-alloc
($GPUPOOL_TORCH_ALLOC_LIBRARY, or next to libgpupool-client).
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
        print("SKIP: gpupool.torch GPU tests not run: %s" % why, flush=True)
        return 77
    suite = unittest.defaultTestLoader.discover(HERE, pattern="test*.py", top_level_dir=HERE)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
