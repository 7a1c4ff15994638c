"""DLPack in pure Python: the ABI structs, exporting capsules, and reading other's capsules.

Exports: ``make_capsule()`` builds a DLManagedTensor (pre-1.0, capsule "dltensor") or a
DLManagedTensorVersioned (>= 1.0, capsule "dltensor_versioned") in memory owned by a Python
record, and wraps it in a PyCapsule. Per the DLPack Python specification:
- a consumer renames the capsule ("used_dltensor[_versioned]") and later calls the deleter;
- the capsule's destructor calls the deleter only if the capsule still has its original
  name, i.e. nobody consumed it.
The deleter drops the record, and with it the record's reference to the owner (the hold on
the gpupool buffer); the hold is released when its last reference goes.

The deleter and the capsule destructor are C callbacks (ctypes). They are referenced from a
leaked reference so that a framework freeing a tensor late in interpreter shutdown still
calls valid code, and they read nothing from module globals.

Imports: ``describe()`` reads the DLTensor of any object with ``__dlpack__`` (or a NumPy
style ``__array_interface__``) into a plain ``Desc`` without taking ownership of anything.
"""

import ctypes
import struct
import sys
import threading

from . import _dtypes

__all__ = ["Desc", "make_capsule", "describe", "kDLCPU", "kDLCUDA", "kDLCUDAHost"]

kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3
kDLROCM = 10
kDLROCMHost = 11
kDLCUDAManaged = 13

DEVICE_NAMES = {kDLCPU: "cpu", kDLCUDA: "cuda", kDLCUDAHost: "cuda_host",
                kDLROCM: "rocm", kDLROCMHost: "rocm_host", kDLCUDAManaged: "cuda_managed"}

FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1

# The DLPack version this module writes.
VERSION = (1, 1)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


NAME_LEGACY = b"dltensor"
NAME_VERSIONED = b"dltensor_versioned"
NAME_USED_LEGACY = b"used_dltensor"
NAME_USED_VERSIONED = b"used_dltensor_versioned"

_DeleterT = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DestructorT = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# Python C API, called with the GIL held (pythonapi is a PyDLL). Objects are passed by
# address: the capsule destructor runs on an object whose reference count is already zero,
# which a py_object argument would resurrect.
_api = ctypes.pythonapi
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 ctypes.c_void_p)(("PyCapsule_New", _api))
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_capsule_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api))
_py_incref = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", _api))

# Exports alive in some consumer: struct address -> record (struct, arrays, owner).
_live = {}  # type: dict
_live_lock = threading.Lock()


def _make_deleter(live, lock):
    def deleter(addr):
        # Called by the consumer (any thread; ctypes takes the GIL) or by our capsule
        # destructor. Dropping the record drops the owner's reference.
        try:
            with lock:
                rec = live.pop(addr, None)
            del rec
        except BaseException:  # never let an exception cross into C
            pass

    return deleter


def _make_destructor(deleter, is_valid, get_pointer, names):
    def destructor(capsule):
        try:
            for name in names:
                # Still under its original name: nobody consumed it, the deleter is ours
                # to call. A renamed ("used_...") capsule belongs to its consumer.
                if is_valid(capsule, name):
                    addr = get_pointer(capsule, name)
                    if addr:
                        deleter(addr)
                    return
        except BaseException:
            pass

    return destructor


_deleter_py = _make_deleter(_live, _live_lock)
_deleter_c = _DeleterT(_deleter_py)
_destructor_c = _DestructorT(_make_destructor(_deleter_py, _capsule_is_valid,
                                              _capsule_get_pointer,
                                              (NAME_VERSIONED, NAME_LEGACY)))
# Leaked on purpose: frameworks may free tensors (and so call the deleter) during
# interpreter shutdown, after this module's globals are gone.
for _o in (_deleter_c, _destructor_c, NAME_LEGACY, NAME_VERSIONED, _live, _live_lock):
    _py_incref(_o)
del _o
_DELETER_ADDR = ctypes.cast(_deleter_c, ctypes.c_void_p).value
_DESTRUCTOR_ADDR = ctypes.cast(_destructor_c, ctypes.c_void_p).value


class _Record:
    __slots__ = ("struct", "shape", "strides", "owner", "__weakref__")


def live_exports():
    """Number of exported DLPack tensors whose deleter has not run yet (those that
    gpupool._fast made too, once it is loaded)."""
    fast = sys.modules.get("gpupool._fast")
    with _live_lock:
        n = len(_live)
    return n + (fast.live() if fast is not None else 0)


def make_capsule(data, device, dtype, shape, strides, owner, versioned, read_only=False,
                 version=VERSION, copied=False):
    """A new DLPack capsule viewing `data` (element 0) on `device` (type, id).

    dtype is a _dtypes.DType, shape and strides are sequences (strides in elements). owner
    is kept referenced until the consumer calls the deleter (or the capsule is dropped
    unconsumed).
    """
    ndim = len(shape)
    rec = _Record()
    n = max(ndim, 1)
    rec.shape = (ctypes.c_int64 * n)(*shape)
    rec.strides = (ctypes.c_int64 * n)(*strides)
    rec.owner = owner
    if versioned:
        m = DLManagedTensorVersioned()
        m.version.major, m.version.minor = version
        m.flags = (FLAG_READ_ONLY if read_only else 0) | (FLAG_IS_COPIED if copied else 0)
    else:
        m = DLManagedTensor()
    t = m.dl_tensor
    t.data = data
    t.device.device_type, t.device.device_id = device
    t.ndim = ndim
    t.dtype.code, t.dtype.bits, t.dtype.lanes = dtype.code, dtype.bits, dtype.lanes
    t.shape = ctypes.cast(rec.shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(rec.strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    m.manager_ctx = None
    m.deleter = _DELETER_ADDR
    rec.struct = m
    addr = ctypes.addressof(m)
    with _live_lock:
        _live[addr] = rec
    try:
        return _capsule_new(addr, NAME_VERSIONED if versioned else NAME_LEGACY,
                            _DESTRUCTOR_ADDR)
    except BaseException:
        with _live_lock:
            _live.pop(addr, None)
        raise


class _BytesManaged(ctypes.Structure):
    """A DLManagedTensor (legacy) of nbytes uint8 elements, flat, with its one-element shape
    kept after the struct: one ctypes object per export instead of five."""
    _fields_ = [
        ("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
        ("n", ctypes.c_int64),
    ]


_BYTES_SHAPE_AT = _BytesManaged.n.offset
assert _BytesManaged.manager_ctx.offset == ctypes.sizeof(DLTensor)


def bytes_capsule(data, device, nbytes, owner):
    """A legacy DLPack capsule of nbytes bytes (uint8, 1-D, compact) at data on device (type,
    id), keeping owner referenced until the consumer's deleter runs: make_capsule's result for
    that case, at a fraction of its cost."""
    return bytes_capsules(device, [(data, nbytes, owner)])[0]


# _BytesManaged's bytes, written in one call per export by bytes_capsules.
_BYTES_PACK = struct.Struct("=QiiiBBHQQQQQq")
assert _BYTES_PACK.size == ctypes.sizeof(_BytesManaged)


def _legacy_capsules(addrs, recs):
    """Legacy capsules of the DLManagedTensors at addrs, each registered with its record
    (under one lock) so that its deleter drops the record. All or none."""
    # Nothing that allocates a GC-tracked object runs under _live_lock: a collection started
    # there could free an earlier export whose deleter takes the lock (a plain Lock) again.
    new = dict(zip(addrs, recs))
    with _live_lock:
        _live.update(new)
    del new
    caps = []
    try:
        for addr in addrs:
            caps.append(_capsule_new(addr, NAME_LEGACY, _DESTRUCTOR_ADDR))
    except BaseException:
        for addr in addrs[len(caps):]:  # those made into capsules go with their capsules
            with _live_lock:
                rec = _live.pop(addr, None)
            del rec  # its owner (a hold) goes here, outside the lock
        raise
    return caps


def bytes_capsules(device, items):
    """bytes_capsule for many (data, nbytes, owner) on one device (type, id): their structs
    in one array (kept until the last of their deleters has run), written one call each and
    registered under one lock. Returns the capsules in the order of items."""
    n = len(items)
    if n == 0:
        return []
    size = _BYTES_PACK.size
    arr = (_BytesManaged * n)()
    base = ctypes.addressof(arr)
    raw = (ctypes.c_char * (size * n)).from_buffer(arr)
    pack = _BYTES_PACK.pack_into
    dtype, did = device
    addrs, recs = [], []
    for i, (data, nbytes, owner) in enumerate(items):
        addr = base + i * size
        pack(raw, i * size, data, dtype, did, 1, 1, 8, 1, addr + _BYTES_SHAPE_AT, 0, 0, 0,
             _DELETER_ADDR, nbytes)
        rec = _Record()
        rec.struct = arr
        rec.owner = owner
        addrs.append(addr)
        recs.append(rec)
    return _legacy_capsules(addrs, recs)


# A legacy DLManagedTensor (DLTensor, manager_ctx, deleter), written by view_capsules with its
# shape and strides (int64 each) right after it.
_VIEW_PACK = struct.Struct("=QiiiBBHQQQQQ")
assert _VIEW_PACK.size == ctypes.sizeof(DLManagedTensor)


def view_capsules(device, items):
    """Legacy DLPack capsules for many (data, (code, bits), shape, strides, owner) on one
    device (type, id): each a view of that element type, shape and strides (in elements) at
    data, keeping owner referenced until the consumer's deleter runs. Their structs, shapes
    and strides lie in one buffer (kept until the last of their deleters has run). Returns
    the capsules in the order of items."""
    if not items:
        return []
    head = _VIEW_PACK.size
    sizes = [head + 16 * len(it[2]) for it in items]
    buf = (ctypes.c_char * sum(sizes))()
    base = ctypes.addressof(buf)
    pack = _VIEW_PACK.pack_into
    dtype, did = device
    addrs, recs = [], []
    at = 0
    for (data, (code, bits), shape, strides, owner), size in zip(items, sizes):
        addr = base + at
        nd = len(shape)
        pack(buf, at, data, dtype, did, nd, code, bits, 1, addr + head, addr + head + 8 * nd, 0, 0,
             _DELETER_ADDR)
        struct.pack_into("=%dq" % (2 * nd), buf, at + head, *shape, *strides)
        rec = _Record()
        rec.struct = buf
        rec.owner = owner
        addrs.append(addr)
        recs.append(rec)
        at += size
    return _legacy_capsules(addrs, recs)


class Desc:
    """What a tensor is, without owning it: data (address of element 0), device (type,
    id), dtype (_dtypes.DType), shape, strides (in elements; C-contiguous filled in when
    the producer gave none) and read_only."""

    __slots__ = ("data", "device", "dtype", "shape", "strides", "read_only")

    def __init__(self, data, device, dtype, shape, strides, read_only=False):
        self.data = data
        self.device = device
        self.dtype = dtype
        self.shape = tuple(shape)
        self.strides = tuple(strides) if strides is not None else contiguous_strides(shape)
        self.read_only = read_only

    @property
    def numel(self):
        return numel(self.shape)

    @property
    def nbytes(self):
        return self.numel * self.dtype.itemsize

    def is_contiguous(self):
        return _is_contiguous(self.shape, self.strides)

    def span(self):
        """(lowest byte, bytes from there to one past the highest byte) the view touches."""
        if self.numel == 0:
            return 0, 0
        lo = hi = 0
        for n, s in zip(self.shape, self.strides):
            if s < 0:
                lo += (n - 1) * s
            else:
                hi += (n - 1) * s
        size = self.dtype.itemsize
        return lo * size, (hi - lo + 1) * size

    def __repr__(self):
        return "Desc(data=0x%x, device=%r, dtype=%s, shape=%r, strides=%r)" % (
            self.data or 0, self.device, self.dtype, self.shape, self.strides)


def numel(shape):
    """Number of elements of a tensor of this shape."""
    n = 1
    for s in shape:
        n *= s
    return n


def contiguous_strides(shape):
    strides = [0] * len(shape)
    s = 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = s
        s *= max(shape[i], 1)
    return tuple(strides)


def _is_contiguous(shape, strides):
    s = 1
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != s:
            return False
        s *= n
    return True


def _read_managed(addr, versioned):
    if versioned:
        m = DLManagedTensorVersioned.from_address(addr)
        if m.version.major != 1:
            raise BufferError("DLPack tensor has ABI version %d.%d; gpupool reads 1.x"
                              % (m.version.major, m.version.minor))
        read_only = bool(m.flags & FLAG_READ_ONLY)
    else:
        m = DLManagedTensor.from_address(addr)
        read_only = False
    t = m.dl_tensor
    ndim = t.ndim
    shape = [t.shape[i] for i in range(ndim)]
    strides = [t.strides[i] for i in range(ndim)] if t.strides else None
    dt = _dtypes.from_dlpack_code(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    data = (t.data or 0) + t.byte_offset
    return Desc(data, (t.device.device_type, t.device.device_id), dt, shape, strides,
                read_only)


def describe_capsule(capsule):
    """Desc of an unconsumed DLPack capsule. The capsule is left unconsumed: dropping it
    lets its own destructor release the producer's memory."""
    p = id(capsule)
    if _capsule_is_valid(p, NAME_VERSIONED):
        return _read_managed(_capsule_get_pointer(p, NAME_VERSIONED), True)
    if _capsule_is_valid(p, NAME_LEGACY):
        return _read_managed(_capsule_get_pointer(p, NAME_LEGACY), False)
    raise BufferError("object is not an unconsumed DLPack capsule (its name is neither "
                      "'dltensor' nor 'dltensor_versioned')")


def describe_array_interface(ai, dtype_name=None):
    """Desc from a NumPy __array_interface__ dict (host memory). dtype_name (the array's
    dtype.name) names types the typestr cannot, such as ml_dtypes' bfloat16 ('<V2')."""
    data, read_only = ai["data"]
    descr_name = dtype_name if ai["typestr"][1:2] == "V" else None
    dt = _dtypes.from_typestr(ai["typestr"], descr_name)
    shape = tuple(ai["shape"])
    bstrides = ai.get("strides")
    if bstrides is None:
        strides = None
    else:
        size = dt.itemsize
        if any(s % size for s in bstrides):
            raise BufferError("array strides %r are not multiples of the element size %d; "
                              "copy it into a contiguous array first" % (bstrides, size))
        strides = [s // size for s in bstrides]
    return Desc(data or 0, (kDLCPU, 0), dt, shape, strides, bool(read_only))


def dlpack_stream_arg(device_type, stream):
    """The `stream` to pass to a producer's __dlpack__ for a consumer working on `stream`
    (a raw handle or None): per the array API, 1 names CUDA's legacy default stream and
    None is for devices without streams."""
    if device_type in (kDLCUDA, kDLROCM):
        if stream is None or stream == 0:
            return 1
        return stream
    return None


def describe(obj, stream=None):
    """Desc of a tensor-like object (anything with __dlpack__ or __array_interface__).

    NumPy-style host arrays are read through __array_interface__ first: it covers every
    dtype (old NumPy releases refuse bool and read-only arrays over DLPack) and costs no
    capsule. Everything else goes through __dlpack__, asking for a versioned capsule and
    falling back to the legacy protocol for producers that predate it.
    """
    ai = getattr(obj, "__array_interface__", None)
    if isinstance(ai, dict) and ai.get("data") is not None:
        name = getattr(getattr(obj, "dtype", None), "name", None)
        try:
            return describe_array_interface(ai, name if isinstance(name, str) else None)
        except ValueError:
            if not hasattr(obj, "__dlpack__"):
                raise
    if not hasattr(obj, "__dlpack__"):
        raise TypeError("%s is not a tensor: gpupool takes objects with __dlpack__ "
                        "(torch, CuPy, JAX, NumPy arrays)" % type(obj).__name__)
    dev = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (kDLCPU, 0)
    s = dlpack_stream_arg(int(dev[0]), stream)
    try:
        cap = obj.__dlpack__(stream=s, max_version=VERSION)
    except TypeError:
        cap = obj.__dlpack__(stream=s) if s is not None else obj.__dlpack__()
    return describe_capsule(cap)
