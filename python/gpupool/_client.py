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

import bisect
import collections
import ctypes
import math
import os
import threading
import weakref
from typing import Any, Dict, Iterable, List, Literal, Mapping, Sequence, Tuple

from . import _bundle, _dict, _dlpack, _dtypes, _lib
from ._copy import _copy_into
from ._dict import _UINT8, TensorDict
from ._dtypes import DTypeLike
from ._errors import code, error
from ._holds import _BundleHold, _Conn, _FileHold, _Hold
from ._lib import check
from ._tensor import Tensor
from ._util import Device, Stream, _current_stream, _encode_name, _framework, stream_handle

# Parsed member tables a client keeps by layout id.
_LAYOUTS_KEPT = 64


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


class Client:
    """A connection to gpupoold.

    socket: path of the daemon's socket (None: $GPUPOOL_SOCKET or the default path). name:
    shown in the daemon's logs. connect_timeout: seconds allowed to connect and get the
    daemon's answer (None: $GPUPOOL_CONNECT_TIMEOUT_MS or 5 s); a daemon that is stopped or
    stuck raises GpupoolError ("the daemon did not answer in N s") instead of hanging. Use as a
    context manager or call close().
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

    # --- lifetime ----------------------------------------------------------------------
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

    # --- helpers -----------------------------------------------------------------------
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

    def _tensor_dict(self, bundle, stream, name):
        """A TensorDict owning the C bundle (released here if that fails)."""
        L = self._lib
        try:
            bh = _BundleHold(self._conn, bundle, stream)
        except BaseException:
            L.gpupool_bundle_release(bundle, stream)
            raise
        parts = bh.make_parts()
        for p in parts:
            self._holds.add(p)
        # A table this client already parsed comes with the same layout id (the daemon's,
        # so only within one connection): its Layout is reused without reading the table.
        lid = L.gpupool_bundle_layout_id(bundle)
        key = (L.gpupool_client_reconnect_count(self._conn.handle), lid) if lid else None
        layout = self._layouts.get(key) if key else None
        if layout is None:
            n = L.gpupool_bundle_count(bundle)
            raw = ctypes.create_string_buffer(max(n, 1) * _bundle.MEMBER_SIZE)
            check(L.gpupool_bundle_members(bundle, 0, n, raw), "member table of %r" % (name,))
            layout = _bundle.parse_members(raw, n)
            if key:
                with self._views_lock:
                    self._layouts[key] = layout
                    while len(self._layouts) > _LAYOUTS_KEPT:
                        self._layouts.popitem(last=False)
        d = TensorDict(self, bh, parts, layout, L.gpupool_bundle_version(bundle), name)
        self._dicts.add(d)
        return d

    def pools(self) -> List[Dict[str, Any]]:
        """The daemon's pools: a list of dicts (id, name, kind, device, capacity, ...)."""
        return self.stats()["pools"]

    def _pool_list(self):
        if self._pools is None:
            self._pools = self.pools()
        return self._pools

    def _pool_for(self, dev_type, dev_id, what):
        pools = self._pool_list()
        if not pools:
            raise error("ENOENT", "the daemon has no pools")
        if dev_type == _dlpack.kDLCUDA:
            order = [p for p in pools if p["kind"] == "device" and p["device"] == dev_id]
            # memfd pools standing for GPUs (host backend, testing replicas without GPUs)
            order += [p for p in pools if p.get("simulated_device", -1) == dev_id]
            order += [p for p in pools if p["kind"] == "device"]
        else:
            order = [p for p in pools if p["kind"] == "host"]
            order += [p for p in pools if p["kind"] == "host-numa"]
        if not order:
            if what is not None:
                raise error(
                    "ENOENT",
                    "no pool for device %s; the daemon has %s (pass pool= or another device)"
                    % (what, ", ".join("%s (%s%s)" % (p["name"], p["kind"],
                                                      ":%d" % p["device"] if p["kind"] == "device"
                                                      else "") for p in pools)))
            order = pools
        return order[0]["name"]

    def _pool_for_device(self, device):
        if device is None:
            return None
        return self._pool_for(*_parse_device(device))

    # --- requests ----------------------------------------------------------------------
    def alloc(self, shape: int | Sequence[int], dtype: DTypeLike, device: Device = None,
              pool: str | None = None, timeout: float | None = 0,
              stream: Stream = None) -> Tensor:
        """A new C-contiguous tensor in gpupool memory, to produce into directly and publish
        without a copy. device: None (the daemon's first pool), 'cpu', 'cuda', 'cuda:N' or
        an int; pool: a pool name (overrides device). timeout: seconds to wait for memory
        when the pool is full (0 = fail at once with ENOSPC). stream: where the memory will
        be used first (CUDA)."""
        if isinstance(shape, int):
            shape = (shape,)
        shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise ValueError("negative dimension in shape %r" % (shape,))
        dt = _dtypes.dtype(dtype)
        pool_name = pool if pool is not None else self._pool_for_device(device)
        return self._alloc(shape, dt, pool_name, timeout, stream_handle(stream))

    def _alloc(self, shape, dt, pool_name, timeout, s):
        n = 1
        for x in shape:
            n *= x
        nbytes = max(n * dt.itemsize, 1)
        ms = _timeout_ms(timeout, forever=False)
        buf = _lib.BufferP()
        check(self._lib.gpupool_buffer_alloc(self._conn.usable(),
                                      None if pool_name is None else _encode_name(pool_name),
                                      nbytes, ms, s, ctypes.byref(buf)),
              "alloc of %d bytes for a %s tensor of shape %r" % (nbytes, dt.name, shape))
        hold = self._new_hold(buf, s)
        return self._tensor(hold, dt, shape, None, 0, None)

    def get(self, name: str, timeout: float | None = None, read_only: bool = False,
            stream: Stream = None, newer_than: int = 0, device: Device = None) -> Tensor:
        """The tensor published under `name`, as a new hold of this process.

        timeout: seconds to wait for a producer to publish it (None = forever, 0 = fail at
        once with ENOENT; ETIMEDOUT when it runs out). read_only: ask for a read-only hold.
        stream: the consumer's CUDA stream (int handle, torch or CuPy stream); it waits on
        the producer's ready event without blocking the CPU. Exporting to another stream
        later (``__dlpack__(stream=...)``) orders that stream too. newer_than: wait for a
        version of the name greater than this (0: the version published now); the
        Tensor's ``version`` says which one came. A name published as a bundle of several
        members is refused (EINVAL): use get_dict. device: the GPU the caller wants the
        tensor on (an int, 'cuda:N', a torch or CuPy device; None or 'cpu': wherever it
        lies, mapped over peer access): when the version lies on another device, the
        daemon copies it once into a pool of that device and hands over that replica
        (read-only), waiting for the copy (GPUPOOL_ON_DEVICE)."""
        nb = _encode_name(name)
        s = stream_handle(stream)
        ms = _timeout_ms(timeout, forever=True)
        newer = _version_arg(newer_than)
        buf = _lib.BufferP()
        ver = ctypes.c_uint64(0)
        check(self._lib.gpupool_buffer_get(self._conn.usable(), nb, newer, ms,
                                          _get_flags(read_only, device=device), s,
                                          ctypes.byref(buf), ctypes.byref(ver)),
              "get %r" % (name,) if not newer else "get %r newer than version %d"
              % (name, newer))
        return self._got_tensor(buf, s, name, ver.value)

    def _got_tensor(self, buf, s, name, version):
        """The Tensor of a buffer a get brought (its hold is this client's from here on)."""
        hold = self._new_hold(buf, s)
        m = _lib.TensorMeta()
        rc = self._lib.gpupool_buffer_tensor(buf, ctypes.byref(m))
        if rc == code("ENOENT"):
            # Published without a description: the raw bytes.
            t = self._tensor(hold, _UINT8, (hold.size,), None, 0, name)
        else:
            check(rc, "tensor description of %r" % (name,))
            nd = m.ndim
            shape = [m.shape[i] for i in range(nd)]
            strides = [m.strides[i] for i in range(nd)] if m.strides_present else None
            dt = _dtypes.from_dlpack_code(m.dtype_code, m.dtype_bits, m.dtype_lanes)
            t = self._tensor(hold, dt, shape, strides, m.byte_offset, name)
        t.version = version
        return t

    def _pipelined(self, names, newer_than, timeout, flags, begin, end, what):
        """Send one request per name, then collect the replies in order: N requests cost about
        one round trip. begin: the library's *_get_begin (client, name bytes, newer, timeout
        ms, flags, PendingP*); end(PendingP, i) -> result. On an error the requests still
        pending are cancelled (what their replies bring is given back), the results collected
        so far are released, and the first error is raised."""
        ms = _timeout_ms(timeout, forever=True)
        conn = self._conn.usable()
        names = list(names)
        if isinstance(newer_than, (list, tuple)):
            newers = [_version_arg(v) for v in newer_than]
            if len(newers) != len(names):
                raise ValueError("newer_than has %d versions for %d names" % (len(newers), len(names)))
        else:
            newers = [_version_arg(newer_than)] * len(names)
        encoded = [_encode_name(n) for n in names]
        pend, out = [], []
        try:
            for i, nb in enumerate(encoded):
                p = _lib.PendingP()
                check(begin(conn, nb, newers[i], ms, flags, ctypes.byref(p)), "%s %r" % (what, names[i]))
                pend.append(p)
            for i in range(len(pend)):
                p, pend[i] = pend[i], None  # an end frees the pending request, failed or not
                out.append(end(p, i))
            return out
        except BaseException:
            for p in pend:
                if p is not None:
                    self._lib.gpupool_pending_cancel(p)
            for r in out:
                r.release()
            raise

    def get_many(self, names: Iterable[str], timeout: float | None = None,
                 read_only: bool = False, stream: Stream = None,
                 newer_than: int | Sequence[int] = 0) -> List[Tensor]:
        """Several tensors in one round trip: as ``get`` for each name, but every request is
        sent before any reply is waited for. Returns the Tensors in the order of `names`.
        newer_than: one version for all names, or a list with one per name. timeout applies
        to each name (they wait together). If one fails, the others are given back and its
        error is raised."""
        s = stream_handle(stream)
        names = list(names)

        def end(p, i):
            buf = _lib.BufferP()
            ver = ctypes.c_uint64(0)
            check(self._lib.gpupool_buffer_get_end(p, s, ctypes.byref(buf), ctypes.byref(ver)), "get %r" % (names[i],))
            return self._got_tensor(buf, s, names[i], ver.value)

        return self._pipelined(names, newer_than, timeout, _get_flags(read_only),
                               self._lib.gpupool_buffer_get_begin, end, "get")

    def get_dicts(self, names: Iterable[str], newer_than: int | Sequence[int] = 0,
                  timeout: float | None = None, read_only: bool = False, stream: Stream = None,
                  keep_mapped: bool = False, reuse_views: bool = False) -> List[TensorDict]:
        """Several bundles in one round trip: as ``get_dict`` for each name (same arguments),
        every request sent before any reply is waited for. Returns the TensorDicts in the
        order of `names`; newer_than may be a list with one version per name."""
        s = stream_handle(stream)
        names = list(names)

        def end(p, i):
            b = _lib.BundleP()
            check(self._lib.gpupool_bundle_get_end(p, s, ctypes.byref(b)), "get_dict %r" % (names[i],))
            return self._got_dict(b, s, names[i], reuse_views)

        return self._pipelined(names, newer_than, timeout, _get_flags(read_only, keep_mapped),
                               self._lib.gpupool_bundle_get_begin, end, "get_dict")

    def publish(self, name: str, tensor: Any, stream: Stream = None,
                pool: str | None = None, devices: Sequence[Device] | None = None) -> int | None:
        """Publish `tensor` under `name`; consumers get it with ``Client.get(name)``.

        A Tensor from alloc() or get(), or a framework view of one (``torch.from_dlpack(t)``
        and slices of it), is published in place: no copy, its layout as is. Any other
        object with __dlpack__ (torch, CuPy, JAX, NumPy) is copied once into a new gpupool
        buffer, compacted to C-contiguous order (a strided slice arrives contiguous): on
        the host with memmove/NumPy, on a GPU with the framework's own device-to-device
        copy. stream: the stream in which the tensor's data is ready (default: the
        framework's current stream for torch and CuPy tensors); the copy runs there and
        consumers wait for it. pool: the pool a copy goes to (default: one on the tensor's
        device). Names live in the caller's tenant; to share with other users, allocate in a
        pool the daemon shares with a group and publish as "group:GROUP/NAME".

        Publishing a name that exists makes its next version (holders of the previous one
        keep reading it; its memory goes when the last lets go). Returns the version made:
        1 for a new name. devices: GPUs (at most 16) that get a replica of this version at
        once (broadcast), so that ``get(name, device=d)`` finds it local."""
        nb = _encode_name(name)
        s = stream_handle(stream)
        devs = _devices_arg(devices)
        if isinstance(tensor, Tensor):
            hold = tensor._live_hold()
            m = _meta(tensor._dtype, tensor.shape, tensor.strides, tensor.byte_offset)
            if s is not None or hold.kind == _lib.MEM_HOST:
                return self._publish(hold, nb, m, s, devs)
            return self._publish(hold, nb, m, hold.streams[-1], devs)
        desc, s = _describe(tensor, s)
        hold = self._find_hold(desc)
        if hold is not None:
            m = _meta(desc.dtype, desc.shape, desc.strides, desc.data - hold.ptr)
            return self._publish(hold, nb, m, s, devs)
        if desc.dtype.typestr is None and desc.dtype.name != "bfloat16":
            raise error("EMETA", "element type %s has no gpupool equivalent" % desc.dtype.name)
        target = pool if pool is not None else self._pool_for(desc.device[0], desc.device[1],
                                                              None)
        t = self._alloc(desc.shape, desc.dtype, target, 0, s)
        try:
            _copy_into(t, tensor, desc, s)
            m = _meta(t._dtype, t.shape, None, 0)
            return self._publish(t._hold, nb, m, s, devs)
        finally:
            t.release()

    def _publish(self, hold, nb, meta, s, devs=(None, 0)):
        self._conn.usable()
        buf = hold.buf
        if buf is None:
            raise error("EINVAL", "buffer was released")
        ver = ctypes.c_uint64(0)
        rc = self._lib.gpupool_buffer_publish_to(buf, nb, ctypes.byref(meta), s, devs[0], devs[1],
                                                 ctypes.byref(ver))
        check(rc, "publish %r" % nb.decode("utf-8", "replace"))
        return ver.value or None

    # --- bundles: many tensors in one request ------------------------------------------
    def alloc_dict(self, spec: Any, device: Device = None, pool: str | None = None,
                   timeout: float | None = 0, stream: Stream = None,
                   alignment: int = 0) -> TensorDict:
        """A new bundle to produce into: a TensorDict of writable C-contiguous Tensors, all
        allocated in one request (placed one after the other, each aligned, in as few
        buffers as the pool allows), to publish later with ``publish_dict`` without a copy.

        spec: a mapping name -> (shape, dtype) or name -> an example tensor (anything with
        ``shape`` and ``dtype``: torch, NumPy, CuPy, a gpupool Tensor), or a sequence of
        (name, (shape, dtype)), (name, example) or (name, shape, dtype). device, pool,
        timeout, stream as for ``alloc``; alignment: of every member in bytes (a power of
        two up to 2 MiB; 0 = the pool's)."""
        items = _spec_items(spec)
        if not items:
            raise error("EINVAL", "a tensor dict needs at least one member")
        pool_name = pool if pool is not None else self._pool_for_device(device)
        bnames, sizes, metas = [], [], []
        for key, shape, dt in items:
            bnames.append(_encode_name(key, "member name"))
            sizes.append(max(_dlpack.numel(shape) * dt.itemsize, 1))
            metas.append((dt, shape, None, 0))
        return self._alloc_bundle(bnames, sizes, metas, pool_name, timeout,
                                  stream_handle(stream), alignment)

    def _alloc_bundle(self, bnames, sizes, metas, pool_name, timeout, s, alignment=0):
        table, keep = _bundle.pack_specs(bnames, sizes, metas)
        b = _lib.BundleP()
        total = sum(sizes)
        check(self._lib.gpupool_bundle_alloc(
            self._conn.usable(), None if pool_name is None else _encode_name(pool_name),
            table, len(bnames), int(alignment), _timeout_ms(timeout, forever=False), s,
            ctypes.byref(b)),
            "alloc_dict of %d members, %d bytes" % (len(bnames), total))
        del keep
        return self._tensor_dict(b, s, None)

    def publish_dict(self, name: str, mapping: Mapping[str, Any] | Iterable[Tuple[str, Any]],
                     stream: Stream = None, pool: str | None = None,
                     devices: Sequence[Device] | None = None) -> int:
        """Publish a dict of tensors under `name` as one bundle, in one request: consumers
        get every member at once (``get_dict``), all of this version or none of it.

        Zero copy for a TensorDict of this client (from ``alloc_dict`` or ``get_dict``),
        and for members that are gpupool memory of this client (Tensors from ``alloc``,
        TensorDict members, framework views of them): they are published in place. Any
        other member is copied once, compacted to C-contiguous, into one new bundle (one
        allocation request), as ``publish`` copies a single tensor. mapping may also be a
        sequence of (name, tensor) pairs. stream, pool: as for ``publish``. Publishing a
        name again makes its next version; returns the version made (1 for a new name).
        devices: GPUs that get a replica of this version at once (as for ``publish``), one
        copy job along them; for a TensorDict of this client or a dict copied whole (EINVAL
        for a mix of members in place and copied)."""
        nb = _encode_name(name)
        s = stream_handle(stream)
        what = "publish_dict %r" % nb.decode("utf-8", "replace")
        devs = _devices_arg(devices)
        if isinstance(mapping, TensorDict) and mapping._client is self:
            bh = mapping._live()
            if s is None and bh.device is not None:
                s = bh.streams[-1]
            ver = ctypes.c_uint64(0)
            self._conn.usable()
            check(self._lib.gpupool_bundle_publish_to(bh.bundle, nb, s, devs[0], devs[1],
                                                      ctypes.byref(ver)), what)
            return ver.value
        items = list(mapping.items()) if hasattr(mapping, "items") else list(mapping)
        if not items:
            raise error("EINVAL", "%s: a tensor dict needs at least one member" % what)
        index = _HoldIndex(self._holds)
        # Per member: [name, hold or None, offset, size, (dtype, shape, strides, byte_offset),
        # source, desc]
        rows = []
        for key, v in items:
            bk = _encode_name(key, "member name")
            if isinstance(v, Tensor) and v._client is self and not v.released \
                    and not v.read_only and min(v.strides, default=0) >= 0:
                h = v._hold
                desc = _dlpack.Desc(v.data_ptr, v._dl_device, v._dtype, v.shape, v.strides)
            else:
                desc = _torch_desc(v) if _framework(v) == "torch" else None
                if s is None and desc is not None and desc.device[0] == _dlpack.kDLCUDA:
                    s = _current_stream(v, desc.device[1])
                if desc is None:
                    desc, s = _describe(v, s)
                h = index.find(desc)
            rows.append([bk, h, desc, v])
        if s is None:
            held = [r[1] for r in rows if r[1] is not None and r[1].kind != _lib.MEM_HOST]
            if held:
                s = held[0].streams[-1]
        copies = [r for r in rows if r[1] is None]
        tmp = None
        try:
            if copies:
                tmp = self._copy_bundle(copies, s, pool, what)
                if len(copies) == len(rows):
                    # Everything was copied, in order: the new bundle is the whole dict.
                    ver = ctypes.c_uint64(0)
                    check(self._lib.gpupool_bundle_publish_to(tmp._bhold.bundle, nb, s, devs[0],
                                                              devs[1], ctypes.byref(ver)), what)
                    return ver.value
            if devs[1]:
                raise error("EINVAL", "%s: devices= needs a TensorDict of this client or members "
                            "that are all copied; publish members in place without it and "
                            "let gets on each device make the replicas" % what)
            bnames, bufs, offs, sizes, metas = [], [], [], [], []
            copied = iter(tmp._copied if tmp is not None else ())
            # One hold per buffer: the daemon refuses a buffer listed through two holds (an
            # allocation and a get of the same memory, say); they map the same address.
            by_buffer: Dict[Any, Any] = {}
            for bk, h, desc, _ in rows:
                if h is None:
                    h, desc = next(copied)
                h = by_buffer.setdefault((h.buffer_id, h.ptr), h)
                lo, span = desc.span()
                start = desc.data + lo
                off = start - h.ptr
                if span == 0:  # no elements: a 1-byte member inside the buffer
                    off, span = min(off, h.size - 1), 1
                bnames.append(bk)
                bufs.append(ctypes.cast(h.buf, ctypes.c_void_p).value)
                offs.append(off)
                sizes.append(span)
                metas.append((desc.dtype, desc.shape, desc.strides, desc.data - start))
            table, keep = _bundle.pack_refs(bnames, bufs, offs, sizes, metas)
            ver = ctypes.c_uint64(0)
            check(self._lib.gpupool_bundle_publish_members(self._conn.usable(), nb, table,
                                                    len(bnames), s, ctypes.byref(ver)), what)
            del keep
            return ver.value
        finally:
            if tmp is not None:
                tmp.release()  # the name holds what it needs

    def _copy_bundle(self, rows, s, pool, what):
        """One new bundle holding a C-contiguous copy of each row's tensor (rows as in
        publish_dict), in one allocation request; sets ._copied to [(part, desc of the
        copy)] in row order."""
        bnames, sizes, metas = [], [], []
        for bk, _, desc, _ in rows:
            if desc.dtype.typestr is None and desc.dtype.name != "bfloat16":
                raise error("EMETA", "%s: member %r: element type %s has no gpupool equivalent"
                            % (what, bk.decode("utf-8", "replace"), desc.dtype.name))
            bnames.append(bk)
            sizes.append(max(desc.nbytes, 1))
            metas.append((desc.dtype, desc.shape, None, 0))
        first = rows[0][2].device
        target = pool if pool is not None else self._pool_for(first[0], first[1], None)
        tmp = self._alloc_bundle(bnames, sizes, metas, target, 0, s)
        try:
            copied = []
            for i, (bk, _, desc, src) in enumerate(rows):
                dst = tmp._member_tensor(i)
                _copy_into(dst, src, desc, s)
                copied.append((dst._hold, _dlpack.Desc(dst.data_ptr, dst._dl_device,
                                                       dst._dtype, dst.shape, None)))
            tmp._copied = copied
        except BaseException:
            tmp.release()
            raise
        return tmp

    def get_dict(self, name: str, newer_than: int = 0, timeout: float | None = None,
                 read_only: bool = False, stream: Stream = None, keep_mapped: bool = False,
                 reuse_views: bool = False, device: Device = None) -> TensorDict:
        """The bundle published under `name`, as a TensorDict (member name -> Tensor, in
        member order; ``version`` says which version came), in one request.

        newer_than: wait for a version greater than this (0: the version published now);
        pass the version you hold to wait for the next one. timeout: seconds to wait (None
        = forever, 0 = fail at once with ENOENT). read_only, stream: as for ``get``; the
        stream waits on one ready event for all members. A name published with
        ``publish`` comes as a dict of one member named "". Build framework views with
        ``.torch()``, ``.cupy()`` or ``.numpy()``. keep_mapped: keep the bundle's memory
        mapped in this process after it is released (GPUPOOL_KEEP_MAPPED), so that a later
        version in the same place costs no new import (about 2 ms for a 2.5 GB bundle on an
        H100): for consumers that keep asking for new versions; the memory stays out of the
        pool until this client next talks to the daemon after the daemon freed it. With
        keep_mapped and newer_than, before waiting, the client also builds the torch views
        of the memory the next version most likely lies in (the bundle viewed before the
        last one: double buffering), so that ``.torch()`` of that version only hands them
        out, each set once: tensors of that version's own, as without it.
        reuse_views: ``.torch()`` and ``.numpy()`` hand back the views they built for an
        earlier version when this one lies in the same buffers with the same layout (a
        double-buffered producer alternates between two bundles), so a warm version builds
        no view at all; the dict returned is new, its tensors are the same objects as
        before. The client keeps the views of the last 4 bundles viewed this way, and with
        them their memory, until newer ones push them out or the client is closed.
        device: as for ``get``: every member on that GPU, from replicas the daemon makes
        once per version and device."""
        nb = _encode_name(name)
        s = stream_handle(stream)
        ms = _timeout_ms(timeout, forever=True)
        newer = _version_arg(newer_than)
        if keep_mapped and newer and not reuse_views:
            # A consumer following versions: what it will view next, built while it waits.
            _dict.build_ahead(self)
        b = _lib.BundleP()
        flags = _get_flags(read_only, keep_mapped, device)
        check(self._lib.gpupool_bundle_get(self._conn.usable(), nb, newer, ms, flags, s,
                                           ctypes.byref(b)),
              "get_dict %r" % (name,) if not newer else "get_dict %r newer than version %d"
              % (name, newer))
        return self._got_dict(b, s, name, reuse_views)

    def _got_dict(self, b, s, name, reuse_views):
        """The TensorDict of a bundle a get brought; reuse_views as get_dict says."""
        d = self._tensor_dict(b, s, name)
        d._reuse = bool(reuse_views)
        return d

    def share(self, tensor: Tensor, keep: bool = True, stream: Stream = None) -> bytes:
        """A token another client opens with ``Client.open`` (a Tensor of this client).

        keep=True makes a kept share: the daemon keeps the buffer alive for the token until
        it is opened once or the daemon's share_keep_ms passes, so this client may release
        the tensor, close or exit at once (a token in a message still in flight stays
        good). keep=False gives a token that opens for as long as some hold keeps the buffer.
        stream: where the data is ready (CUDA: the openers' streams wait for it)."""
        return self._share_hold(tensor._live_hold(), keep, stream_handle(stream))

    def _share_hold(self, hold, keep, s):
        buf = hold.buf
        if buf is None:
            raise error("EINVAL", "buffer was released")
        return self._share_buf(buf, keep, s)

    def _share_buf(self, buf, keep, s):
        """A token for a C buffer handle (a hold of this client or of another in this process)."""
        self._conn.usable()
        tok = _lib.Token()
        fn = self._lib.gpupool_buffer_share_kept if keep else self._lib.gpupool_buffer_share
        check(fn(buf, s, ctypes.byref(tok)), "share of a buffer")
        return bytes(tok.bytes)

    def open(self, token: bytes, read_only: bool = False, stream: Stream = None) -> Tensor:
        """The buffer a token from ``Client.share`` names, as a new hold of this process: a
        Tensor of its raw bytes (uint8). A kept share opens once."""
        return self._open_hold_tensor(self._open_hold(token, read_only, stream_handle(stream)))

    def _open_hold(self, token, read_only, s):
        if len(token) != _lib.TOKEN_SIZE:
            raise ValueError("a share token has %d bytes, not %d" % (_lib.TOKEN_SIZE, len(token)))
        tok = _lib.Token()
        ctypes.memmove(tok.bytes, bytes(token), _lib.TOKEN_SIZE)
        buf = _lib.BufferP()
        check(self._lib.gpupool_buffer_open(self._conn.usable(), ctypes.byref(tok),
                                            _get_flags(read_only), s, ctypes.byref(buf)),
              "open of a share token")
        return self._new_hold(buf, s)

    def _share_kept_many(self, bufs, s, ask=()):
        """Kept shares of C buffer handles (all of one client), one request: the tokens,
        concatenated (TOKEN_SIZE bytes each, in order), and for the handles in `ask` (of that
        client too) whether each is idle, learned in the same round trip."""
        self._conn.usable()
        n, na = len(bufs), len(ask)
        arr = (_lib.BufferP * n)(*bufs)
        toks = (_lib.Token * n)()
        asked = (_lib.BufferP * na)(*ask) if na else None
        idle = (ctypes.c_int * na)() if na else None
        check(self._lib.gpupool_buffer_share_kept_many(arr, n, s, toks, asked, na, idle),
              "share of %d buffers" % n)
        return bytes(memoryview(toks).cast("B")), [bool(x) for x in idle] if na else []

    def _new_holds(self, out, n, s):
        """Holds for the n C buffer handles in out, all or none: when they cannot be made,
        every handle is released (by _Hold.many)."""
        holds = _Hold.many(self._conn, out[:n], s)
        self._holds.update(holds)
        return holds

    def _alloc_holds(self, pool_name, sizes, s):
        """Holds on new buffers of sizes bytes in pool_name, their Allocate requests in
        flight together (all or none; no wait for memory)."""
        n = len(sizes)
        out = (_lib.BufferP * n)()
        check(self._lib.gpupool_buffer_alloc_many(
            self._conn.usable(), None if pool_name is None else _encode_name(pool_name),
            (ctypes.c_size_t * n)(*sizes), n, s, out),
            "alloc of %d buffers (%d bytes)" % (n, sum(sizes)))
        return self._new_holds(out, n, s)

    def _open_holds(self, tokens, read_only, s):
        """Holds for concatenated tokens (as _share_kept_many makes), opened in one request
        (all of them or none); stream s waits on their ready events."""
        n, rest = divmod(len(tokens), _lib.TOKEN_SIZE)
        if rest or n == 0:
            raise ValueError("%d bytes are no whole number of share tokens" % len(tokens))
        toks = (_lib.Token * n).from_buffer_copy(tokens)
        out = (_lib.BufferP * n)()
        check(self._lib.gpupool_buffer_open_many(self._conn.usable(), toks, n,
                                                 _get_flags(read_only), s, out),
              "open of %d share tokens" % n)
        return self._new_holds(out, n, s)

    def _idle(self, bufs):
        """Per C buffer handle (all of this client): whether only its hold references it."""
        n = len(bufs)
        arr = (_lib.BufferP * n)(*bufs)
        out = (ctypes.c_int * n)()
        check(self._lib.gpupool_buffer_idle_many(arr, n, out), "idle check of %d buffers" % n)
        return [bool(x) for x in out]

    def _open_hold_tensor(self, hold, offset=0, nbytes=None):
        n = hold.size - offset if nbytes is None else nbytes
        return self._tensor(hold, _UINT8, (n,), None, offset, None)

    def _find_hold(self, desc):
        """A live hold of this client whose memory contains the whole view, if any."""
        extent = _view_extent(desc)
        if extent is None:
            return None
        start, span, cuda = extent
        for h in list(self._holds):
            if h.released or h.read_only:
                continue
            if (h.kind == _lib.MEM_DEVICE) != cuda:
                continue
            if h.ptr <= start and start + span <= h.ptr + h.size and desc.data >= h.ptr:
                return h
        return None

    def unpublish(self, name: str) -> None:
        """Remove a name. Holders keep their tensors; the memory goes when the last lets go."""
        check(self._lib.gpupool_name_unpublish(self._conn.usable(), _encode_name(name)),
              "unpublish %r" % (name,))

    # --- sharded versions and refit (docs/REFIT.md) ------------------------------------
    def publish_shard(self, name: str, shards: Mapping[str, Any], rank: int, world: int,
                      version: int, stream: Stream = None, pool: str | None = None) -> bool:
        """Publish this rank's slices as part `rank` of `world` parts of version `version`
        of `name` (greater than the published one; the same in every rank). shards: key ->
        (tensor, slices, global_shape): the tensor holds global[slices] (a tuple of slices
        with step 1, one per dimension, None or missing = the whole dimension); the global
        shape may be left out when the slices' stops say it. A tensor that lives in gpupool
        memory of this client (from ``alloc``, ``alloc_dict``, ``gpupool.torch.empty``, the
        allocator) is published in place; any other is copied once into gpupool memory. The
        version is visible to readers when its last part is in; returns
        True for the call that completed it. Stay connected until then: a rank whose
        connection closes first takes the pending version with it."""
        from . import _refit

        return _refit.publish_shard(self, name, shards, rank, world, version, stream, pool)

    def refit_plan(self, name: str, targets: Mapping[str, Any] | Sequence[Tuple[str, Any]],
                   newer_than: int = 0, timeout: float | None = None) -> Any:
        """A RefitPlan writing versions of `name` into your own tensors in place. targets:
        name -> (tensor, pieces) or (tensor, pieces, dim): pieces are global keys, or (key,
        slices) pairs (the slice of the global tensor the piece is), stacked along dim
        (default 0) in order (a fused qkv: [("q", (slice(a, b),)), ("k", ...), ("v", ...)]);
        a tensor of another float dtype is cast on the copy. The plan is computed from the
        version published now (or newer than newer_than, waiting up to timeout seconds);
        ``plan.refit()`` writes each next version."""
        from . import _refit

        return _refit.refit_plan(self, name, targets, newer_than, timeout)

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

    def stats(self) -> Dict[str, Any]:
        """Daemon counters (clients, buffers, holds, names, requests, errors, open_fds,
        pending_frees, uptime_s) and 'pools': one dict per pool."""
        d = _lib.DaemonStats()
        pools = (_lib.PoolStats * 64)()
        n = ctypes.c_int(0)
        check(self._lib.gpupool_client_stats_sized(self._conn.usable(), ctypes.byref(d),
                                            ctypes.sizeof(d), pools, ctypes.sizeof(_lib.PoolStats),
                                            64, ctypes.byref(n)), "stats")
        out = {f: getattr(d, f) for f, _ in _lib.DaemonStats._fields_}
        plist = []
        for i in range(n.value):
            p = pools[i]
            e = {f: getattr(p, f) for f, _ in _lib.PoolStats._fields_}
            e["name"] = p.name.decode(errors="replace")
            e["kind"] = _lib.MEM_KIND_NAMES.get(p.kind, str(p.kind))
            plist.append(e)
        out["pools"] = plist
        self._pools = plist
        return out

    @property
    def slab_maps(self) -> int:
        """How many slab mappings this client has made over its life: each an import of
        daemon memory (on CUDA, an IPC open). A get of memory already mapped here (kept by
        keep_mapped, or a slab another buffer of this process maps) adds none."""
        return int(self._lib.gpupool_client_slab_maps(self._conn.usable()))

    @property
    def host_fences(self) -> bool:
        """True when this connection orders GPU work with host-side fences instead of the
        daemon's inter-process events (a client of another uid than gpupoold's, or
        GPUPOOL_HOST_FENCES=1): publish and release then wait for the stream's work on the
        host, and gets come once the producer's work is done. See gpupool_client_host_fences in
        gpupool.h."""
        return bool(self._lib.gpupool_client_host_fences(self._conn.usable()))

    def trim(self) -> None:
        """Ask the daemon to give every tenant's unused slabs back to the backend.

        Operators only (root or the daemon's own uid): others get PermissionError."""
        check(self._lib.gpupool_client_trim(self._conn.usable()), "trim")

    def set_devices(self, devices: Iterable[int]) -> None:
        """CUDA devices this process touches pool memory from (cudaMemPoolSetAccess)."""
        devs = [int(d) for d in devices]
        arr = (ctypes.c_int * max(len(devs), 1))(*devs)
        check(self._lib.gpupool_client_set_devices(self._conn.usable(), arr, len(devs)),
              "set_devices %r" % (devs,))


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
