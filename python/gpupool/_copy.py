"""Copies into gpupool memory of a tensor that does not live there: memmove or NumPy on the
host, the producing framework's own copy on a GPU."""

import ctypes

from . import _dlpack
from ._errors import error, framework
from ._util import _HOST_DEVICES, _framework

def _copy_into(dst, src, desc, stream):
    """Copy the tensor `src` (described by desc) into the contiguous gpupool tensor dst."""
    if desc.numel == 0:
        return
    host_src = desc.device[0] in _HOST_DEVICES
    host_dst = dst._dl_device[0] in _HOST_DEVICES
    if host_src and host_dst:
        if desc.is_contiguous():
            ctypes.memmove(dst.data_ptr, desc.data, desc.nbytes)
            return
        numpy = framework("numpy", "publishing a non-contiguous host tensor (NumPy gathers it; "
                          "or publish a contiguous copy)")
        lo, span = desc.span()
        raw = desc.dtype.raw_typestr
        size = desc.dtype.itemsize
        sbuf = (ctypes.c_char * span).from_address(desc.data + lo)
        s = numpy.ndarray(desc.shape, dtype=raw, buffer=sbuf, offset=-lo,
                          strides=tuple(x * size for x in desc.strides))
        dbuf = (ctypes.c_char * desc.nbytes).from_address(dst.data_ptr)
        d = numpy.ndarray(desc.shape, dtype=raw, buffer=dbuf)
        d[...] = s
        return
    _framework_copy(dst, src, stream)


def _framework_copy(dst, src, stream):
    """Device copies go through a framework: the producer's own if it is torch or CuPy,
    else whichever of the two is installed (reading src through DLPack)."""
    fw = _framework(src)
    order = [fw] if fw in ("torch", "cupy") else []
    order += [x for x in ("torch", "cupy") if x not in order]
    errors = []
    for name in order:
        try:
            if name == "torch":
                return _torch_copy(dst, src, stream, fw == "torch")
            return _cupy_copy(dst, src, stream, fw == "cupy")
        except ImportError as e:
            errors.append(str(e))
    raise error("ENOTSUP", "copying a %s tensor into gpupool device memory needs torch or CuPy "
                "(%s); install one, or allocate with Client.alloc and produce into it"
                % (type(src).__name__, "; ".join(errors)))


def _torch_copy(dst, src, stream, native):
    import torch

    s = src if native else torch.from_dlpack(src)
    dev = dst._dl_device
    if dev[0] == _dlpack.kDLCUDA and stream not in (None, 0, 1):
        ctx = torch.cuda.stream(torch.cuda.ExternalStream(stream, device=dev[1]))
    elif dev[0] == _dlpack.kDLCUDA and stream in (0, 1):
        ctx = torch.cuda.stream(torch.cuda.default_stream(dev[1]))
    else:
        ctx = _nullcontext()
    with ctx:
        d = torch.from_dlpack(dst)
        d.copy_(s)


def _cupy_copy(dst, src, stream, native):
    import cupy

    s = src if native else cupy.from_dlpack(src)
    dev = dst._dl_device
    if stream is not None and dev[0] == _dlpack.kDLCUDA:
        with cupy.cuda.Device(dev[1]):
            ctx = cupy.cuda.ExternalStream(stream)
    else:
        ctx = _nullcontext()
    with ctx:
        d = cupy.from_dlpack(dst)
        d[...] = s


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
