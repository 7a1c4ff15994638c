"""DataLoader batches already pinned: workers collate each batch straight into a buffer of
gpupool's host pool, and the main process receives it without a copy.

``PinnedLoader`` is a ``torch.utils.data.DataLoader`` that takes every argument torch's does
(plus ``socket``, ``pool``, ``alloc_timeout``). With workers, each batch is made like this:

1. In the worker, the collate function (torch's ``default_collate`` semantics when none is
   given) is run with the stacking of tensors deferred: it returns the batch's structure
   with a placeholder for each stack. That structure is pickled with our own pickler, whose
   ``persistent_id`` turns every tensor leaf (a stack to make, or a tensor a custom collate
   function made) into an index; the leaves are laid out one after the other, aligned, in
   ONE buffer allocated from gpupool's host pool (on the CUDA backend a host-NUMA pool:
   pinned memory every GPU can DMA from), and each stack is written straight into it
   (``torch.stack(..., out=view)``); other tensors are copied in once.
2. The worker shares the buffer (a gpupool token) and hands torch's worker queue an object
   whose pickle is the token, the pickled structure and the leaves' table: a few hundred
   bytes. No tensor goes through torch's shared-memory reductions (no fd is passed).
3. The main process unpickles it where torch's iterator reads its queue (the main thread:
   there is no pin_memory thread), opens the token (one round trip to the daemon), imports
   the buffer once and gives each leaf a view of it. Order, ``persistent_workers``,
   ``timeout``, worker crashes and early exits are torch's own machinery, untouched.
4. The worker keeps its hold on the buffer until the main process has opened it: the main
   process sends the batch's id back on a queue of that worker, and a thread in the worker
   releases the hold. The buffer returns to the pool when the last view of the batch in
   the main process is freed. A batch the main process never opened (an early exit, a
   worker killed) is released when its worker's connection closes.

A worker forked from the main process shares the main process's connection with every
object it inherits: cyclic garbage collection leaves those objects alone in the worker, so
that a batch the main process was about to collect is never released on its behalf from a
worker.

On the CUDA backend the workers need a CUDA context of their own to map host-NUMA memory,
which a forked child of a process that has used CUDA cannot create: PinnedLoader then starts
its workers with "spawn" unless told otherwise, and refuses "fork". The main process marks
opened batches as ready for the CPU without waiting on any stream (the worker wrote them
with the CPU before sharing) and orders the buffer's release after the work queued on the
CUDA stream that was current when the batch arrived: copy it to the GPU on that stream
(``batch.cuda(non_blocking=True)`` does), or keep the batch alive until a copy on another
stream is done.
"""

from __future__ import annotations

import ctypes
import gc
import io
import os
import pickle
import threading
import uuid
import weakref
from typing import Dict, Optional

import torch
import torch.utils.data
from torch.utils.data import _utils as _torch_utils
from torch.utils.data._utils import collate as _collate

from . import _dtypes, _lib
from ._client import Client
from ._errors import error
from ._lib import check
from ._tensor import Tensor

__all__ = ["PinnedLoader", "pinned_collate"]

# Leaves are placed at multiples of this in a batch's buffer: every element type's
# alignment, and each leaf starts a cache line.
_ALIGN = 64
_UINT8 = _dtypes.dtype("uint8")
_PROTOCOL = pickle.HIGHEST_PROTOCOL


# --- the batch's structure and its leaves ---------------------------------------------------
class _Stack:
    """A stack of equal tensors to be made (torch.stack) straight into the batch's buffer."""

    __slots__ = ("samples", "shape", "dtype")

    def __init__(self, samples, shape, dtype):
        self.samples = samples
        self.shape = shape
        self.dtype = dtype


def _stack_later(batch, *, collate_fn_map=None):
    """default_collate's rule for tensors, with the stack deferred. What it cannot place
    (nested or sparse tensors, mixed types or shapes: torch.stack says what is wrong) goes
    through torch's own function."""
    elem = batch[0]
    if (elem.layout != torch.strided or elem.is_nested or elem.device.type != "cpu"
            or elem.requires_grad):
        return _collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    shape, dtype = elem.shape, elem.dtype
    for t in batch:
        if (type(t) is not type(elem) or t.shape != shape or t.dtype != dtype
                or t.layout != torch.strided or t.device.type != "cpu" or t.requires_grad):
            return torch.stack(batch, 0)  # torch's error, or its result for what it accepts
    return _Stack(batch, (len(batch),) + tuple(shape), dtype)


_COLLATE_MAP = dict(_collate.default_collate_fn_map)
_COLLATE_MAP[torch.Tensor] = _stack_later


def pinned_collate(batch):
    """torch's default_collate, with each stack of tensors deferred so that PinnedLoader
    writes it straight into the batch's pinned buffer. Only meaningful inside PinnedLoader
    (it returns placeholders, not tensors); PinnedLoader uses it when no collate_fn is
    given."""
    return _collate.collate(batch, collate_fn_map=_COLLATE_MAP)


class _LeafPickler(pickle.Pickler):
    """Pickles a batch's structure with every tensor leaf as an index into `leaves`."""

    def __init__(self, f):
        super().__init__(f, protocol=_PROTOCOL)
        self.leaves = []   # _Stack or torch.Tensor, in order
        self.seen = {}     # id -> index (a leaf met twice stays one tensor)

    def persistent_id(self, obj):
        t = type(obj)
        if t is _Stack or (t is torch.Tensor and obj.layout == torch.strided and
                           obj.device.type == "cpu" and not obj.requires_grad and
                           not obj.is_nested and not obj.is_quantized):
            i = self.seen.get(id(obj))
            if i is None:
                i = self.seen[id(obj)] = len(self.leaves)
                self.leaves.append(obj)
            return i
        return None


def _layout(leaves):
    """The table of the leaves' (offset, dtype name, shape) and the buffer's size."""
    table = []
    off = 0
    for leaf in leaves:
        if type(leaf) is _Stack:
            shape, dt = leaf.shape, leaf.dtype
        else:
            shape, dt = tuple(leaf.shape), leaf.dtype
        n = 1
        for s in shape:
            n *= s
        nbytes = n * dt.itemsize
        table.append((off, str(dt)[6:], shape))
        off += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return table, off


def _fill(arena, leaves, table):
    for leaf, (off, dname, shape) in zip(leaves, table):
        dst = _view(arena, off, getattr(torch, dname), shape)
        if type(leaf) is _Stack:
            torch.stack(leaf.samples, 0, out=dst)
        else:
            dst.copy_(leaf)


def _view(arena, off, dt, shape):
    n = 1
    for s in shape:
        n *= s
    return arena[off:off + n * dt.itemsize].view(dt).view(shape)


class _LeafUnpickler(pickle.Unpickler):
    def __init__(self, f, views):
        super().__init__(f)
        self.views = views

    def persistent_load(self, pid):
        return self.views[pid]


def _views(arena, table):
    return [_view(arena, off, getattr(torch, dname), shape) for off, dname, shape in table]


def _arena_of(tensor):
    """The buffer as a flat uint8 torch tensor on the CPU (pinned memory on host-NUMA) that
    keeps the hold until torch frees it.

    torch.frombuffer, not DLPack: torch calls a DLPack deleter (here a ctypes callback) with
    no care for an exception being raised at that moment, and batches are often freed
    while one unwinds (a worker's error re-raised with a list of batches half made); the
    callback then fails and Python loses the exception. frombuffer's storage drops a
    Python reference instead, and the hold's release runs as a __del__, which CPython runs
    with the pending exception put aside."""
    hold = tensor._hold
    arr = (ctypes.c_uint8 * hold.size).from_address(hold.ptr)
    arr.hold = hold
    return torch.frombuffer(arr, dtype=torch.uint8)


# --- the worker's side ----------------------------------------------------------------------
class _Worker:
    """What a worker process keeps: its connection, the holds of the batches it made that
    the main process has not opened yet, and the thread that releases them."""

    def __init__(self, chan, worker_id):
        self.client = Client(chan.socket, name="PinnedLoader worker %d" % worker_id)
        self.pool = chan.pool
        self.chan_id = chan.chan_id
        self.worker_id = worker_id
        self.alloc_timeout = chan.alloc_timeout
        self.acks = chan.acks[worker_id]
        self.lock = threading.Lock()
        self.pending: Dict[int, Tensor] = {}
        self.next_id = 0
        threading.Thread(target=self._released_by_main, name="gpupool-acks",
                         daemon=True).start()

    def _released_by_main(self):
        while True:
            try:
                ids = self.acks.get()
            except (EOFError, OSError):
                return
            if ids is None:
                return
            with self.lock:
                gone = [self.pending.pop(i, None) for i in ids]
            for t in gone:
                if t is not None:
                    t.release()

    def make(self, structure):
        f = io.BytesIO()
        p = _LeafPickler(f)
        p.dump(structure)
        leaves = p.leaves
        table, size = _layout(leaves)
        t = self.client.alloc((max(size, 1),), "uint8", pool=self.pool,
                              timeout=self.alloc_timeout)
        try:
            if leaves:
                # A range freed by a GPU consumer may still be read by its copy: the alloc
                # ordered it in our stream, which the CPU must wait for before writing.
                t._hold.sync_cpu()
                _fill(_arena_of(t), leaves, table)
            tok = _lib.Token()
            hold = t._hold
            check(self.client._lib.gpupool_buffer_share(hold.buf, None, ctypes.byref(tok)),
                  "share of a batch's buffer")
            with self.lock:
                bid = self.next_id
                self.next_id += 1
                self.pending[bid] = t
        except BaseException:
            t.release()
            raise
        return _Batch(self.chan_id, self.worker_id, bid, bytes(tok.bytes), f.getvalue(), table)


_worker: Optional[_Worker] = None  # this process's, when it is a PinnedLoader worker


class _Batch:
    """What a worker's collate returns: pickled, a token and a few hundred bytes; unpickled
    in the main process, the batch itself."""

    __slots__ = ("args",)

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return (_rebuild, self.args)


# --- the main process's side ----------------------------------------------------------------
class _Channel:
    """One iterator's workers and the main process: where workers connect, the pool, and a
    queue per worker on which the main process says which batches it has opened. Workers
    receive it pickled (the queues travel as multiprocessing pickles them, while the workers
    are started) or inherited."""

    def __init__(self, ctx, workers, socket, pool, alloc_timeout, client):
        self.chan_id = uuid.uuid4().hex
        self.socket = socket
        self.pool = pool
        self.alloc_timeout = alloc_timeout
        self.acks = [ctx.Queue() for _ in range(workers)]
        self.client = client  # main process only
        for q in self.acks:
            # A worker that died reads nothing: the main process must not wait at exit for
            # a queue nobody drains.
            q.cancel_join_thread()

    def __getstate__(self):
        return {"chan_id": self.chan_id, "socket": self.socket, "pool": self.pool,
                "alloc_timeout": self.alloc_timeout, "acks": self.acks, "client": None}

    def opened(self, worker_id, bid):
        try:
            self.acks[worker_id].put((bid,))
        except (ValueError, OSError, AssertionError):
            pass  # the iterator is shutting down: the worker's exit releases the hold

    def close(self):
        _channels.pop(self.chan_id, None)
        for q in self.acks:
            try:
                q.put(None)
                q.close()
            except (ValueError, OSError, AssertionError):
                pass


_channels: Dict[str, _Channel] = {}


def _forked_child():
    """In a child forked while a PinnedLoader starts its workers: every object inherited
    from the main process is left out of cyclic garbage collection. Garbage the main process
    had not collected yet (a batch in a reference cycle) would otherwise be collected here,
    and its hold released on the main process's connection, which the child shares: the
    main process would lose memory it still uses."""
    if _channels:
        gc.freeze()


os.register_at_fork(after_in_child=_forked_child)


def _stream_now(device):
    """The raw CUDA stream torch works on now in this thread (None without CUDA)."""
    if device is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream(device).cuda_stream


def _open(client, token, stream):
    """A Tensor of the shared buffer named by token: a hold of this process."""
    tok = _lib.Token()
    ctypes.memmove(tok.bytes, token, len(token))
    buf = _lib.BufferP()
    check(client._lib.gpupool_buffer_open(client._conn.usable(), ctypes.byref(tok), 0, stream,
                                          ctypes.byref(buf)),
          "open of a batch's buffer")
    hold = client._new_hold(buf, stream)
    # The worker wrote this memory with the CPU before sharing it, and the daemon answered
    # the open after the share: nothing is left to wait for before the CPU reads it, and a
    # sync of `stream` would wait for whatever GPU work is queued there.
    hold.cpu_synced = True
    return client._tensor(hold, _UINT8, (hold.size,), None, 0, None)


def _rebuild(chan_id, worker_id, bid, token, payload, table):
    chan = _channels.get(chan_id)
    if chan is None:
        raise error("EINVAL", "a PinnedLoader batch reached a process that did not start its "
                    "workers (or its iterator is gone): batches are opened only by the "
                    "DataLoader iterator that made them")
    try:
        # The worker keeps its hold until told, whether or not the open worked: a failed open
        # (a limit, a daemon restart) must not leave the batch's buffer pending in the worker.
        t = _open(chan.client, token, None)
        # The release is ordered after the work queued on the stream current now (where the
        # batch's copy to the GPU is expected).
        stream = _stream_now(torch.cuda.current_device()
                             if t._hold.kind == _lib.MEM_HOST_NUMA else None)
        if stream is not None:
            t._hold.streams.append(stream)
        arena = _arena_of(t)
    finally:
        chan.opened(worker_id, bid)
    t.release()  # the views hold the memory from here on
    return _LeafUnpickler(io.BytesIO(payload), _views(arena, table)).load()


def _main_process_batch(client, pool, alloc_timeout, structure):
    """num_workers=0: the batch made in this process, straight into gpupool memory."""
    f = io.BytesIO()
    p = _LeafPickler(f)
    p.dump(structure)
    table, size = _layout(p.leaves)
    t = client.alloc((max(size, 1),), "uint8", pool=pool, timeout=alloc_timeout)
    t._hold.sync_cpu()
    arena = _arena_of(t)
    t.release()
    if p.leaves:
        _fill(arena, p.leaves, table)
    return _LeafUnpickler(io.BytesIO(f.getvalue()), _views(arena, table)).load()


class _Collate:
    """The loader's collate_fn: the user's (or pinned_collate), then the batch placed in a
    gpupool buffer: shared with the main process from a worker, made in place in the
    process that made the loader (num_workers=0)."""

    def __init__(self, fn, client, pool, alloc_timeout):
        self.fn = fn
        self.main = (client, pool, alloc_timeout)

    def __getstate__(self):
        return {"fn": self.fn, "main": None}

    def __call__(self, batch):
        structure = self.fn(batch)
        w = _worker
        if w is not None:
            return w.make(structure)
        if self.main is None:
            raise RuntimeError("PinnedLoader's collate_fn runs in its workers or in the "
                               "process that made the loader")
        return _main_process_batch(*self.main, structure)


class _WorkerInit:
    """The loader's worker_init_fn: connect this worker, then the user's function."""

    def __init__(self, fn):
        self.fn = fn
        self.chan: Optional[_Channel] = None

    def __call__(self, worker_id):
        global _worker
        _worker = _Worker(self.chan, worker_id)
        if self.fn is not None:
            self.fn(worker_id)


class PinnedLoader(torch.utils.data.DataLoader):
    """A DataLoader whose batches arrive in pinned gpupool memory, with no pin_memory copy.

    Every argument of torch.utils.data.DataLoader is taken and means what it means there;
    pin_memory is ignored (batches are pinned already on the CUDA backend, and in shared
    memory on the host backend). Also:

    socket: the daemon's socket (None: the client's, else $GPUPOOL_SOCKET or the default).
    client: a gpupool.Client of this process to open batches with (None: one of its own).
    pool: the pool's name (None: the daemon's first host pool, else its first host-NUMA
      pool). alloc_timeout: seconds a worker waits for memory when the pool is full before
      failing (the main process then raises the daemon's message).

    Tensor leaves of each batch (torch's default collation stacks written straight in;
    tensors a custom collate_fn returns copied in once) lie in one buffer; other values
    (strings, and what is not a plain CPU tensor) travel as torch's DataLoader sends them.
    A batch's buffer returns to the pool when its last tensor is freed."""

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False,
                 timeout=0, worker_init_fn=None, multiprocessing_context=None, *,
                 socket=None, client: Optional[Client] = None, pool: Optional[str] = None,
                 alloc_timeout: float = 60.0, **kwargs):
        own = client is None
        if own:
            client = Client(socket, name="PinnedLoader")
        try:
            pool, kind = _pick_pool(client, pool)
            if kind == "host-numa" and num_workers > 0:
                multiprocessing_context = _cuda_context(multiprocessing_context)
        except BaseException:
            if own:
                client.close()
            raise
        if socket is None:
            socket = client._conn.socket_path
        auto = batch_size is not None or batch_sampler is not None
        if collate_fn is None:
            collate_fn = pinned_collate if auto else _torch_utils.collate.default_convert
        self._gp_client = client
        self._gp_own_client = own
        self._gp_socket = None if socket is None else os.fspath(socket)
        self._gp_pool = pool
        self._gp_kind = kind
        self._gp_alloc_timeout = alloc_timeout
        self._gp_init = _WorkerInit(worker_init_fn)
        super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                         batch_sampler=batch_sampler, num_workers=num_workers,
                         collate_fn=_Collate(collate_fn, client, pool, alloc_timeout),
                         pin_memory=False,
                         drop_last=drop_last, timeout=timeout, worker_init_fn=self._gp_init,
                         multiprocessing_context=multiprocessing_context, **kwargs)

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        ctx = self.multiprocessing_context
        if ctx is None:
            import torch.multiprocessing as tmp
            ctx = tmp
        chan = _Channel(ctx, self.num_workers, self._gp_socket, self._gp_pool,
                        self._gp_alloc_timeout, self._gp_client)
        _channels[chan.chan_id] = chan
        self._gp_init.chan = chan
        try:
            it = super()._get_iterator()
        except BaseException:
            chan.close()
            raise
        finally:
            self._gp_init.chan = None
        # The channel lives as long as the iterator and its workers.
        weakref.finalize(it, chan.close)
        return it

    @property
    def pool(self) -> str:
        """The pool batches are made in."""
        return self._gp_pool


def _pick_pool(client, pool):
    pools = client.pools()
    if pool is not None:
        for p in pools:
            if p["name"] == pool:
                if p["kind"] not in ("host", "host-numa"):
                    raise error("EINVAL", "pool %r is %s memory; PinnedLoader needs a host pool "
                                "(host backend) or a host-NUMA pool (CUDA backend)"
                                % (pool, p["kind"]))
                return pool, p["kind"]
        raise error("ENOENT", "the daemon has no pool %r (it has %s)"
                    % (pool, ", ".join(p["name"] for p in pools) or "none"))
    for kind in ("host", "host-numa"):
        for p in pools:
            if p["kind"] == kind:
                return p["name"], kind
    raise error("ENOENT", "the daemon has no host or host-NUMA pool for PinnedLoader's batches "
                "(it has %s): add one to its config, e.g. [pool pinned] kind = host-numa"
                % (", ".join("%s (%s)" % (p["name"], p["kind"]) for p in pools) or "none"))


def _cuda_context(ctx):
    """The start method of workers that map host-NUMA memory: each needs a CUDA context of
    its own, which a child forked from a process that has used CUDA cannot make."""
    if ctx is None:
        return "spawn"
    method = ctx if isinstance(ctx, str) else ctx.get_start_method()
    if method == "fork":
        raise ValueError("PinnedLoader on a host-NUMA pool cannot use fork: its workers map "
                         "pinned memory through CUDA, which a forked child of a process that "
                         "has used CUDA cannot initialize; use 'spawn' or 'forkserver' (the "
                         "default here is 'spawn')")
    return ctx
