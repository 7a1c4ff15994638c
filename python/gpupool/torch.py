"""PyTorch code as it is, on gpupool: torch.multiprocessing, Pool and DataLoader results travel
as gpupool holds instead of CUDA IPC handles or shared-memory files.

    import gpupool.torch
    gpupool.torch.install()            # once, in the process that sends tensors

After ``install()`` every tensor torch pickles across processes (``mp.Queue``, ``SimpleQueue``,
``Pipe``, ``Pool`` arguments and results, ``Process(args=...)`` under spawn and forkserver) is
sent as a kept share of a gpupool buffer: a storage that is a gpupool buffer (from
``gpupool.torch.empty``/``zeros``/``empty_like``, from ``use_allocator()``, or received from
another process) is shared without a copy and stays one storage in both processes; any other
storage is copied once into gpupool memory on the sender's current stream, so the sender may
free it, reuse it or exit at once. The receiver holds the buffer for exactly as long as its
storage lives (the hold goes with the storage's deleter), needs no ``ipc_collect``, and gets
storages that alias as the sender's did. Nothing of it needs ptrace, pidfd_getfd or a shared
PID namespace: only the daemon's socket.

A message is one request each way, whatever its number of tensors: the sender shares every
storage of it in one Share request, the receiver opens them in one Open request (install()
wraps ForkingPickler's dump for that). The buffers copies go into are kept and written again
for later messages once the daemon says nobody holds them any more; ``trim()`` gives them back.

Importing this module imports torch; ``import gpupool`` does not import it.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import pickle
import threading
import time
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional, Sequence

import torch
from torch.multiprocessing import reductions as _torch_reductions

from . import _dlpack, _lib
from ._client import Client
from ._dict import _UINT8
from ._errors import GpupoolError, error

__all__ = ["install", "uninstall", "installed", "empty", "zeros", "empty_like", "use_allocator",
           "allocator_counts", "allocator_last_error", "trim", "GpupoolError"]

log = logging.getLogger("gpupool.torch")


class _Options:
    __slots__ = ("copy", "cpu", "pool", "fallback", "socket")

    def __init__(self, copy=True, cpu=False, pool=None, fallback=False, socket=None):
        self.copy = bool(copy)
        self.cpu = bool(cpu)
        self.pool = pool
        self.fallback = bool(fallback)
        self.socket = None if socket is None else str(socket)

    def spec(self):
        return (self.copy, self.cpu, self.pool, self.fallback, self.socket)


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.opts: Optional[_Options] = None
        self.client: Optional[Client] = None   # the process-wide client, of pid `pid`
        self.pid = os.getpid()
        self.user_client = False                 # install(client=...) gave it
        self.client_socket = None                # the socket our own client connected to
        self.stale: list = []                    # clients inherited through fork: never used
        self.saved: dict = {}                    # ForkingPickler reducers install() replaced
        self.fallback_said = False
        # storage data pointer -> (weakref to the hold, offset of the storage in the buffer)
        self.owned: dict = {}
        self.owned_prune = 1024
        # (buffer id, offset, bytes) -> torch's weak storage reference, so that every storage
        # received for the same memory is one storage here too
        self.received: dict = {}
        self.received_prune = 1024
        self.alloc_lib = None                    # libgpupool-torch-alloc once use_allocator() ran
        # Copy buffers kept for the next messages: (pool, bytes) -> [_Entry], their bytes, and
        # the number of messages sent (an entry unused for _CACHE_AGE messages goes).
        self.cache: dict = {}
        self.cache_bytes = 0
        self.cache_max = _CACHE_MAX
        self.msgno = 0
        self.pickler = None                      # ForkingPickler's own (__init__, dump)


# Holds one Share or Open request names (gpupoold's max_share_batch, by default).
_BATCH_MAX = 1024
# Copy buffers are kept for reuse up to this many bytes in all, and for this many messages.
_CACHE_MAX = 8 << 30
_CACHE_AGE = 8
# Up to this size a copy buffer is kept in two sets (one written while the other may still be
# held), so a steady stream of messages needs no round trip to ask before copying.
_SMALL = 16 << 20

# torch element types by their DLPack (code, bits): kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4.
_DL_TYPES = {torch.float32: (2, 32), torch.float64: (2, 64), torch.float16: (2, 16),
             torch.bfloat16: (4, 16), torch.int8: (0, 8), torch.int16: (0, 16), torch.int32: (0, 32),
             torch.int64: (0, 64), torch.uint8: (1, 8)}

if hasattr(torch._C, "_from_dlpack"):
    _from_dlpack = torch._C._from_dlpack
else:
    from torch.utils.dlpack import from_dlpack as _from_dlpack

# GPUPOOL_TORCH_PROFILE=1: the time of each step of sending and receiving a message is
# recorded (bench/torch_queue.py --profile prints their medians); off, it costs a test each.
_PROFILE = os.environ.get("GPUPOOL_TORCH_PROFILE") == "1"
_steps: dict = {}


def _step(name, t0):
    """Record a step that began at t0 (perf_counter_ns); returns now, the next step's start."""
    t = time.perf_counter_ns()
    _steps.setdefault(name, []).append(t - t0)
    return t


def _profile():
    """The recorded steps: name -> list of nanoseconds (empty unless GPUPOOL_TORCH_PROFILE=1)."""
    return {k: list(v) for k, v in _steps.items()}


_S = _State()
_tls = threading.local()   # .batch: the message being pickled; .received: its storages


# --- the process-wide client ---------------------------------------------------------------
def _client() -> Client:
    """This process's client: install()'s, or one connected on first use (a spawned child
    unpickling its arguments). A client inherited through fork is never used: the child
    connects its own."""
    c = _S.client
    if c is not None and _S.pid == os.getpid():
        return c
    with _S.lock:
        if _S.pid != os.getpid():
            _forget_parent()
        if _S.client is None:
            sock = _S.opts.socket if _S.opts is not None else None
            _S.client = Client(sock, name="torch pid %d" % os.getpid())
            _S.client_socket = sock
            _S.user_client = False
        return _S.client


def _neutralize(c):
    """A client inherited through fork: its connection is the parent's. Releasing or closing
    it from the child would act on the parent's holds, so the child never does."""
    conn = getattr(c, "_conn", None)
    if conn is None:
        return
    conn.c_release = lambda *a: 0
    conn.c_bundle_release = lambda *a: 0
    conn.c_disconnect = lambda *a: None
    conn.close_requested = True


def _forget_parent():
    if _S.client is not None:
        _neutralize(_S.client)
        _S.stale.append(_S.client)
    _S.client = None
    _S.user_client = False
    _S.owned = {}
    _S.received = {}
    _S.cache = {}          # the parent's holds: never released nor reused here
    _S.cache_bytes = 0
    _S.pid = os.getpid()


def _after_fork_in_child():
    # Another thread of the parent may have held the lock at the fork: the child's copy
    # would stay held forever.
    _S.lock = threading.RLock()
    if _S.pid != os.getpid():
        _forget_parent()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _stream_of(device):
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream


# --- sending -------------------------------------------------------------------------------
def _remember(storage_ptr, hold, offset):
    with _S.lock:  # feeder threads of several queues share it
        _remember_locked(storage_ptr, hold, offset)


def _remember_locked(storage_ptr, hold, offset):
    """Share the storage at storage_ptr from here on by hold (at offset in its buffer). With
    _S.lock held."""
    owned = _S.owned
    old = owned.get(storage_ptr)
    h = old[0]() if old is not None else None
    if h is not None and not h.released and h is not hold:
        # Memory this process holds already (its own buffer, received back in the same
        # process): that hold stays the one it is shared by, since it lives longer.
        return
    owned[storage_ptr] = (weakref.ref(hold), offset)
    if len(owned) > _S.owned_prune:
        for k in [k for k, (r, _) in owned.items() if r() is None or r().released]:
            del owned[k]
        _S.owned_prune = max(1024, 2 * len(owned))


def _find(storage, c):
    """How storage is gpupool memory shared as it is: (C buffer handle, offset of the storage
    in it), or None."""
    ptr = storage.data_ptr()
    n = storage.nbytes()
    got = _S.owned.get(ptr)
    if got is not None:
        h = got[0]()
        if h is not None and not h.released and h.conn is c._conn and got[1] + n <= h.size:
            return h.buf, got[1]
    if _S.alloc_lib is not None and storage.device.type == "cuda":
        buf = _lib.BufferP()
        if _S.alloc_lib.gpupool_torch_alloc_find(ctypes.c_void_p(ptr), ctypes.byref(buf)):
            return buf, 0
    if _S.user_client:
        # A user's client: its own allocations viewed through torch.from_dlpack.
        dev = (_dlpack.kDLCUDA, storage.device.index or 0) if storage.device.type == "cuda" \
            else (_dlpack.kDLCPU, 0)
        h = c._find_hold(_dlpack.Desc(ptr, dev, _UINT8, (n,), (1,)))
        if h is not None:
            return h.buf, ptr - h.ptr
    return None


def _share(storage):
    """(token, offset, bytes) of a kept share of storage's memory, copying it first into a new
    gpupool buffer when it is not gpupool memory (and copy=True)."""
    opts = _S.opts
    c = _client()
    dev = storage.device
    n = storage.nbytes()
    s = _stream_of(dev)
    found = _find(storage, c)
    if found is not None:
        buf, off = found
        return c._share_buf(buf, True, s), off, n
    if not opts.copy:
        raise error("EINVAL", "a %s storage of %d bytes is not gpupool memory and install(copy=False) "
                    "refuses to copy it: allocate it with gpupool.torch.empty/zeros/empty_like or "
                    "under gpupool.torch.use_allocator(), or install(copy=True)" % (dev, n))
    if dev.type == "cuda":
        pool = opts.pool if opts.pool is not None else c._pool_for(_dlpack.kDLCUDA, dev.index or 0, str(dev))
    else:
        pool = opts.pool if opts.pool is not None else c._pool_for(_dlpack.kDLCPU, 0, "cpu")
    t = c._alloc((n,), _UINT8, pool, 0, s)
    try:
        if dev.type == "cuda":
            dst = torch.from_dlpack(t)
            if dst.device != dev:
                raise error("EINVAL", "pool %r is on %s, not on %s where the storage is: pass "
                            "install(pool=...) naming a pool of each device, or none" % (pool, dst.device, dev))
            src = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage, 0, (n,), (1,))
            dst.copy_(src)  # on the current stream: the share records the ready event there
            del dst, src
        else:
            ctypes.memmove(t.data_ptr, storage.data_ptr(), n)
        return c._share_hold(t._hold, True, s), 0, n
    finally:
        t.release()  # the kept share holds the copy from here on


def _say_fallback(why):
    if not _S.fallback_said:
        _S.fallback_said = True
        log.warning("gpupool.torch: %s; tensors travel by torch's own sharing from now on "
                    "(install(fallback=True))", why)


def _usable():
    """Whether gpupool serves this send: True, or False after saying why when fallback is on;
    raises when the daemon is unreachable and fallback is off."""
    try:
        _client()
        return True
    except GpupoolError as e:
        if _S.opts.fallback:
            _say_fallback("gpupoold is unreachable (%s)" % e)
            return False
        raise error("ECONNECT", "gpupool.torch cannot send a tensor: %s. Start gpupoold (or point "
                    "GPUPOOL_SOCKET at it), or install(fallback=True) to fall back to torch's "
                    "own sharing" % e) from e


def _handled(device):
    return device.type == "cuda" or (device.type == "cpu" and _S.opts.cpu)


def _reduce_tensor(t):
    opts = _S.opts
    if opts is None or t.is_nested or t.layout != torch.strided:
        return _S.saved[torch.Tensor](t)
    dev = t.device
    if not (dev.type == "cuda" or (dev.type == "cpu" and opts.cpu)):
        return _S.saved[torch.Tensor](t)
    batch = getattr(_tls, "batch", None)
    usable = batch.usable if batch is not None else None
    if usable is None:
        usable = _usable()
        if batch is not None:
            batch.usable = usable  # asked once per message
    if not usable:
        return _S.saved[torch.Tensor](t)
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd "
            "does not support crossing process boundaries. If you just want to transfer the "
            "data, call detach() on the tensor before serializing (e.g., putting it on the queue).")
    st = t.untyped_storage()
    if batch is not None and st.nbytes():
        # In a message (ForkingPickler.dump): the storage goes as its place among the
        # message's storages (a storage two tensors share has one place), shared with them
        # once the whole message is known.
        return (_rebuild_batched, (type(t), batch.add(st, dev, t), t.dtype, t.storage_offset(),
                                   tuple(t.size()), tuple(t.stride()), t.requires_grad))
    # The storage goes as an object of its own: the pickler's memo sends a storage that two
    # tensors of one message share once, and _reduce_storage turns it into a kept share.
    return (_rebuild_tensor, (type(t), st, t.dtype, t.storage_offset(), tuple(t.size()),
                              tuple(t.stride()), t.requires_grad))


def _reduce_storage(storage):
    opts = _S.opts
    saved = _S.saved.get(torch.UntypedStorage)
    # A CPU storage that is a gpupool buffer goes as one even with cpu=False: torch's own
    # sharing would move it into a shared-memory file of its own, away from gpupool.
    mine = storage.device.type == "cpu" and storage.data_ptr() in _S.owned
    if opts is None or not (_handled(storage.device) or mine) or not _usable():
        return saved(storage)
    if storage.nbytes() == 0:
        return (_rebuild_empty, (str(storage.device),))
    batch = getattr(_tls, "batch", None)
    if batch is not None:
        # A message being pickled (ForkingPickler.dump): its storages are shared together once
        # the whole message is known, and this one goes as its place among them.
        return (_batched_storage, (batch.add(storage, storage.device),))
    tok, off, n = _share(storage)
    return (_rebuild_storage, (tok, off, n, opts.spec()))


# --- one request per message ----------------------------------------------------------------
# install() wraps ForkingPickler's dump, through which every multiprocessing channel pickles
# (Queue, SimpleQueue, Connection.send, Pool, spawn): the message is pickled first with its
# storages only numbered, then every storage is shared in ONE Share request (copies into reused
# buffers made first), and what goes on the channel is a small wrapper: the tokens, each
# storage's place, and the message's pickle. The receiver opens every token in ONE Open
# request before it unpickles the message, whose storages then take theirs.
class _Batch:
    __slots__ = ("storages", "sizes", "devs", "views", "index", "usable")

    def __init__(self):
        self.storages = []
        self.sizes = []
        self.devs = []     # CUDA device index, -1 for host memory
        self.views = []    # the one tensor of the message on each storage (None: none or several)
        self.index = {}
        self.usable = None  # whether gpupool serves this message (asked at its first tensor)

    def add(self, storage, device, tensor=None):
        n = storage.nbytes()
        key = (device.type, device.index, storage.data_ptr(), n)
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.storages)
            self.storages.append(storage)
            self.sizes.append(n)
            self.devs.append(device.index if device.type == "cuda" else -1)
            self.views.append(tensor)
        else:
            self.views[i] = None
        return i

    def whole(self):
        """Per storage, (DLPack element type, shape, strides) of the message's one tensor on
        it when that tensor covers it whole (offset 0, dense) in a type DLPack names, else
        None: the receiver makes such a tensor straight from the memory, without a storage
        and a tensor set on it (half of torch's work per tensor on a GPU)."""
        out = [None] * len(self.views)
        for i, t in enumerate(self.views):
            if t is None:
                continue
            code = _DL_TYPES.get(t.dtype)
            if code is not None and t.storage_offset() == 0 and t.is_contiguous() \
                    and t.numel() * t.element_size() == self.sizes[i]:
                out[i] = (code, tuple(t.size()), tuple(t.stride()))
        return out


class _Entry:
    """A copy buffer of this process, kept to carry the next messages' copies."""
    __slots__ = ("hold", "dst", "n", "key", "used", "busy", "idle")

    def __init__(self, hold, dst, n, key):
        self.hold = hold
        self.dst = dst      # the torch view of a CUDA buffer (None for host memory)
        self.n = n
        self.key = key
        self.used = 0
        self.busy = True    # in a message being sent
        # The daemon said no one else holds it, since it was last shared: it stays so until
        # this process shares it again (nobody else can open it once its kept shares are
        # opened or expired).
        self.idle = False


_ORIG_PICKLER = (ForkingPickler.__init__, ForkingPickler.dump)


def _pickler_init(self, *args, **kw):
    _ORIG_PICKLER[0](self, *args, **kw)
    self._gp_file = args[0] if args else kw.get("file")
    self._gp_protocol = args[1] if len(args) > 1 else kw.get("protocol")


def _pickler_dump(self, obj):
    dump = _ORIG_PICKLER[1]
    f = getattr(self, "_gp_file", None)
    if _S.opts is None or getattr(_tls, "batch", None) is not None or f is None:
        return dump(self, obj)
    t0 = time.perf_counter_ns() if _PROFILE else 0
    batch = _tls.batch = _Batch()
    try:
        buf = io.BytesIO()
        dump(type(self)(buf, self._gp_protocol), obj)
    finally:
        _tls.batch = None
    if not batch.storages:
        f.write(buf.getbuffer())  # nothing of gpupool's in it: the message as it is
        return None
    if t0:
        t0 = _step("send: pickle", t0)
    msg = _send_batch(batch, buf.getvalue())
    if t0:
        t0 = _step("send: copies and share", t0)
    dump(self, msg)
    if t0:
        _step("send: wrap", t0)


class _Message:
    """What goes on the channel for a message with storages: unpickled, it opens them."""
    __slots__ = ("args",)

    def __init__(self, args):
        self.args = args

    def __reduce__(self):
        return (_open_message, self.args)


def _send_batch(batch, payload):
    opts = _S.opts
    c = _client()
    storages, sizes, devs = batch.storages, batch.sizes, batch.devs
    n = len(storages)
    bufs = [None] * n
    offs = [0] * n
    copies = []
    for i, st in enumerate(storages):
        found = _find(st, c)
        if found is not None:
            bufs[i], offs[i] = found
        elif not opts.copy:
            raise error("EINVAL", "a %s storage of %d bytes is not gpupool memory and install(copy=False) "
                        "refuses to copy it: allocate it with gpupool.torch.empty/zeros/empty_like or "
                        "under gpupool.torch.use_allocator(), or install(copy=True)" % (st.device, sizes[i]))
        else:
            copies.append(i)
    t0 = time.perf_counter_ns() if _PROFILE else 0
    entries = _copy_targets(c, [storages[i] for i in copies]) if copies else []
    if t0:
        t0 = _step("send: find and pick buffers", t0)
    try:
        for i, e in zip(copies, entries):
            st = storages[i]
            bufs[i] = e.hold.buf
            if e.dst is not None:
                src = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (sizes[i],), (1,))
                e.dst[:sizes[i]].copy_(src)  # on the current stream: the share records the ready event there
            else:
                ctypes.memmove(e.hold.ptr, st.data_ptr(), sizes[i])
        # The copies and whatever else the stream holds are waited for here, once, by the
        # thread that pickles (a Queue's feeder thread): an idle stream records no ready
        # events, so the receiver waits on none (an inter-process event wait costs ~0.1 ms
        # per buffer even once complete; a state dict has hundreds).
        for d in {x for x in devs if x >= 0}:
            st = torch.cuda.current_stream(d)
            if not st.query():
                st.synchronize()
        if t0:
            t0 = _step("send: copies done", t0)
        # One request per device (the ready events are recorded in its current stream), and
        # per _BATCH_MAX storages. The first also asks which kept copy buffers nobody holds
        # any more, so that the next message writes them without asking.
        # A request names buffers of one client: use_allocator()'s storages are buffers of
        # the allocator's own client.
        tokens = [None] * n
        ask = _ask_idle(entries)
        mine = ctypes.cast(c._conn.handle, ctypes.c_void_p).value
        if _S.alloc_lib is None:
            owner = [mine] * n
        else:
            who = c._lib.gpupool_buffer_client
            owner = [ctypes.cast(who(b), ctypes.c_void_p).value for b in bufs]
        for d, o in sorted(set(zip(devs, owner))):
            idx = [i for i in range(n) if devs[i] == d and owner[i] == o]
            s = torch.cuda.current_stream(d).cuda_stream if d >= 0 else None
            for k in range(0, len(idx), _BATCH_MAX):
                part = idx[k:k + _BATCH_MAX]
                # Each asked buffer by the hold _ask_idle took with it: another thread's
                # _copies_done may drop the entry's own reference meanwhile.
                asked = [a for a in ask if a[2].buf is not None] if o == mine else []
                blob, idle = c._share_kept_many([bufs[i] for i in part], s,
                                                [h.buf for _, _, h in asked])
                if o == mine:
                    ask = []
                with _S.lock:
                    for (e, used, _), ok in zip(asked, idle):
                        if not e.busy and e.used == used:  # not sent meanwhile by another thread
                            e.idle = ok
                for j, i in enumerate(part):
                    tokens[i] = blob[j * _lib.TOKEN_SIZE:(j + 1) * _lib.TOKEN_SIZE]
        if t0:
            t0 = _step("send: share request", t0)
    finally:
        _copies_done(entries)
    return _Message((opts.spec(), b"".join(tokens), offs, sizes, devs, payload, batch.whole()))


def _ask_idle(entries):
    """The kept copy buffers this message does not use whose idleness is not known (at most
    _BATCH_MAX), to ask about in the message's Share: (entry, its use count, its hold), the
    hold kept referenced here so that its C buffer stays alive until the request is sent even
    if another thread's _copies_done lets the entry go."""
    mine = {id(e) for e in entries}
    with _S.lock:
        return [(e, e.used, e.hold) for lst in _S.cache.values() for e in lst
                if not e.idle and not e.busy and id(e) not in mine and e.hold is not None][:_BATCH_MAX]


def _copy_targets(c, storages):
    """A copy buffer per storage: one kept from earlier messages that the daemon said nobody
    else holds any more (in an earlier Share's reply, or else one Idle request for all), else
    a new one."""
    opts = _S.opts
    keys = []
    pools = {}   # (device type, index) -> pool: looked up once per device, not per storage
    for st in storages:
        dev = st.device
        where = (dev.type, dev.index)
        pool = pools.get(where)
        if pool is None:
            if opts.pool is not None:
                pool = opts.pool
            elif dev.type == "cuda":
                pool = c._pool_for(_dlpack.kDLCUDA, dev.index or 0, str(dev))
            else:
                pool = c._pool_for(_dlpack.kDLCPU, 0, "cpu")
            pools[where] = pool
        keys.append((pool, st.nbytes(), dev.type, dev.index))
    wanted = {}  # key -> the places of this message's storages of that key
    for i, k in enumerate(keys):
        wanted.setdefault(k, []).append(i)
    picked = [None] * len(storages)
    with _S.lock:
        _S.msgno += 1
        # One pass over each key's kept buffers (a state dict has many storages of one size):
        # those known idle first, then those whose state is not known yet, asked about below.
        # A small buffer of unknown state is left alone (a new one taken instead: no round
        # trip before the copy) while the key has fewer than two per storage of this message;
        # the Share asks about the old ones, so the next message finds them known.
        for k, idx in wanted.items():
            lst = _S.cache.get(k, ())
            free = [e for e in lst if not e.busy and e.idle]
            if not (k[1] <= _SMALL and len(lst) < 2 * len(idx)):
                free += [e for e in lst if not e.busy and not e.idle]
            for i, e in zip(idx, free):
                e.busy = True
                picked[i] = e
    cands = [i for i, e in enumerate(picked) if e is not None and not e.idle]
    if cands:
        try:
            idle = c._idle([picked[i].hold.buf for i in cands])
        except BaseException:
            _copies_done([picked[i] for i in cands])
            raise
        for i, ok in zip(cands, idle):
            if not ok:
                # Someone still holds it (a receiver, a kept share not yet opened): never write it.
                picked[i].busy = False
                picked[i] = None
    try:
        # The new buffers of each pool in one round trip (their Allocate requests together).
        groups = {}
        for i, e in enumerate(picked):
            if e is None:
                groups.setdefault(keys[i][0], []).append(i)
        for pool, idx in groups.items():
            dev = storages[idx[0]].device
            holds = c._alloc_holds(pool, [storages[i].nbytes() for i in idx], _stream_of(dev))
            for i, h in zip(idx, holds):
                picked[i] = _new_entry(h, storages[i], keys[i])
    except BaseException:
        _copies_done([e for e in picked if e is not None])
        raise
    return picked


def _new_entry(hold, storage, key):
    dev = storage.device
    n = storage.nbytes()
    dst = None
    if dev.type == "cuda":
        # A view that keeps the hold (the entry drops both together).
        dst = _from_dlpack(_dlpack.bytes_capsule(hold.ptr, hold.dl_device, n, hold))
        if dst.device != dev:
            raise error("EINVAL", "pool %r is on %s, not on %s where the storage is: pass "
                        "install(pool=...) naming a pool of each device, or none" % (key[0], dst.device, dev))
    e = _Entry(hold, dst, n, key)
    with _S.lock:
        if _S.cache_bytes + n <= _S.cache_max:
            _S.cache.setdefault(key, []).append(e)
            _S.cache_bytes += n
        else:
            e.key = None  # not kept: released once this message's share holds it
    return e


def _copies_done(entries):
    """The message's copies are shared (or failed): their buffers may carry later messages;
    those unused for _CACHE_AGE messages go."""
    drop = []
    with _S.lock:
        for e in entries:
            e.busy = False
            e.idle = False  # shared again (or its state unknown after a failure)
            e.used = _S.msgno
        for key, lst in list(_S.cache.items()):
            keep = [e for e in lst if e.busy or _S.msgno - e.used <= _CACHE_AGE]
            if len(keep) != len(lst):
                drop += [e for e in lst if not (e.busy or _S.msgno - e.used <= _CACHE_AGE)]
                if keep:
                    _S.cache[key] = keep
                else:
                    del _S.cache[key]
        for e in drop:
            _S.cache_bytes -= e.n
    drop += [e for e in entries if e.key is None]
    for e in drop:
        e.dst = None
        e.hold = None   # released with the last reference


def trim() -> int:
    """Give back the copy buffers this process keeps to carry the next messages' copies (the
    receivers' holds are theirs and stay). Returns how many were kept."""
    with _S.lock:
        if _S.pid != os.getpid():
            return 0
        lst = [e for v in _S.cache.values() for e in v if not e.busy]
        for e in lst:
            _S.cache[e.key].remove(e)
            if not _S.cache[e.key]:
                del _S.cache[e.key]
            _S.cache_bytes -= e.n
    for e in lst:
        e.dst = None
        e.hold = None
    return len(lst)


def _open_message(spec, tokens, offs, sizes, devs, payload, whole=None):
    if _S.opts is None:
        # A child unpickling its first gpupool tensor: it sends as its parent does.
        install(copy=spec[0], cpu=spec[1], pool=spec[2], fallback=spec[3], socket=spec[4])
    c = _client()
    n = len(offs)
    cuda = {d for d in devs if d >= 0}
    # The receiver's current stream waits on the ready events; with one device, the C library
    # makes it wait as it opens (no stream bookkeeping per storage).
    s = torch.cuda.current_stream(next(iter(cuda))).cuda_stream if len(cuda) == 1 else None
    holds = []
    T = _lib.TOKEN_SIZE
    t0 = time.perf_counter_ns() if _PROFILE else 0
    try:
        for k in range(0, n, _BATCH_MAX):
            holds += c._open_holds(tokens[k * T:(k + _BATCH_MAX) * T], False, s)
        if t0:
            t0 = _step("receive: open", t0)
        if s is None:
            for h in holds:
                if h.kind == _lib.MEM_DEVICE:
                    h.used_in(torch.cuda.current_stream(h.cuda_device).cuda_stream)
        # Takes the holds out of the list; `made` has the tensors made whole from memory.
        storages, made = _storages_of(holds, offs, sizes, whole)
    finally:
        for h in holds:
            if h is not None:
                h.release()  # a storage that could not be made: its hold goes
    if t0:
        t0 = _step("receive: storages", t0)
    prev = getattr(_tls, "received", None), getattr(_tls, "made", None)
    _tls.received, _tls.made = storages, made
    try:
        return pickle.loads(payload)
    finally:
        _tls.received, _tls.made = prev  # storages the message did not use go with these
        if t0:
            _step("receive: unpickle", t0)


def _batched_storage(i):
    got = getattr(_tls, "received", None)
    if got is None:
        raise RuntimeError("a gpupool.torch storage unpickled outside its message")
    return got[i]


def _rebuild_batched(cls, i, dtype, offset, size, stride, requires_grad):
    got = getattr(_tls, "received", None)
    if got is None:
        raise RuntimeError("a gpupool.torch tensor unpickled outside its message")
    made = getattr(_tls, "made", None)
    t = made.pop(i, None) if made else None
    if t is not None and t.dtype == dtype and offset == 0 and tuple(t.size()) == size \
            and t.stride() == stride:
        return _as_sent(cls, t, requires_grad)
    return _rebuild_tensor(cls, got[i], dtype, offset, size, stride, requires_grad)


# --- receiving -----------------------------------------------------------------------------
def _rebuild_empty(device):
    return torch.UntypedStorage(0, device=device)


def _rebuild_storage(token, offset, nbytes, spec):
    if _S.opts is None:
        # A child unpickling its first gpupool tensor: it sends as its parent does.
        install(copy=spec[0], cpu=spec[1], pool=spec[2], fallback=spec[3], socket=spec[4])
    c = _client()
    hold = c._open_hold(token, False, None)
    if hold.kind == _lib.MEM_DEVICE:
        # The receiver's current stream on the buffer's device waits on the ready event.
        hold.used_in(torch.cuda.current_stream(hold.cuda_device).cuda_stream)
    return _storage_of(c, hold, offset, nbytes)


def _storage_of(c, hold, offset, nbytes):
    """The storage of a received hold (this process's storage of that memory when it has one
    already: the hold then goes)."""
    return _storages_of([hold], [offset], [nbytes])[0][0]


def _storages_of(holds, offs, sizes, whole=None):
    """The storage of each received hold (holds[i] at offs[i], sizes[i] bytes): this process's
    storage of that memory when it has one already (the hold then goes), else a new one whose
    deleter drops the hold. Each hold is taken out of `holds` (set to None) once a storage
    owns it, so that the caller releases only those left on a failure. whole[i], when given
    and not None, is (DLPack element type, shape, strides) of the one tensor the sender had
    on storage i, covering it: a new storage i is then made as that tensor, returned in the
    second result (place -> tensor)."""
    n = len(holds)
    storages = [None] * n
    keys = [(h.buffer_id, offs[i], sizes[i]) for i, h in enumerate(holds)]
    with _S.lock:
        refs = [_S.received.get(k) for k in keys]
    new = []
    for i, ref in enumerate(refs):
        if ref is not None and not ref.expired():
            st = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if st is not None:
                storages[i] = st
                h, holds[i] = holds[i], None
                h.release()  # this process holds the buffer already, through that storage
                continue
        new.append(i)
    # The storages' deleters drop the holds (each capsule keeps its hold referenced till then).
    by_dev = {}
    for i in new:
        by_dev.setdefault((holds[i].dl_device, bool(whole and whole[i])), []).append(i)
    made = {}
    for (dev, as_view), idx in by_dev.items():
        if as_view:
            caps = _dlpack.view_capsules(dev, [(holds[i].ptr + offs[i], whole[i][0], whole[i][1],
                                                whole[i][2], holds[i]) for i in idx])
            for i, cap in zip(idx, caps):
                t = made[i] = _from_dlpack(cap)
                storages[i] = t.untyped_storage()
        else:
            caps = _dlpack.bytes_capsules(dev, [(holds[i].ptr + offs[i], sizes[i], holds[i]) for i in idx])
            for i, cap in zip(idx, caps):
                storages[i] = _from_dlpack(cap).untyped_storage()
    owners = [(i, holds[i]) for i in new]
    for i in new:
        holds[i] = None
    weak = [(_torch_reductions.StorageWeakRef(storages[i]), storages[i].data_ptr()) for i in new]
    with _S.lock:
        received = _S.received
        for (i, h), (ref, ptr) in zip(owners, weak):
            received[keys[i]] = ref
            _remember_locked(ptr, h, offs[i])  # sent on from here: shared in place
        if len(received) > _S.received_prune:
            for k in [k for k, r in received.items() if r.expired()]:
                del received[k]
            _S.received_prune = max(1024, 2 * len(received))
    return storages, made


def _rebuild_tensor(cls, storage, dtype, offset, size, stride, requires_grad):
    t = torch.empty((0,), dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
    return _as_sent(cls, t, requires_grad)


def _as_sent(cls, t, requires_grad):
    """A received tensor t as the sender's was: its class (Parameter, a subclass) and
    requires_grad."""
    if cls is torch.Tensor:
        if requires_grad:
            t.requires_grad = True
        return t
    if cls is torch.nn.parameter.Parameter:
        # requires_grad goes to the constructor: integer parameters must not get it later
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    if cls is not torch.Tensor and issubclass(cls, torch.Tensor):
        t = t.as_subclass(cls)
    t.requires_grad = requires_grad
    return t


# --- children ------------------------------------------------------------------------------
# A spawn or forkserver child that sends tensors before it receives any would use torch's own
# sharing: the Process object it unpickles first thing carries install()'s options, so the
# child installs before its target runs (Pool workers included). A fork child inherits the
# registrations.
def _process_types():
    import multiprocessing.context as ctx

    return [t for t in (getattr(ctx, "SpawnProcess", None), getattr(ctx, "ForkServerProcess", None))
            if t is not None]


def _reduce_process(p):
    rv = p.__reduce_ex__(2)  # object's own: (copyreg.__newobj__, (cls,), state)
    return (_rebuild_process, (_S.opts.spec() if _S.opts is not None else None, rv[1][0], rv[2]))


def _rebuild_process(spec, cls, state):
    if spec is not None and _S.opts is None:
        install(copy=spec[0], cpu=spec[1], pool=spec[2], fallback=spec[3], socket=spec[4])
    obj = cls.__new__(cls)
    if isinstance(state, tuple):
        state = state[0]
    if state:
        obj.__dict__.update(state)
    return obj


# --- install -------------------------------------------------------------------------------
def _tensor_types():
    types = [torch.Tensor, torch.nn.parameter.Parameter]
    types += [t for t in getattr(torch, "_tensor_classes", ()) if t not in types]
    return types


def install(client: Optional[Client] = None, *, copy: bool = True, cpu: bool = False,
            pool: Optional[str] = None, fallback: bool = False,
            socket: Optional[str] = None) -> None:
    """Send every tensor torch pickles across processes as a gpupool hold.

    client: the Client to share through (default: one per process, connected now to
    `socket`, $GPUPOOL_SOCKET or the default socket; after fork the child connects its own).
    copy: copy storages that are not gpupool memory into a new gpupool buffer (True) or
    refuse them with GpupoolError (False). cpu: route CPU storages through gpupool's host
    pools too (default: only CUDA storages; CPU tensors keep torch's shared memory). pool:
    the pool copies go to (default: one on the storage's device). fallback: when gpupoold is
    unreachable, log a warning and use torch's own sharing instead of raising.

    Children need nothing: a spawn or forkserver child (a Process, a Pool worker) installs
    the same options before its target runs, a fork child inherits them, and any process
    that unpickles a gpupool tensor installs them too; each connects a client of its own on
    first use."""
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions first)

    opts = _Options(copy, cpu, pool, fallback, socket)
    with _S.lock:
        if _S.pid != os.getpid():
            _forget_parent()
        _S.opts = opts
        if client is not None:
            _S.client = client
            _S.user_client = True
        else:
            if _S.client is not None and (_S.user_client or _S.client_socket != opts.socket):
                _S.client = None  # another daemon (or the user's client no more): connect anew
            try:
                _client()
            except GpupoolError as e:
                if not fallback:
                    raise error("ECONNECT", "gpupool.torch.install: cannot connect to gpupoold: %s. "
                                "Start gpupoold (or point GPUPOOL_SOCKET at it), or install(fallback=True) "
                                "to fall back to torch's own sharing" % e) from e
                _say_fallback("gpupoold is unreachable (%s)" % e)
        reducers = ForkingPickler._extra_reducers
        if not _S.saved:
            for t in _tensor_types():
                _S.saved[t] = reducers.get(t, _torch_reductions.reduce_tensor)
            _S.saved[torch.UntypedStorage] = reducers.get(torch.UntypedStorage,
                                                          _torch_reductions.reduce_storage)
            for t in _process_types():
                _S.saved[t] = reducers.get(t)
        for t in _tensor_types():
            ForkingPickler.register(t, _reduce_tensor)
        ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
        for t in _process_types():
            ForkingPickler.register(t, _reduce_process)
        if _S.pickler is None:
            _S.pickler = (ForkingPickler.__init__, ForkingPickler.dump,
                          "__init__" in ForkingPickler.__dict__, "dump" in ForkingPickler.__dict__)
            ForkingPickler.__init__ = _pickler_init
            ForkingPickler.dump = _pickler_dump


def uninstall() -> None:
    """Give torch its own reductions back (tensors sent from now on use torch's sharing)."""
    with _S.lock:
        for t, r in _S.saved.items():
            if r is None:
                ForkingPickler._extra_reducers.pop(t, None)
            else:
                ForkingPickler.register(t, r)
        _S.saved = {}
        _S.opts = None
        if _S.pickler is not None:
            init, dump, had_init, had_dump = _S.pickler
            if had_init:
                ForkingPickler.__init__ = init
            else:
                del ForkingPickler.__init__
            if had_dump:
                ForkingPickler.dump = dump
            else:
                del ForkingPickler.dump
            _S.pickler = None


def installed() -> bool:
    return _S.opts is not None


# --- allocating for sharing ----------------------------------------------------------------
def _size_arg(size):
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return tuple(int(n) for n in size)


def empty(*size: Any, dtype: Optional[torch.dtype] = None, device: Any = None,
          requires_grad: bool = False, pool: Optional[str] = None,
          client: Optional[Client] = None) -> torch.Tensor:
    """torch.empty whose storage is a gpupool buffer of its own: install() shares it without a
    copy, and both processes see each other's writes. device: as torch's (default: torch's
    default device); pool: a pool name instead of the pool of that device."""
    shape = _size_arg(size)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    dev = torch.device(device) if device is not None else torch.get_default_device()
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    c = client if client is not None else _client()
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if pool is None:
        pool = c._pool_for(_dlpack.kDLCUDA, dev.index, str(dev)) if dev.type == "cuda" \
            else c._pool_for(_dlpack.kDLCPU, 0, "cpu")
    s = _stream_of(dev)
    g = c._alloc((max(nbytes, 1),), _UINT8, pool, 0, s)
    hold = g._hold
    x = torch.from_dlpack(g)
    if x.device != dev:
        raise error("EINVAL", "pool %r holds %s memory, not %s" % (pool, x.device, dev))
    st = x.untyped_storage()
    _remember(st.data_ptr(), hold, 0)
    del g
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    t = torch.empty((0,), dtype=dtype, device=dev).set_(st, 0, shape, tuple(reversed(strides)))
    if requires_grad:
        t.requires_grad_(True)
    return t


def zeros(*size: Any, **kw: Any) -> torch.Tensor:
    """gpupool.torch.empty filled with zeros."""
    t = empty(*size, **kw)
    with torch.no_grad():
        t.zero_()
    return t


def empty_like(other: torch.Tensor, *, dtype: Optional[torch.dtype] = None, device: Any = None,
               requires_grad: bool = False, pool: Optional[str] = None,
               client: Optional[Client] = None) -> torch.Tensor:
    """gpupool.torch.empty of other's shape, dtype and device (C-contiguous)."""
    return empty(tuple(other.shape), dtype=dtype or other.dtype,
                 device=device if device is not None else other.device,
                 requires_grad=requires_grad, pool=pool, client=client)


# --- the whole-process allocator -----------------------------------------------------------
def _alloc_library_path():
    env = os.environ.get("GPUPOOL_TORCH_ALLOC_LIBRARY")
    if env:
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libgpupool-torch-alloc.so")
    if os.path.exists(here):
        return here
    client_lib = os.environ.get("GPUPOOL_LIBRARY")
    if client_lib:
        p = os.path.join(os.path.dirname(client_lib), "libgpupool-torch-alloc.so")
        if os.path.exists(p):
            return p
    return "libgpupool-torch-alloc.so"


def use_allocator(socket: Optional[str] = None, pools: Optional[Sequence[Optional[str]]] = None) -> None:
    """Make every CUDA tensor of this process a gpupool buffer of its own, through torch's
    CUDAPluggableAllocator: install() then shares every CUDA storage without a copy. Call it
    before the process's first CUDA allocation (torch cannot swap an allocator in use).
    socket: the daemon (default: $GPUPOOL_SOCKET or the default); pools: a pool name per
    device index (default: the daemon's device pool for each device). Each allocation and
    free is a request to gpupoold (no caching): docs/TORCH.md gives what that costs."""
    if _S.alloc_lib is not None:
        raise error("EBUSY", "gpupool.torch.use_allocator() already runs in this process")
    path = _alloc_library_path()
    try:
        L = ctypes.CDLL(path)
    except OSError as e:
        raise error("ENOENT", "cannot load %s (%s): build gpupool (target gpupool-torch-alloc) "
                    "or set GPUPOOL_TORCH_ALLOC_LIBRARY to the library's full path" % (path, e)) from None
    L.gpupool_torch_alloc_find.argtypes = [ctypes.c_void_p, ctypes.POINTER(_lib.BufferP)]
    L.gpupool_torch_alloc_find.restype = ctypes.c_int
    L.gpupool_torch_alloc_last_error.restype = ctypes.c_char_p
    L.gpupool_torch_alloc_configure.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p),
                                                ctypes.c_int]
    L.gpupool_torch_alloc_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64)] * 3
    if socket is None and _S.opts is not None:
        socket = _S.opts.socket
    if pools is None:
        # The daemon's device pool of each device (none: allocations there fail, saying so).
        with Client(socket, name="torch allocator setup") as c:
            have = c.pools()
        pools = []
        for d in range(torch.cuda.device_count()):
            mine = [p["name"] for p in have if p["kind"] == "device" and p["device"] == d]
            pools.append(mine[0] if mine else None)
    names = (ctypes.c_char_p * max(len(pools), 1))(*[None if p is None else p.encode() for p in pools])
    if L.gpupool_torch_alloc_configure(None if socket is None else str(socket).encode(), names,
                                       len(pools)) != 0:
        raise error("ENOMEM", "out of memory configuring the gpupool torch allocator")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "gpupool_torch_alloc", "gpupool_torch_free")
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise error("EINVAL", "gpupool.torch.use_allocator() must run before this process's first "
                    "CUDA allocation (torch cannot swap an allocator already in use: %s); call it "
                    "first thing, e.g. right after import torch" % e) from None
    _S.alloc_lib = L


def allocator_counts() -> dict:
    """Allocations and frees use_allocator()'s allocator made, and those live now."""
    if _S.alloc_lib is None:
        return {"allocs": 0, "frees": 0, "live": 0}
    v = [ctypes.c_uint64() for _ in range(3)]
    _S.alloc_lib.gpupool_torch_alloc_counts(*[ctypes.byref(x) for x in v])
    return {"allocs": v[0].value, "frees": v[1].value, "live": v[2].value}


def allocator_last_error() -> str:
    """Why use_allocator()'s allocator last failed ("" if it never did)."""
    if _S.alloc_lib is None:
        return ""
    return _S.alloc_lib.gpupool_torch_alloc_last_error().decode(errors="replace")



def __getattr__(name: str):
    # gpupool.torch.PinnedLoader is gpupool.torch_data.PinnedLoader, imported on first use
    # (DataLoader machinery is not loaded by code that only sends tensors).
    if name == "PinnedLoader":
        from .torch_data import PinnedLoader
        return PinnedLoader
    raise AttributeError("module 'gpupool.torch' has no attribute %r" % (name,))
