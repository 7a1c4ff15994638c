"""Stream ordering between CUDA streams, through the CUDA driver API (libcuda.so.1).

The C library makes a buffer safe to use in the stream passed to get/open (that stream
waits on the producer's ready event). A DLPack consumer may then ask for the data on
another stream (``__dlpack__(stream=...)``); this module makes that stream wait on the first
with an event, without blocking the CPU, or blocks the CPU when host code is the consumer.

The driver library ships with the NVIDIA driver, so this works with whatever CUDA runtime
the framework in the process (torch, CuPy, JAX) brought along. Stream handles are the same
values in both APIs: 0 and 1 name the legacy default stream, 2 the per-thread default
stream. Work happens in the device's primary context, the one CUDA runtimes use.
"""

import ctypes
import threading

__all__ = ["available", "stream_wait", "stream_sync", "same_stream"]

CU_EVENT_DISABLE_TIMING = 0x2

_lock = threading.Lock()
_drv = None
_drv_error = None
_ctx = {}  # type: dict


class CudaError(RuntimeError):
    pass


def _load():
    global _drv, _drv_error
    with _lock:
        if _drv is not None or _drv_error is not None:
            return _drv
        try:
            d = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            _drv_error = "cannot load libcuda.so.1 (%s): no NVIDIA driver here" % e
            return None
        vp = ctypes.c_void_p
        pvp = ctypes.POINTER(ctypes.c_void_p)
        ci = ctypes.c_int
        protos = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ci), ci],
            "cuDevicePrimaryCtxRetain": [pvp, ci],
            "cuCtxPushCurrent_v2": [vp],
            "cuCtxPopCurrent_v2": [pvp],
            "cuEventCreate": [pvp, ctypes.c_uint],
            "cuEventRecord": [vp, vp],
            "cuEventDestroy_v2": [vp],
            "cuStreamWaitEvent": [vp, vp, ctypes.c_uint],
            "cuStreamSynchronize": [vp],
            "cuGetErrorString": [ci, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, args in protos.items():
            f = getattr(d, name)
            f.restype = ci
            f.argtypes = args
        rc = d.cuInit(0)
        if rc != 0:
            _drv_error = "cuInit failed with CUDA error %d" % rc
            return None
        _drv = d
        return _drv


def available():
    return _load() is not None


def _check(rc, what):
    if rc != 0:
        s = ctypes.c_char_p()
        _drv.cuGetErrorString(rc, ctypes.byref(s))
        raise CudaError("%s failed: CUDA error %d (%s)" % (
            what, rc, s.value.decode() if s.value else "unknown"))


def _push(device):
    d = _load()
    if d is None:
        raise CudaError(_drv_error)
    ctx = _ctx.get(device)
    if ctx is None:
        dev = ctypes.c_int()
        _check(d.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet(%d)" % device)
        c = ctypes.c_void_p()
        _check(d.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), "cuDevicePrimaryCtxRetain")
        # Kept for the process's lifetime: frameworks keep the primary context alive too.
        ctx = _ctx.setdefault(device, c.value)
    _check(d.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")


def _pop():
    c = ctypes.c_void_p()
    _drv.cuCtxPopCurrent_v2(ctypes.byref(c))


def _norm(stream):
    # 0 (NULL) and 1 (CU_STREAM_LEGACY) are both the legacy default stream.
    return 1 if stream in (None, 0, 1) else stream


def same_stream(a, b):
    return _norm(a) == _norm(b)


def stream_wait(consumer, producer, device):
    """Make `consumer` wait for the work queued so far in `producer` (CPU does not block)."""
    if same_stream(consumer, producer):
        return
    _push(device)
    try:
        ev = ctypes.c_void_p()
        _check(_drv.cuEventCreate(ctypes.byref(ev), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        try:
            _check(_drv.cuEventRecord(ev, _norm(producer)), "cuEventRecord")
            _check(_drv.cuStreamWaitEvent(_norm(consumer), ev, 0), "cuStreamWaitEvent")
        finally:
            # Destroying an event with a pending wait is allowed: the wait still completes.
            _drv.cuEventDestroy_v2(ev)
    finally:
        _pop()


def stream_sync(stream, device):
    """Block the calling thread until the work queued in `stream` has completed."""
    _push(device)
    try:
        _check(_drv.cuStreamSynchronize(_norm(stream)), "cuStreamSynchronize")
    finally:
        _pop()
