"""Client's bundles: TensorDicts allocated, published and got in one request each
(alloc_dict, publish_dict, get_dict, get_dicts), and the member tables they share."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Tuple

from . import _bundle, _dict, _dlpack, _lib
from ._copy import _copy_into
from ._dict import TensorDict
from ._errors import error
from ._holds import _BundleHold
from ._lib import check
from ._tensor import Tensor
from ._util import Device, Stream, _current_stream, _encode_name, _framework, stream_handle
from ._client_args import (_HoldIndex, _describe, _devices_arg, _get_flags, _spec_items,
                           _timeout_ms, _torch_desc, _version_arg)

# Parsed member tables a client keeps by layout id.
_LAYOUTS_KEPT = 64


class _Dicts:
    """Bundles: many tensors under one name, in one request."""

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
