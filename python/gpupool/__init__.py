"""gpupool for Python: share tensors between processes through gpupoold, without copies.

A producer publishes a tensor under a name; consumers in other processes get it and import
it into torch, CuPy, JAX or NumPy with DLPack, reading the very memory the producer wrote::

    import gpupool, torch

    with gpupool.Client() as c:                      # producer
        t = torch.from_dlpack(c.alloc((1024, 1024), "float32", device="cuda:0"))
        t.normal_()                                  # produce straight into gpupool memory
        c.publish("weights", t)                      # no copy

    with gpupool.Client() as c:                      # consumer, another process
        w = torch.from_dlpack(c.get("weights", timeout=10))

Publishing a tensor that does not live in gpupool memory copies it once into a new gpupool
buffer (C-contiguous). This package is pure Python over libgpupool-client.so (ctypes); set
GPUPOOL_LIBRARY to the library's full path when it is not installed where the loader looks.
"""

from ._dtypes import DType, dtype
from ._errors import FrameworkMissingError, GpupoolError, LibraryNotFoundError
from ._client import Client
from ._dict import TensorDict
from ._tensor import Tensor

try:
    from ._version import __version__  # written by the wheel build (scikit-build-core)
except ImportError:  # a source tree on PYTHONPATH: the CMake project's version
    def _source_version() -> str:
        import os
        import re
        top = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "CMakeLists.txt")
        try:
            with open(top) as f:
                m = re.search(r"project\(gpupool VERSION ([0-9]+\.[0-9]+\.[0-9]+)", f.read())
        except OSError:
            m = None
        return m.group(1) if m else "0+unknown"
    __version__ = _source_version()
    del _source_version

__all__ = ["Client", "Tensor", "TensorDict", "GpupoolError", "LibraryNotFoundError",
           "FrameworkMissingError", "DType",
           "dtype", "library_version"]


def library_version() -> str:
    """Version string of the loaded libgpupool-client."""
    from . import _lib

    return _lib.lib().gpupool_version_string().decode()
