"""Tensor: a tensor in gpupool memory handed to users, exported without a copy through
DLPack (torch, CuPy, JAX, NumPy) and NumPy's __array_interface__."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Literal, Optional, Sequence, Tuple

from . import _dlpack, _lib
from ._errors import GpupoolError, error, framework
from ._dtypes import DType
from ._util import _HOST_DEVICES

class Tensor:
    """A tensor in gpupool memory, held by this process.

    Import it into a framework without a copy: ``torch.from_dlpack(t)``,
    ``cupy.from_dlpack(t)``, ``numpy.from_dlpack(t)``, or ``numpy.asarray(t)`` for host
    memory (any dtype NumPy knows, read-only holds included). The hold is released by
    ``release()``, by leaving a ``with`` block, or when the object is garbage-collected;
    framework views made from it keep the memory alive until they are freed too.

    Attributes: shape, dtype (name, e.g. 'float32'), strides (in elements), ndim, nbytes,
    device ('cpu', 'cuda:0', 'cuda_host'), data_ptr (address of element 0), buffer_ptr,
    buffer_size, buffer_id, byte_offset, read_only, name (if obtained by name).
    """

    def __init__(self, hold: Any, dtype: DType, shape: Sequence[int],
                 strides: Sequence[int] | None = None, byte_offset: int = 0,
                 name: str | None = None, client: Any = None) -> None:
        self._hold = hold
        # Keeps the Client (and so its connection) open while this tensor lives.
        self._client = client
        self._dtype = dtype
        self.shape = tuple(int(n) for n in shape)
        self.strides = (tuple(int(s) for s in strides) if strides is not None
                        else _dlpack.contiguous_strides(self.shape))
        self.byte_offset = int(byte_offset)
        self.name = name
        self.buffer_ptr = hold.ptr
        self.buffer_size = hold.size
        self.buffer_id = hold.buffer_id
        self.read_only = hold.read_only
        self._dl_device = hold.dl_device
        self.version: Optional[int] = None

    # --- description -------------------------------------------------------------------
    @property
    def dtype(self) -> str:
        return self._dtype.name

    @property
    def dlpack_dtype(self) -> Tuple[int, int, int]:
        """(code, bits, lanes) as DLPack spells the element type."""
        return (self._dtype.code, self._dtype.bits, self._dtype.lanes)

    @property
    def itemsize(self) -> int:
        return self._dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return _dlpack.numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self._dtype.itemsize

    @property
    def data_ptr(self) -> int:
        return self.buffer_ptr + self.byte_offset

    @property
    def device(self) -> str:
        t, i = self._dl_device
        if t == _dlpack.kDLCUDA:
            return "cuda:%d" % i
        return _dlpack.DEVICE_NAMES.get(t, str(t))

    @property
    def memory_kind(self) -> str:
        """'host' (memfd), 'device' (CUDA device memory) or 'host-numa' (pinned)."""
        return _lib.MEM_KIND_NAMES.get(self._hold.kind if self._hold else 0, "released")

    def is_contiguous(self) -> bool:
        return _dlpack._is_contiguous(self.shape, self.strides)

    @property
    def released(self) -> bool:
        return self._hold is None or self._hold.released

    def __repr__(self) -> str:
        return "<gpupool.Tensor%s shape=%r dtype=%s device=%s%s%s>" % (
            " %r" % self.name if self.name else "", self.shape, self.dtype, self.device,
            " read-only" if self.read_only else "", " released" if self.released else "")

    def _live_hold(self):
        h = self._hold
        if h is None or h.released:
            raise error("EINVAL", "tensor %r was released; get or allocate it again"
                        % (self.name or self.buffer_id))
        return h

    # --- DLPack ------------------------------------------------------------------------
    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._dl_device

    def __dlpack__(self, *, stream: int | None = None,
                   max_version: Tuple[int, int] | None = None,
                   dl_device: Tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """A DLPack capsule viewing this tensor (the array API's __dlpack__).

        max_version >= (1, 0) gives a versioned capsule ("dltensor_versioned", read-only
        flag set for read-only holds); otherwise a legacy "dltensor" capsule, refused for
        read-only holds because that form cannot say so. stream: the consumer's stream
        (CUDA: 1 = legacy default, 2 = per-thread default, other = a cudaStream_t, -1 = no
        synchronisation, None = legacy default); the consumer's stream is made to wait for
        the producer's ready event without blocking the CPU. Zero copy unless copy=True,
        which copies host memory into a private allocation (IS_COPIED) and raises
        BufferError for device memory; a dl_device other than this memory raises too.
        """
        try:
            hold = self._live_hold()
        except GpupoolError as e:
            raise BufferError(str(e)) from None
        dev = self._dl_device
        if copy and dev[0] not in _HOST_DEVICES:
            raise BufferError("gpupool copies only host memory on export; import the view "
                              "and copy with the framework (e.g. torch.from_dlpack(t).clone())")
        if dl_device is not None and tuple(dl_device) != tuple(dev):
            if (int(dl_device[0]), int(dl_device[1])) == (_dlpack.kDLCPU, 0) and \
                    dev[0] == _dlpack.kDLCUDAHost:
                dev = (_dlpack.kDLCPU, 0)  # pinned host memory is host memory
            else:
                raise BufferError("tensor lives on DLPack device %r and cannot be exported "
                                  "to %r without a copy" % (tuple(dev), tuple(dl_device)))
        versioned = max_version is not None and int(max_version[0]) >= 1
        if not versioned and self.read_only:
            raise BufferError("tensor is held read-only and a pre-1.0 DLPack capsule cannot "
                              "say so: use a consumer that passes max_version >= (1, 0) "
                              "(NumPy >= 2.1, torch >= 2.5), numpy.asarray(t) for host "
                              "memory, or get it with read_only=False")
        if dev[0] == _dlpack.kDLCUDA or (dev[0] == _dlpack.kDLCUDAHost and stream is not None):
            if stream == 0:
                raise BufferError("stream 0 is ambiguous for CUDA: pass 1 for the legacy "
                                  "default stream or 2 for the per-thread default stream")
            if stream != -1:
                hold.used_in(1 if stream is None else int(stream))
        elif dev[0] in _HOST_DEVICES:
            hold.sync_cpu()
        version = _dlpack.VERSION
        if versioned and max_version is not None and int(max_version[0]) == 1:
            version = (1, min(_dlpack.VERSION[1], int(max_version[1])))
        if copy:
            # The consumer asked for memory of its own: the bytes this view spans, same
            # layout, in a private host allocation that the capsule owns.
            lo, span = _dlpack.Desc(self.data_ptr, dev, self._dtype, self.shape,
                                    self.strides).span()
            owner = ctypes.create_string_buffer(max(span, 1))
            ctypes.memmove(owner, self.data_ptr + lo, span)
            return _dlpack.make_capsule(ctypes.addressof(owner) - lo, (_dlpack.kDLCPU, 0),
                                        self._dtype, self.shape, self.strides, owner,
                                        versioned, version=version, copied=True)
        return _dlpack.make_capsule(self.data_ptr, dev, self._dtype, self.shape,
                                    self.strides, hold, versioned,
                                    read_only=self.read_only, version=version)

    # --- NumPy -------------------------------------------------------------------------
    @property
    def __array_interface__(self) -> Dict[str, Any]:
        """Host memory as NumPy sees it (numpy.asarray(t): a view, read-only for read-only
        holds). Such a view refers to this object: release() invalidates it, so prefer
        t.numpy() or numpy.from_dlpack(t), whose views keep the memory themselves."""
        if self._dtype.typestr is None:
            raise TypeError("NumPy has no %s type: use numpy(raw=True) for its bits, or "
                            "import it with a framework that has it" % self.dtype)
        return self._host_interface(self._dtype.typestr)

    def _host_interface(self, typestr):
        hold = self._live_hold()
        if self._dl_device[0] not in _HOST_DEVICES:
            raise TypeError("tensor is in %s memory, which NumPy cannot read: import it with "
                            "torch.from_dlpack or cupy.from_dlpack" % self.device)
        hold.sync_cpu()
        size = self._dtype.itemsize
        return {
            "version": 3,
            "shape": self.shape,
            "typestr": typestr,
            "data": (self.data_ptr, self.read_only),
            "strides": None if self.is_contiguous() else tuple(s * size for s in self.strides),
        }

    def numpy(self, raw: bool = False) -> Any:
        """A NumPy view (no copy) of host memory. raw=True views the bits as unsigned
        integers of the element size, for types NumPy lacks (bfloat16). Without NumPy:
        FrameworkMissingError (an ImportError) naming pip install 'gpupool[numpy]'."""
        numpy = framework("numpy", "Tensor.numpy()")

        if raw:
            iface = self._host_interface(self._dtype.raw_typestr)
        else:
            iface = self.__array_interface__
        return numpy.asarray(_ArrayView(iface, self._hold))

    # --- lifetime ----------------------------------------------------------------------
    def release(self) -> None:
        """Let go of this object's hold. Views a framework made from it stay valid (they
        hold the memory until freed); this object can no longer be exported."""
        h, self._hold = self._hold, None
        if h is not None:
            # Drop our reference; the hold is released now unless an export still has it.
            del h

    def __enter__(self) -> Tensor:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.release()
        return False


class _ArrayView:
    """What a NumPy view from Tensor.numpy() keeps as its base: the hold itself, so the
    memory stays mapped for as long as the view lives, whatever happens to the Tensor."""

    __slots__ = ("__array_interface__", "hold")

    def __init__(self, iface, hold):
        self.__array_interface__ = iface
        self.hold = hold


# get_dict(reuse_views=True): how many bundles' views a client keeps (two alternate under
