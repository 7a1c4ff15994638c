"""gpupool.torch's process-wide state: install()'s options, the process's client (a new one
after fork), the storages this process shares as gpupool memory, the kept copy buffers, and the
profile of a message's steps. Shared by the sending (_torch_send), receiving (_torch_recv) and
allocating (_torch_alloc) parts; see torch.py."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref
from typing import Optional

import torch

from ._client import Client


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
        # (buffer id, offset, bytes) -> torch's weak storage reference (the int a storage's
        # _weak_ref() gives, a weak count of its own, let go by UntypedStorage._free_weak_ref),
        # so that every storage received for the same memory is one storage here too
        self.received: dict = {}
        self.received_prune = 1024
        self.alloc_lib = None                    # libgpupool-torch-alloc once use_allocator() ran
        # Copy buffers kept for the next messages: (pool, bytes) -> [_Entry], their bytes, and
        # the number of messages sent (an entry unused for _CACHE_AGE messages goes).
        self.cache: dict = {}
        self.cache_bytes = 0
        self.cache_max = _CACHE_MAX
        self.msgno = 0
        # Messages whose copies may still run on the GPU: ([a torch.cuda.Event per device,
        # recorded after them], [the storages they read]), kept until the events complete.
        self.copying: list = []
        # Idle questions about kept copy buffers whose answers are not read yet: (client,
        # its pending request, [(entry, its use count, its hold)]).
        self.asking: list = []
        self.pickler = None                      # ForkingPickler's own (__init__, dump)


# Holds one Share or Open request names (gpupoold's max_share_batch, by default).
_BATCH_MAX = 1024
# Copy buffers are kept for reuse up to this many bytes in all, and for this many messages.
_CACHE_MAX = 8 << 30
_CACHE_AGE = 8
# Up to this size a copy buffer is kept in two sets (one written while the other may still be
# held), so a steady stream of messages needs no round trip to ask before copying: the size of
# the largest storage packed with others (_torch_send._PACK_ALONE), so that a tensor of up to
# 64 MiB sent again and again asks nothing before its copy (an Idle round trip, 0.1-0.15 ms
# of the 64 MiB message's ~0.95 on an H200); the second set costs at most that much per size.
_SMALL = 64 << 20

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
    conn.c_release_many = lambda *a: 0
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
    # The parent's records of received memory name storages of memory this child does not
    # hold: forgotten, their weak references left as they are (a weak count each, never
    # freed here: freeing one whose storage was copied mid-change by the fork is not safe).
    _S.received = {}
    _S.cache = {}          # the parent's holds: never released nor reused here
    _S.cache_bytes = 0
    # The parent's CUDA events and storages: never queried nor freed here.
    _S.stale.append(_S.copying)
    _S.copying = []
    _S.stale.append(_S.asking)  # requests of the parent's connection
    _S.asking = []
    _S.pid = os.getpid()


def _after_fork_in_child():
    # Another thread of the parent may have held the lock at the fork: the child's copy
    # would stay held forever.
    _S.lock = threading.RLock()
    if _S.pid != os.getpid():
        _forget_parent()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _collector_paused(fn, *args):
    """fn(*args) with the garbage collector waiting: a message pickled or made. A message
    makes several objects per storage that all stay (the sender's records and reductions; the
    receiver's holds, storages, tensors): every few hundred start a collection, and with
    thousands of storages several of them are full ones, over every object of the process
    (torch's many): three quarters of the receive of 10,000 storages on a CPU, a fifth of the
    send. It runs after the message if it is due (nothing is allocated here once it is on
    again). A thread that turns it off meanwhile may find it on again."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return fn(*args)
    finally:
        if paused:
            gc.enable()


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
    _remember_many_locked(((storage_ptr, hold, offset),))


def _remember_many_locked(items):
    """_remember_locked for each (storage pointer, hold, offset) of items (a received
    message's storages: one call, not one each). With _S.lock held."""
    owned = _S.owned
    for ptr, hold, offset in items:
        old = owned.get(ptr)
        if old is not None:
            h = old[0]()
            if h is not None and h is not hold and not h.released:
                # Memory this process holds already (its own buffer, received back in the
                # same process): that hold stays the one it is shared by, since it lives longer.
                continue
        owned[ptr] = (weakref.ref(hold), offset)
    _prune_owned_locked()


def _prune_owned_locked():
    """Forget the storages whose holds are gone, once there are twice as many as after the last
    time (at least 1024). With _S.lock held."""
    owned = _S.owned
    if len(owned) > _S.owned_prune:
        for k in [k for k, (r, _) in owned.items() if r() is None or r().released]:
            del owned[k]
        _S.owned_prune = max(1024, 2 * len(owned))



def _say_fallback(why):
    if not _S.fallback_said:
        _S.fallback_said = True
        log.warning("gpupool.torch: %s; tensors travel by torch's own sharing from now on "
                    "(install(fallback=True))", why)
