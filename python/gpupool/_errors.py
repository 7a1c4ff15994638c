"""GpupoolError, a subclass of it per error code, and the one place where a code and a
message become an exception (error()).

Each class also derives from the builtin exception a Python user would catch for that kind
of failure, so ``except TimeoutError`` works as well as ``except GpupoolError`` or
``except GpupoolError.ETIMEDOUT``:

    ETIMEDOUT                  TimeoutError
    ENOENT                     FileNotFoundError and LookupError: the daemon has no such
                               name, pool, buffer or hold (a missing key; a file that is
                               not there when published comes as ENOENT too)
    EEXIST                     FileExistsError
    EPERM, ERDONLY             PermissionError
    ENOMEM, ENOSPC             MemoryError (host memory, or the pool's, ran out)
    EINVAL, ENAME, EMETA       ValueError
    ECONNECT, EIO, EPEER       ConnectionError

Other codes (ETOOBIG, ELIMIT, EBUSY, ECLOSED, ENOTSUP, ...) have no builtin that means the
same and derive from GpupoolError alone. The codes and their names are the C library's
(gpupool_err_name, GPUPOOL_ERRNO_MAP in gpupool.h), read once when first needed; this file
names only the builtins.
"""

import threading
from typing import Dict, Optional, Tuple, Type, Union, cast

__all__ = ["GpupoolError", "LibraryNotFoundError", "FrameworkMissingError", "framework", "error",
           "code", "codes"]

_BUILTINS: Dict[str, Tuple[type, ...]] = {
    "ETIMEDOUT": (TimeoutError,),
    "ENOENT": (FileNotFoundError, LookupError),
    "EEXIST": (FileExistsError,),
    "EPERM": (PermissionError,),
    "ERDONLY": (PermissionError,),
    "ENOMEM": (MemoryError,),
    "ENOSPC": (MemoryError,),
    "EINVAL": (ValueError,),
    "ENAME": (ValueError,),
    "EMETA": (ValueError,),
    "ECONNECT": (ConnectionError,),
    "EIO": (ConnectionError,),
    "EPEER": (ConnectionError,),
}


class _ErrorType(type):
    """Gives GpupoolError.ENOENT and friends: the subclass of a code, made on first use."""

    def __getattr__(cls, attr: str) -> type:
        if cls is GpupoolError and attr.startswith("E") and attr.isupper():
            known = codes()
            if not known or attr in known:
                return error_class(attr)
        raise AttributeError("type object %r has no attribute %r" % (cls.__name__, attr))


class GpupoolError(Exception, metaclass=_ErrorType):
    """A gpupool call failed.

    Attributes: ``code`` (the negative GPUPOOL_E* number), ``name`` ("ENOSPC", ...) and
    ``message`` (the C library's explanation: what went wrong and what to do about it).
    The exception is an instance of the subclass of its code (``GpupoolError.ENOSPC``), which
    also derives from the matching builtin (see gpupool._errors).
    """

    code: int
    name: str
    message: str

    def __init__(self, code: int, name: str, message: str) -> None:
        self.code = code
        self.name = name
        self.message = message
        super().__init__("%s: %s" % (name, message) if name else message)

    def __str__(self) -> str:
        # OSError's own __str__ would come first for the OSError subclasses.
        return "%s: %s" % (self.name, self.message) if self.name else self.message

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (error, (self.code, self.message))


GpupoolError.__module__ = "gpupool"


class LibraryNotFoundError(GpupoolError, OSError):
    """libgpupool-client.so could not be loaded."""

    def __init__(self, message: str) -> None:
        GpupoolError.__init__(self, 0, "ENOLIB", message)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (LibraryNotFoundError, (self.message,))


LibraryNotFoundError.__module__ = "gpupool"

# What to install for each optional framework, said in the error when it is missing.
_INSTALL = {
    "numpy": "pip install 'gpupool[numpy]' (or pip install numpy)",
    "torch": "pip install torch (https://pytorch.org for the build matching your CUDA)",
    "cupy": "pip install cupy-cuda12x (or the CuPy package matching your CUDA version)",
}


class FrameworkMissingError(GpupoolError, ImportError):  # type: ignore[misc]  # .name: "ENOMODULE"
    """An optional framework (NumPy, torch, CuPy) that a call needs is not installed.
    ``module`` names it; the message says what to install."""

    def __init__(self, module: str, message: str) -> None:
        GpupoolError.__init__(self, 0, "ENOMODULE", message)
        self.module = module

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (FrameworkMissingError, (self.module, self.message))


FrameworkMissingError.__module__ = "gpupool"


def framework(module: str, what: str):  # type: ignore[no-untyped-def]
    """Import an optional framework for `what` (a call, "Tensor.numpy()"), or raise
    FrameworkMissingError naming the package to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise FrameworkMissingError(module, "%s needs %s, which is not installed (%s): %s"
                                    % (what, module, e, _INSTALL.get(module, "pip install "
                                                                     + module))) from None

_lock = threading.Lock()
_classes: Dict[str, Type[GpupoolError]] = {}
_codes: Optional[Dict[str, int]] = None


def codes() -> Dict[str, int]:
    """{name: code} of every error code the C library knows (empty without the library)."""
    global _codes
    if _codes is None:
        from . import _lib

        try:
            L = _lib.lib()
        except LibraryNotFoundError:
            return {}
        found = {}
        c = -1
        # The codes are consecutive from -1 (GPUPOOL_ERRNO_MIN ends them).
        while True:
            name = L.gpupool_err_name(c).decode()
            if name == "UNKNOWN":
                break
            found[name] = c
            c -= 1
        _codes = found
    return _codes


def code(name: str) -> int:
    """The number of an error name ("ENOENT" -> -7); 0 when the library is not there."""
    return codes().get(name, 0)


def error_class(name: str) -> Type[GpupoolError]:
    """The GpupoolError subclass of an error name, made once."""
    with _lock:
        cls = _classes.get(name)
        if cls is None:
            made = _ErrorType(name, (GpupoolError,) + _BUILTINS.get(name, ()),
                              {"__module__": "gpupool", "__qualname__": "GpupoolError." + name,
                               "__doc__": "GpupoolError %s." % name})
            cls = _classes[name] = cast(Type[GpupoolError], made)
    return cls


def error(err: Union[int, str], message: str) -> GpupoolError:
    """The exception for an error code (a negative GPUPOOL_E* number, or its name) with
    `message`: an instance of the code's subclass of GpupoolError."""
    if isinstance(err, str):
        name, num = err, code(err)
    else:
        from . import _lib

        name, num = _lib.err_name(err), err
    return error_class(name)(num, name, message)
