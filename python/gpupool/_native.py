"""gpupool._fast, the C extension that does gpupool.torch's per-tensor steps (see
python/ext/fast.c), or None where gpupool runs in pure Python: the extension was not built
(no Python headers), does not load, or GPUPOOL_PURE_PYTHON=1 asks for the pure-Python path.
Either way behaves the same; the first use says once which path it is and why.

A wheel carries it in the package (gpupool/_fast.abi3.so); a build tree's is found through
GPUPOOL_FAST_MODULE (its full path), as ctest sets it."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys

log = logging.getLogger("gpupool")

_said = False


def _say(level, msg):
    global _said
    if not _said:
        _said = True
        log.log(level, msg)


def _from_path(path):
    name = "gpupool._fast"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError("not an extension module: %s" % path)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules[name] = mod
    return mod


def load():
    """The extension module, or None (said once)."""
    if os.environ.get("GPUPOOL_PURE_PYTHON") == "1":
        _say(logging.INFO, "gpupool: GPUPOOL_PURE_PYTHON=1: gpupool.torch runs its pure-Python path")
        return None
    path = os.environ.get("GPUPOOL_FAST_MODULE")
    try:
        if path:
            return _from_path(path)
        from . import _fast  # type: ignore[attr-defined]
        return _fast
    except (ImportError, OSError) as e:
        where = "GPUPOOL_FAST_MODULE=%s" % path if path else "gpupool._fast"
        _say(logging.WARNING, "gpupool: %s cannot be loaded (%s): gpupool.torch runs its "
             "pure-Python path, slower per tensor; build the package with Python's headers "
             "installed (python3-dev) to have it" % (where, e))
        return None


fast = load()
