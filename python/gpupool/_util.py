"""Small pieces every object of the package uses: names as the C library takes them,
CUDA streams as handles, and which framework a tensor comes from."""

from __future__ import annotations

from typing import Any, Union

from . import _dlpack, _lib
from ._errors import error

# What the API takes as a CUDA stream: None, an int cudaStream_t, or a torch/CuPy stream.
Stream = Union[None, int, Any]
# What the API takes as a device: None, an int (a CUDA device), "cpu", "cuda", "cuda:N", or
# a torch.device / cupy.cuda.Device.
Device = Union[None, int, str, Any]

_HOST_DEVICES = (_dlpack.kDLCPU, _dlpack.kDLCUDAHost, _dlpack.kDLROCMHost)


def _encode_name(name: str | bytes, what: str = "name") -> bytes:
    if isinstance(name, bytes):
        b = name
    else:
        b = str(name).encode("utf-8")
    if b"\0" in b:
        raise error("ENAME", "%s %r contains a NUL byte; names are 1..%d bytes of UTF-8 "
                    "without NUL" % (what, name, _lib.NAME_MAX))
    return b


def stream_handle(stream: Stream) -> int | None:
    """A raw cudaStream_t value (int) or None from a stream given as None, an int, a
    torch.cuda.Stream (``cuda_stream``) or a CuPy stream (``ptr``)."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise TypeError("stream must be None, an int handle or a stream object, not bool")
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    raise TypeError("cannot use %r as a CUDA stream: pass None, an int cudaStream_t, a "
                    "torch.cuda.Stream or a cupy.cuda.Stream" % (stream,))


def _framework(obj):
    return type(obj).__module__.split(".", 1)[0]


def _current_stream(obj, device_id):
    """The stream a framework queues work on now, for a tensor of that framework."""
    fw = _framework(obj)
    try:
        if fw == "torch":
            import torch

            return torch.cuda.current_stream(device_id).cuda_stream
        if fw == "cupy":
            import cupy

            with cupy.cuda.Device(device_id):
                return cupy.cuda.get_current_stream().ptr
    except Exception:
        pass
    return None
