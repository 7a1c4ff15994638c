"""The argument helpers of Client's parts: devices, versions, timeouts, get flags, tensor
descriptions and finding the hold a view lies in."""

from __future__ import annotations

import bisect
import ctypes
import math
from typing import Any, Dict

from . import _dlpack, _dtypes, _lib
from ._errors import error
from ._util import _current_stream


def _meta(dtype, shape, strides, byte_offset):
    m = _lib.TensorMeta()
    m.dtype_code, m.dtype_bits, m.dtype_lanes = dtype.code, dtype.bits, dtype.lanes
    if len(shape) > _lib.MAX_NDIM:
        raise error("EMETA", "tensor has %d dimensions; gpupool carries at most %d"
                    % (len(shape), _lib.MAX_NDIM))
    m.ndim = len(shape)
    for i, n in enumerate(shape):
        m.shape[i] = n
    contiguous = strides is None or _dlpack._is_contiguous(shape, strides)
    m.strides_present = 0 if contiguous else 1
    if not contiguous:
        for i, s in enumerate(strides):
            m.strides[i] = s
    m.byte_offset = byte_offset
    return m


_TORCH_DTYPES: Dict[Any, _dtypes.DType] = {}


def _torch_desc(t):
    """Desc of a torch tensor read from its attributes (about 2 us) instead of through a
    DLPack export (about 30 us): a 1,000-tensor state dict is described in milliseconds,
    not tens of them. None for what only DLPack describes right (conjugate or negative
    views, sparse layouts, other devices, types gpupool lacks)."""
    try:
        dt = _TORCH_DTYPES.get(t.dtype)
        if dt is None:
            dt = _TORCH_DTYPES[t.dtype] = _dtypes.dtype(t.dtype)
        if t.is_conj() or t.is_neg() or str(t.layout) != "torch.strided":
            return None
        dev = t.device
        if dev.type == "cuda":
            device = (_dlpack.kDLCUDA, dev.index if dev.index is not None else 0)
        elif dev.type == "cpu":
            device = (_dlpack.kDLCPU, 0)
        else:
            return None
        return _dlpack.Desc(t.data_ptr(), device, dt, tuple(t.shape), tuple(t.stride()))
    except (ValueError, AttributeError, RuntimeError):
        return None


def _describe(obj, s):
    """obj's DLPack description and the stream its data is ready in: s, or when s is None
    the framework's current stream on obj's CUDA device (None for host memory)."""
    if s is None and hasattr(obj, "__dlpack_device__"):
        dev = obj.__dlpack_device__()
        if int(dev[0]) == _dlpack.kDLCUDA:
            s = _current_stream(obj, int(dev[1]))
    return _dlpack.describe(obj, s), s


def _view_extent(desc):
    """(first byte, span, on a CUDA device) of the memory a view reads, for finding the hold
    it lies in; None when no hold can carry it as it is."""
    if any(st < 0 for st in desc.strides):
        return None  # gpupool descriptions have no negative strides: copy instead
    lo, span = desc.span()
    return desc.data + lo, span, desc.device[0] == _dlpack.kDLCUDA


class _HoldIndex:
    """The live, writable holds of a client sorted by address, to find the one holding a
    view of many tensors without a scan each."""

    def __init__(self, holds):
        hs = sorted((h for h in list(holds) if not h.released and not h.read_only),
                    key=lambda h: h.ptr)
        self._ptrs = [h.ptr for h in hs]
        self._holds = hs

    def find(self, desc):
        extent = _view_extent(desc)
        if extent is None:
            return None
        start, span, cuda = extent
        i = bisect.bisect_right(self._ptrs, start) - 1
        # Buffers do not overlap, but one buffer may be held more than once (an allocation
        # and a get of its name): look at the few holds starting at or just before `start`.
        for j in range(i, max(i - 8, -1), -1):
            h = self._holds[j]
            if (h.kind == _lib.MEM_DEVICE) == cuda and start + span <= h.ptr + h.size \
                    and desc.data >= h.ptr and not h.released:
                return h
        return None


def _parse_device(device):
    """(DLPack device type, device id, label) of a device argument: an int (a CUDA device),
    'cpu' or 'host', 'cuda', 'cuda:N', or an object that prints as one (torch.device) or as
    '<CUDA Device N>' (cupy.cuda.Device)."""
    d = device
    if not isinstance(d, (int, str)):
        d = str(d)
        if d.startswith("<CUDA Device "):
            d = int(d[len("<CUDA Device "):-1])
    if isinstance(d, int):
        return (_dlpack.kDLCUDA, d, "cuda:%d" % d)
    s = d.strip().lower()
    if s in ("cpu", "host"):
        return (_dlpack.kDLCPU, 0, s)
    if s == "cuda":
        return (_dlpack.kDLCUDA, 0, s)
    if s.startswith("cuda:") and s[5:].isdigit():
        return (_dlpack.kDLCUDA, int(s[5:]), s)
    raise ValueError("unknown device %r: use None, 'cpu', 'cuda', 'cuda:N' or an int" % (device,))


def _version_arg(v):
    v = int(v)
    if v < 0:
        raise ValueError("newer_than must be a version number >= 0, not %d" % v)
    return v


def _spec_items(spec):
    """[(name, shape tuple, DType)] from alloc_dict's spec forms."""
    if hasattr(spec, "items"):
        pairs = list(spec.items())
    else:
        pairs = []
        for e in spec:
            e = tuple(e)
            if len(e) == 3:
                pairs.append((e[0], (e[1], e[2])))
            elif len(e) == 2:
                pairs.append(e)
            else:
                raise ValueError("alloc_dict spec entries are (name, (shape, dtype)), "
                                 "(name, example) or (name, shape, dtype), not %r" % (e,))
    out = []
    for key, v in pairs:
        if isinstance(v, (tuple, list)) and len(v) == 2 and \
                isinstance(v[0], (int, tuple, list)) and not hasattr(v, "shape"):
            shape, dt = v
        elif hasattr(v, "shape") and hasattr(v, "dtype"):
            shape, dt = v.shape, v.dtype
        else:
            raise ValueError("alloc_dict: member %r: give (shape, dtype) or an example "
                             "tensor, not %r" % (key, v))
        if isinstance(shape, int):
            shape = (shape,)
        shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise ValueError("alloc_dict: member %r: negative dimension in shape %r"
                             % (key, shape))
        out.append((key, shape, _dtypes.dtype(dt)))
    return out


def _get_flags(read_only, keep_mapped=False, device=None):
    """The GPUPOOL_* flags of a get: the same for buffers and bundles, one or many. device:
    the GPU wanted (GPUPOOL_ON_DEVICE), None or 'cpu' for wherever the version lies."""
    flags = (_lib.READ_ONLY if read_only else 0) | (_lib.KEEP_MAPPED if keep_mapped else 0)
    if device is not None:
        dev_type, dev_id, _ = _parse_device(device)
        if dev_type == _dlpack.kDLCUDA:
            if not 0 <= dev_id <= 1023:
                raise ValueError("device %r: GPU ordinals are 0..1023" % (device,))
            flags |= _lib.TARGET_DEVICE | (dev_id << 16)
    return flags


def _devices_arg(devices):
    """(ctypes int array or None, n) of a broadcast's devices: GPU ordinals or devices."""
    if not devices:
        return None, 0
    ids = []
    for d in devices:
        dev_type, dev_id, _ = _parse_device(d)
        if dev_type != _dlpack.kDLCUDA:
            raise ValueError("devices: %r is no GPU" % (d,))
        ids.append(dev_id)
    return (ctypes.c_int * len(ids))(*ids), len(ids)


def _timeout_ms(timeout, forever):
    if timeout is None:
        if forever:
            return -1
        return 0
    if timeout < 0:
        return -1 if forever else 0
    return min(int(math.ceil(timeout * 1000.0)), 2 ** 31 - 1)
