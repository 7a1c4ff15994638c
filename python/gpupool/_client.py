"""Client: a connection to gpupoold, and what it hands out (Tensors, TensorDicts).

Owns the Python side of a connection (Client), the holds it has on buffers (_Hold: one C
gpupool_buffer each, released exactly once), and the tensors handed to users (Tensor), which
any DLPack consumer (torch, CuPy, JAX, NumPy) imports without a copy.

Lifetimes:
- A _Hold is released when its last Python reference goes: the Tensor that got it, and every
  DLPack export of that Tensor still alive in some framework. ``Tensor.release()`` drops the
  Tensor's own reference; views a framework made keep the memory until they are freed.
- ``Client.close()`` releases the holds of its Tensors and closes the connection as soon as
  no exported view is left (at once when there is none). Until then the connection stays
  open so that those views stay mapped; no new request is accepted.
- When the process exits or dies, the daemon drops every hold it had (the connection is the
  lease), so nothing leaks across processes.

Copies: ``Client.publish`` publishes a Tensor from ``Client.alloc`` (or any view of one) in
place. Any other tensor is copied once into a new gpupool buffer, compacted to C-contiguous
order: host memory with memmove (NumPy for strided views), GPU memory with the producing
framework's own copy (``copy_`` / ``[...] =``) on the producer's stream.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import weakref
import os
from typing import Any, Dict, List, Literal

from . import _lib
from ._client_admin import _Admin
from ._client_buffers import _Buffers
from ._client_dicts import _Dicts
from ._client_files import _Files
from ._client_refit import _Refit
from ._dict import TensorDict
from ._holds import _Conn, _Hold
from ._lib import check
from ._tensor import Tensor
from ._util import _encode_name

class Client(_Buffers, _Dicts, _Files, _Admin, _Refit):
    """A connection to gpupoold.

    socket: path of the daemon's socket (None: $GPUPOOL_SOCKET or the default path). name:
    shown in the daemon's logs. connect_timeout: seconds allowed to connect and get the
    daemon's answer (None: $GPUPOOL_CONNECT_TIMEOUT_MS or 5 s); a daemon that is stopped or
    stuck raises GpupoolError ("the daemon did not answer in N s") instead of hanging. Use as a
    context manager or call close().

    The requests are grouped by what they handle, each group a part of its own:
    _client_buffers (alloc, get, get_many, publish, share, open, unpublish), _client_dicts
    (alloc_dict, publish_dict, get_dict, get_dicts), _client_files (publish_file,
    get_file_array), _client_admin (pools, stats, host_fences, trim, set_devices) and
    _client_refit (publish_shard, refit_plan). This class holds the connection and what it
    handed out.
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None, name: str | None = None,
                 connect_timeout: float | None = None) -> None:
        L = _lib.lib()
        h = _lib.ClientP()
        sock = None if socket is None else _encode_name(str(socket), "socket path")
        nm = None if name is None else _encode_name(name, "client name")
        ms = _lib.TIMEOUT_DEFAULT
        if connect_timeout is not None:
            if connect_timeout <= 0:
                raise ValueError("connect_timeout must be a positive number of seconds")
            ms = max(1, int(round(connect_timeout * 1000)))
        # The library's message names the socket and how to start the daemon.
        check(L.gpupool_client_connect(sock, nm, ms, ctypes.byref(h)))
        self._conn = _Conn(h, L, socket)
        self._lib = L
        self._tensors: weakref.WeakSet[Tensor] = weakref.WeakSet()
        self._dicts: weakref.WeakSet[TensorDict] = weakref.WeakSet()
        self._holds: weakref.WeakSet[Any] = weakref.WeakSet()
        self._pools: List[Dict[str, Any]] | None = None
        # get_dict(reuse_views=True): framework views by (framework, layout, buffers), the
        # most recently used last; each keeps the memory it views (see TensorDict.torch).
        self._views: collections.OrderedDict[Any, Dict[str, Any]] = collections.OrderedDict()
        self._views_lock = threading.Lock()
        # (reconnects, layout id) -> Layout
        self._layouts: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    @staticmethod
    def default_socket_path() -> str:
        L = _lib.lib()
        buf = ctypes.create_string_buffer(4096)
        if L.gpupool_client_default_socket_path(buf, len(buf)) < 0:
            return "(default socket)"
        return buf.value.decode(errors="replace")

    def close(self) -> None:
        """Release the holds of this client's Tensors and disconnect. Views that frameworks
        made from them keep their memory mapped: the connection closes when the last one
        is freed."""
        conn = getattr(self, "_conn", None)
        if conn is None or conn.close_requested:
            return
        with self._views_lock:
            self._views.clear()
        for t in list(self._tensors):
            t.release()
        for d in list(self._dicts):
            d.release()
        conn.close()

    @property
    def closed(self) -> bool:
        return self._conn.close_requested

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except BaseException:
            pass

    def _new_hold(self, buf, stream):
        try:
            hold = _Hold(self._conn, buf, stream)
        except BaseException:
            self._lib.gpupool_buffer_release(buf, stream)
            raise
        self._holds.add(hold)
        return hold

    def _tensor(self, hold, dtype, shape, strides, byte_offset, name):
        t = Tensor(hold, dtype, shape, strides, byte_offset, name, self)
        self._tensors.add(t)
        return t
