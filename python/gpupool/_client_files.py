"""Client's published files: publish_file, and get_file_array's read-only views."""

from __future__ import annotations

import ctypes
import os
from typing import Dict, Sequence

from . import _dlpack, _dtypes, _lib
from ._dtypes import DTypeLike
from ._errors import error
from ._holds import _FileHold
from ._lib import check
from ._tensor import Tensor
from ._util import Device, _encode_name
from ._client_args import _parse_device, _timeout_ms


class _Files:
    """Read-only files published by path and viewed without a copy."""

    def publish_file(self, name: str, path: str | bytes | os.PathLike[str], offset: int = 0,
                     length: int | None = None) -> Dict[str, int]:
        """Publish a read-only file, or `length` bytes of it from `offset` (None: to the end),
        under `name`; consumers map it with ``get_file_array(name, ...)`` without a copy of
        their own (they all share the page cache). The file is opened here with this
        process's own permissions, so only files it can read can be published; the daemon's
        config may restrict it further (allow_files, file_paths). Returns a dict with the
        range as published (offset, length, size). Unpublish with ``unpublish(name)``."""
        nb = _encode_name(name)
        pb = os.fsencode(path)
        if b"\0" in pb:
            raise ValueError("path %r contains a NUL byte" % (path,))
        offset = int(offset)
        length = 0 if length is None else int(length)
        if offset < 0 or length < 0:
            raise ValueError("offset and length must not be negative")
        info = _lib.FileInfo()
        check(self._lib.gpupool_file_publish(self._conn.usable(), nb, pb, offset, length,
                                             ctypes.byref(info)),
              "publish_file %r (%s)" % (name, path))
        return {"offset": info.offset, "length": info.length, "size": info.size}

    def get_file_array(self, name: str, dtype: DTypeLike, shape: int | Sequence[int] | None = None,
                       offset: int = 0, device: Device = None,
                       timeout: float | None = 0) -> Tensor:
        """A read-only Tensor viewing the file published under `name`, without a copy.

        dtype: element type; shape: None for a 1-D array of every whole element from
        `offset` (bytes into the published range) to its end, else the C-contiguous shape
        to view there. device: None or 'cpu' for a host view (``numpy.asarray(t)`` reads the
        shared page cache); 'cuda', 'cuda:N' or an int for the GPU view of the same mapping
        (CUDA backend: registered read-only and mapped, so kernels read it in place over PCIe;
        ``cupy.from_dlpack(t)``, ``torch.from_dlpack(t)``). timeout: seconds to wait for a
        publisher (0 = fail at once, None = forever). Raises GpupoolError ESTALE when the file
        changed since it was published."""
        nb = _encode_name(name)
        dt = _dtypes.dtype(dtype)
        dl = (_dlpack.kDLCPU, 0) if device is None else _parse_device(device)[:2]
        flags = _lib.FILE_HOST_ONLY if dl[0] == _dlpack.kDLCPU else 0
        f = _lib.FileP()
        check(self._lib.gpupool_file_get(self._conn.usable(), nb,
                                         _timeout_ms(timeout, forever=True), flags,
                                         ctypes.byref(f)), "get_file %r" % (name,))
        hold = _FileHold(self._lib, f, dl)
        if dl[0] == _dlpack.kDLCUDA and not hold.device_ptr:
            hold.release()
            raise error("ENOTSUP", "file %r has no GPU mapping: the daemon runs the host backend "
                        "(get it with device=None and copy to the GPU)" % (name,))
        offset = int(offset)
        size = hold.size
        if offset < 0 or offset > size:
            hold.release()
            raise ValueError("offset %d lies outside the %d published bytes of %r"
                             % (offset, size, name))
        if shape is None:
            shape = ((size - offset) // dt.itemsize,)
        shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        need = _dlpack.numel(shape) * dt.itemsize
        if any(n < 0 for n in shape) or offset + need > size:
            hold.release()
            raise ValueError("shape %r of %s needs %d bytes from offset %d, but %r has %d bytes"
                             % (shape, dt.name, need, offset, name, size))
        return self._tensor(hold, dt, shape, None, offset, name)
