"""Client's single buffers: alloc, get and get_many, publish, share and open (tokens,
one or many), unpublish, and the holds they make (see _client.py for the Client itself)."""

from __future__ import annotations

import ctypes
from typing import Any, Iterable, List, Sequence

from . import _dtypes, _lib
from ._copy import _copy_into
from ._dict import _UINT8
from ._dtypes import DTypeLike
from ._errors import code, error
from ._holds import _Hold
from ._lib import check
from ._tensor import Tensor
from ._util import Device, Stream, _encode_name, stream_handle
from ._client_args import (_describe, _devices_arg, _get_flags, _meta, _timeout_ms, _version_arg,
                           _view_extent)


class _Buffers:
    """Single tensors: one buffer each, by name or by share token."""

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
        if not na:
            # Nothing to learn from the reply: the tokens are made here and the request goes
            # without waiting for it (a receiver's Open that the daemon reads first waits for it).
            check(self._lib.gpupool_buffer_share_kept_many_nowait(arr, n, s, toks), "share of %d buffers" % n)
            return bytes(memoryview(toks).cast("B")), []
        asked = (_lib.BufferP * na)(*ask) if na else None
        idle = (ctypes.c_int * na)() if na else None
        check(self._lib.gpupool_buffer_share_kept_many(arr, n, s, toks, asked, na, idle),
              "share of %d buffers" % n)
        return bytes(memoryview(toks).cast("B")), [bool(x) for x in idle] if na else []

    def _new_holds(self, out, n, s):
        """Holds for the n C buffer handles in out, all or none: when they cannot be made,
        every handle is released (by _Hold.many)."""
        holds = _Hold.many(self._conn, out[:n], s, out)
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

    def _idle_begin(self, bufs):
        """An Idle request about C buffer handles (all of this client) sent now: its pending
        handle, for _idle_end."""
        n = len(bufs)
        p = _lib.PendingP()
        check(self._lib.gpupool_buffer_idle_many_begin((_lib.BufferP * n)(*bufs), n, ctypes.byref(p)),
              "idle check of %d buffers" % n)
        return p

    def _idle_end(self, p, n):
        """The answers of an Idle request begun with _idle_begin about n buffers."""
        out = (ctypes.c_int * n)()
        check(self._lib.gpupool_buffer_idle_many_end(p, out), "idle check of %d buffers" % n)
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
