"""Runs the tests of gpupool.torch_data (DataLoader batches already pinned) on the host
backend, or exits 77 (ctest's "skipped") saying what is missing: they need torch (CPU is
enough), a gpupoold ($GPUPOOLD) and libgpupool-client ($GPUPOOL_LIBRARY).

The interpreter is the one running this (tests/python/torch_tests.sh --data: the torch venv); when it has no
torch, $GPUPOOL_TORCH_PYTHON or the torch venv tools/test.sh prepares for CI
($GPUPOOL_TORCH_VENV, else /var/cache/gpupool/torch-venv for root, else
~/.cache/gpupool/torch-venv) is used instead when there is one."""

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
    return None


def torch_python():
    """Another interpreter that may have torch, or None."""
    py = os.environ.get("GPUPOOL_TORCH_PYTHON")
    if not py:
        venv = os.environ.get("GPUPOOL_TORCH_VENV")
        if not venv:
            if os.getuid() == 0:
                venv = "/var/cache/gpupool/torch-venv"
            else:
                venv = os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                    os.path.expanduser("~/.cache"), "gpupool", "torch-venv")
        py = os.path.join(venv, "bin", "python")
    if os.access(py, os.X_OK) and os.path.realpath(py) != os.path.realpath(sys.executable):
        return py
    return None


def main():
    why = missing()
    if why and why.startswith("torch") and not os.environ.get("GPUPOOL_TORCH_DATA_REEXEC"):
        py = torch_python()
        if py:
            os.environ["GPUPOOL_TORCH_DATA_REEXEC"] = "1"
            os.execv(py, [py, os.path.abspath(__file__)])
    if why:
        print("SKIP: gpupool.torch_data tests not run: %s" % why, flush=True)
        return 77
    suite = unittest.defaultTestLoader.discover(HERE, pattern="test*.py", top_level_dir=HERE)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
