"""Runs the tests of sharded versions from torch DTensors on the host backend, or exits 77
(ctest's "skipped") saying what is missing: torch with torch.distributed, its gloo backend
and DTensor (CPU is enough), a gpupoold ($GPUPOOLD) and libgpupool-client ($GPUPOOL_LIBRARY).
The interpreter is the torch venv's (tests/python/torch_tests.sh --dtensor)."""

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
        return "torch is not installed for %s (%s); set GPUPOOL_TORCH_PYTHON to an " \
               "interpreter that has it" % (sys.executable, e)
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    from test_dtensor_refit import WHY

    return WHY


def main():
    why = missing()
    if why:
        print("SKIP: DTensor refit tests not run: %s" % why, flush=True)
        return 77
    suite = unittest.defaultTestLoader.discover(HERE, pattern="test*.py", top_level_dir=HERE)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
