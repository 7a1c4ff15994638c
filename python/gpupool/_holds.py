"""Holds: what keeps gpupool memory mapped in this process.

Owns the C connection with its count of live holds (_Conn), one hold per buffer (_Hold), per
bundle (_BundleHold, with a _Part per buffer of it) and per file mapping (_FileHold). Each is
released exactly once: explicitly, or when the last Python reference (a Tensor, an exported
DLPack view) goes; the connection closes only when no hold is left.
"""

import ctypes
import os
import threading

from . import _cuda, _dlpack, _lib
from ._errors import error

class _Conn:
    """The C connection and a count of live holds: disconnecting unmaps every buffer, so it
    waits until no hold (and so no exported view) is left."""

    def __init__(self, handle, L, socket_path):
        self.handle = handle
        self.lib = L
        self.socket_path = socket_path
        self.lock = threading.Lock()
        self.holds = 0
        self.close_requested = False
        self.disconnected = False
        # Bound here so that releases during interpreter shutdown need no module globals.
        self.c_release = L.gpupool_buffer_release
        self.c_release_many = L.gpupool_buffer_release_many
        self.c_bundle_release = L.gpupool_bundle_release
        self.c_disconnect = L.gpupool_client_disconnect

    def add(self, n=1):
        with self.lock:
            self.usable()
            self.holds += n

    def drop(self, n=1):
        with self.lock:
            self.holds -= n
            go = self._disconnect_due()
        if go:
            self.c_disconnect(self.handle)

    def close(self):
        with self.lock:
            self.close_requested = True
            go = self._disconnect_due()
        if go:
            self.c_disconnect(self.handle)

    def _disconnect_due(self):
        """With the lock held: whether the caller is the one to disconnect now (close was
        asked, no hold is left, and nobody disconnected yet); marks it done if so."""
        go = self.close_requested and self.holds == 0 and not self.disconnected
        if go:
            self.disconnected = True
        return go

    def usable(self):
        if self.close_requested:
            raise error("ECLOSED", "this gpupool.Client was closed; create a new Client")
        return self.handle


def _note_stream(holder, stream, safe_stream, device):
    """Make `stream` safe for a holder's memory on `device` (it waits for the safe stream)
    and add it to holder.streams, so that the release is ordered after work queued there."""
    with holder.lock:
        if not any(_cuda.same_stream(stream, s) for s in holder.streams):
            holder.streams.append(stream)
    if not _cuda.same_stream(stream, safe_stream):
        _cuda.stream_wait(stream, safe_stream, device)


def _release_stream(streams, device):
    """The stream a release goes in: the last one used, made to wait for the others (one done
    event is recorded there, and it must cover them all). device None: host memory."""
    stream = streams[-1]
    if len(streams) > 1 and device is not None:
        for s in streams[:-1]:
            _cuda.stream_wait(stream, s, device)
    return stream


_Facts = ctypes.c_uint64 * 6


def _buffer_facts(obj, L, buf, f=None):
    """What a _Hold or a _Part tells of its C buffer, read once (one call): pointer, size,
    memory kind, device, id and whether it is read-only. f: a _Facts to read them through
    (one for many buffers), else a new one."""
    if f is None:
        f = _Facts()
    L.gpupool_buffer_facts(buf, f)
    _set_facts(obj, f, 0)


def _set_facts(obj, f, at):
    """obj's facts from gpupool_buffer_facts's six words at f[at:at + 6]."""
    obj.ptr, obj.size, obj.kind = f[at], f[at + 1], f[at + 2]
    obj.device = f[at + 3] - 1
    obj.buffer_id = f[at + 4]
    obj.read_only = bool(f[at + 5])


def _release(holder, handle, c_release, device, what):
    """Release handle, which the caller just took out of holder (a _Hold or a _BundleHold) under
    its lock (None: released before), in the stream _release_stream picks among holder's, and
    drop its count on the connection even when the release fails."""
    if handle is None:
        return
    try:
        rc = c_release(handle, _release_stream(holder.streams, device))
    finally:
        holder.conn.drop()
    if rc < 0:
        raise _lib.error(rc, what)


class _Group:
    """Holds let go of together: those of one received message, whose storages mostly go at
    once (a state dict freed). A hold of the group that is released (explicitly, or its last
    reference gone) leaves its C handle here, no longer usable from Python; when the last one
    goes, all are released in one request (gpupool_buffer_release_many). Those that went
    while others of the group stay are released _LINGER seconds later, together too, so that
    a message partly kept does not keep the rest. A handle is released only after its hold
    was: never earlier than a hold of its own would be."""

    __slots__ = ("conn", "lock", "live", "dead")

    def __init__(self, conn, n):
        self.conn = conn
        self.lock = threading.Lock()
        self.live = n
        self.dead = []   # (C handle, the stream its release goes in)

    def gone(self, hold, buf):
        stream = _release_stream(hold.streams, hold.cuda_device if hold.kind != _lib.MEM_HOST else None)
        with self.lock:
            self.live -= 1
            self.dead.append((buf, stream))
            last = self.live == 0
            dead = self.dead if last else None
            if last:
                self.dead = []
        if last:
            _release_together(self.conn, dead)
        else:
            _linger(self)


# Seconds a released hold of a group whose other holds live on waits to be released with
# others (see _Group).
_LINGER = 0.5
_lingering = {"lock": threading.Lock(), "groups": set(), "timer": None}


def _linger(group):
    L = _lingering
    with L["lock"]:
        L["groups"].add(group)
        if L["timer"] is None:
            t = threading.Timer(_LINGER, _flush_lingering)
            t.daemon = True
            t.start()
            L["timer"] = t


def _flush_lingering():
    L = _lingering
    with L["lock"]:
        groups = list(L["groups"])
        L["groups"].clear()
        L["timer"] = None
    by_conn = {}
    for g in groups:
        with g.lock:
            dead, g.dead = g.dead, []
        by_conn.setdefault(id(g.conn), (g.conn, []))[1].extend(dead)
    for conn, dead in by_conn.values():
        try:
            _release_together(conn, dead)
        except BaseException:
            pass  # as a hold's release from its finalizer: the connection's end drops it


def _release_together(conn, dead):
    """Release C handles of conn, one request per stream they go in, and drop their counts on
    the connection even when a release fails."""
    by_stream = {}
    for buf, stream in dead:
        by_stream.setdefault(stream, []).append(buf)
    try:
        for stream, bufs in by_stream.items():
            rc = conn.c_release_many((_lib.BufferP * len(bufs))(*bufs), len(bufs), stream)
            if rc < 0:
                raise _lib.error(rc, "release of %d buffers" % len(bufs))
    finally:
        if dead:
            conn.drop(len(dead))


def _lingering_after_fork():
    # The parent's groups (and its timer thread) are not the child's: see _torch_state's fork
    # handling, which keeps the child from releasing the parent's holds.
    _lingering["lock"] = threading.Lock()
    _lingering["groups"] = set()
    _lingering["timer"] = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_lingering_after_fork)


class _Hold:
    """One hold on a buffer (a C gpupool_buffer), released exactly once: explicitly, or when
    the last Python reference (a Tensor, an exported DLPack view) goes away."""

    group = None  # a _Group it is released with, if any

    def __init__(self, conn, buf, stream):
        f = _Facts()
        conn.lib.gpupool_buffer_facts(buf, f)
        self._fill(conn, buf, stream, f, 0)
        conn.add()

    def _fill(self, conn, buf, stream, facts, at):
        """Everything but the connection's count, the C handle (buf) set last; facts[at:at +
        6]: the buffer's facts as gpupool_buffer_facts gives them."""
        self.conn = conn
        self.lock = threading.Lock()
        _set_facts(self, facts, at)
        # The stream in which the memory is known to be safe (the C library made it wait on
        # the ready and done events there), and every stream it was exported to since.
        self.safe_stream = stream
        self.streams = [stream]
        self.cpu_synced = False
        self.buf = buf

    @classmethod
    def many(cls, conn, bufs, stream, arr=None):
        """Holds for the C buffer handles bufs (a message's, an Open of many tokens): as
        _Hold(conn, buf, stream) each, their facts read in one call (arr: the ctypes array
        of BufferP that bufs came from, if there is one) and counted on the connection at
        once. All or none: on failure every handle is released."""
        L = conn.lib
        n = len(bufs)
        holds = []
        conn.add(n)
        try:
            if arr is None:
                arr = (_lib.BufferP * n)(*bufs)
            f = (ctypes.c_uint64 * (6 * max(n, 1)))()
            L.gpupool_buffer_facts_many(arr, n, f)
            f = f[:]  # Python ints, read once
            for i, buf in enumerate(bufs):
                h = cls.__new__(cls)
                h.buf = None  # owns its handle only once complete (_fill sets it last)
                holds.append(h)
                h._fill(conn, buf, stream, f, 6 * i)
        except BaseException:
            # None of them: every handle released, then their counts dropped (the connection
            # may close once the last goes).
            for h in holds:
                h.buf = None
            for buf in bufs:
                L.gpupool_buffer_release(buf, stream)
            for _ in range(len(bufs)):
                conn.drop()
            raise
        return holds

    @property
    def released(self):
        return self.buf is None

    @property
    def dl_device(self):
        if self.kind == _lib.MEM_DEVICE:
            return (_dlpack.kDLCUDA, self.device)
        if self.kind == _lib.MEM_HOST_NUMA:
            return (_dlpack.kDLCUDAHost, 0)
        return (_dlpack.kDLCPU, 0)

    @property
    def cuda_device(self):
        return self.device if self.device >= 0 else 0

    def used_in(self, stream):
        """Make `stream` safe for this memory (wait for the safe stream) and remember it, so
        the release is ordered after the work queued there."""
        if self.kind != _lib.MEM_HOST:
            _note_stream(self, stream, self.safe_stream, self.cuda_device)

    def sync_cpu(self):
        """Block until host code may read memory a GPU producer wrote (HOST_NUMA)."""
        if self.kind != _lib.MEM_HOST_NUMA or self.cpu_synced:
            return
        if _cuda.available():
            _cuda.stream_sync(self.safe_stream, self.cuda_device)
        self.cpu_synced = True

    def release(self):
        with self.lock:
            buf, self.buf = self.buf, None
        if buf is not None and self.group is not None:
            self.group.gone(self, buf)
            return
        _release(self, buf, self.conn.c_release, self.cuda_device if self.kind != _lib.MEM_HOST else None,
                 "release of buffer %d" % self.buffer_id)

    def __del__(self):
        try:
            self.release()
        except BaseException:
            pass


class _BundleHold:
    """The holds of one bundle (a C gpupool_bundle: its buffers and member table), released
    exactly once, with gpupool_bundle_release, when the last Python reference goes: the
    TensorDict, and every member Tensor or exported view, through the _Part of its buffer.
    Stream bookkeeping as _Hold's, for the bundle as a whole (one release stream).

    The parts refer to this object and not the other way round: a reference cycle would
    leave the release to the cyclic garbage collector, at some later time."""

    def __init__(self, conn, bundle, stream):
        self.conn = conn
        self.lock = threading.Lock()
        self.safe_stream = stream
        self.streams = [stream]
        self.synced = set()
        self.device = None  # CUDA device of the first buffer in device memory
        self.bundle = bundle
        conn.add()

    def make_parts(self):
        """The _Part of each buffer (the caller keeps them)."""
        L = self.conn.lib
        b = self.bundle
        parts = [_Part(self, i, L.gpupool_bundle_buffer(b, i), L)
                 for i in range(L.gpupool_bundle_buffers(b))]
        dev = next((p for p in parts if p.kind != _lib.MEM_HOST), None)
        if dev is not None:
            self.device = dev.cuda_device
        return parts

    @property
    def released(self):
        return self.bundle is None

    def used_in(self, stream, part):
        if part.kind != _lib.MEM_HOST:
            _note_stream(self, stream, self.safe_stream, part.cuda_device)

    def sync_cpu(self, part):
        if part.kind != _lib.MEM_HOST_NUMA or part.cuda_device in self.synced:
            return
        if _cuda.available():
            _cuda.stream_sync(self.safe_stream, part.cuda_device)
        self.synced.add(part.cuda_device)

    def release(self):
        with self.lock:
            b, self.bundle = self.bundle, None
        _release(self, b, self.conn.c_bundle_release, self.device, "release of a bundle")

    def __del__(self):
        try:
            self.release()
        except BaseException:
            pass


class _FileHold:
    """One mapping of a published file (a C gpupool_file), released exactly once when the
    last Python reference (a Tensor, an exported view) goes. It stands where a _Hold stands
    for a Tensor: read-only, no events (a file is complete when published), and it does not
    depend on the connection."""

    kind = _lib.MEM_HOST
    read_only = True

    def __init__(self, L, f, dl_device):
        self.lock = threading.Lock()
        self.f = f
        self.c_release = L.gpupool_file_release
        self.host_ptr = L.gpupool_file_ptr(f) or 0
        self.device_ptr = L.gpupool_file_device_ptr(f) or 0
        self.size = L.gpupool_file_size(f)
        self.dl_device = dl_device
        self.ptr = self.device_ptr if dl_device[0] == _dlpack.kDLCUDA else self.host_ptr
        self.buffer_id = 0
        self.device = dl_device[1] if dl_device[0] == _dlpack.kDLCUDA else -1

    @property
    def released(self):
        return self.f is None

    @property
    def cuda_device(self):
        return self.device if self.device >= 0 else 0

    def used_in(self, stream):
        """Nothing to order: the file's bytes were there before anyone could get it."""

    def sync_cpu(self):
        """Nothing to wait for (no GPU writes into a read-only file)."""

    def release(self):
        with self.lock:
            f, self.f = self.f, None
        if f is not None:
            self.c_release(f)

    def __del__(self):
        try:
            self.release()
        except BaseException:
            pass


class _Part:
    """One buffer of a bundle, with the face of a _Hold (what Tensor, DLPack exports and
    Client._find_hold use). It keeps the whole bundle alive: a member view's export holds
    its _Part, and so the bundle, until the framework frees it."""

    __slots__ = ("owner", "index", "_buf", "ptr", "size", "kind", "device", "buffer_id",
                 "read_only", "__weakref__")

    def __init__(self, owner, index, buf, L):
        self.owner = owner
        self.index = index
        self._buf = buf
        _buffer_facts(self, L, buf)

    @property
    def buf(self):
        return None if self.owner.bundle is None else self._buf

    @property
    def released(self):
        return self.owner.bundle is None

    @property
    def streams(self):
        return self.owner.streams

    @property
    def conn(self):
        return self.owner.conn

    dl_device = _Hold.dl_device
    cuda_device = _Hold.cuda_device

    def used_in(self, stream):
        self.owner.used_in(stream, self)

    def sync_cpu(self):
        self.owner.sync_cpu(self)
