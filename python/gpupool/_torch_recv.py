"""gpupool.torch, receiving: a message's storages opened in one Open request and rebuilt as
tensors (one storage per buffer in this process), and children that install as their parent."""

from __future__ import annotations

import ctypes
import os
import pickle
import time

import torch

from . import _dlpack, _lib
from ._holds import _Group
from ._native import fast as _fast
from ._torch_state import (_BATCH_MAX, _DL_TYPES, _PROFILE, _S, _client, _collector_paused, _from_dlpack,
                           _prune_owned_locked, _remember_many_locked, _step, _tls)


def _install_spec(spec):
    """install() with a sender's options: a process unpickling its first gpupool tensor sends as
    its sender does. torch.py imports this module, so install is looked up when needed."""
    from .torch import install

    install(copy=spec[0], cpu=spec[1], pool=spec[2], fallback=spec[3], socket=spec[4])


def _open_message(spec, tokens, offs, sizes, devs, payload, whole=None, tix=None):
    return _collector_paused(_open, spec, tokens, offs, sizes, devs, payload, whole, tix)


def _open(spec, tokens, offs, sizes, devs, payload, whole, tix):
    if _S.opts is None:
        # A child unpickling its first gpupool tensor: it sends as its parent does.
        _install_spec(spec)
    c = _client()
    n = len(offs)
    cuda = set(devs)
    cuda.discard(-1)
    # The receiver's current stream waits on the ready events; with one device, the C library
    # makes it wait as it opens (no stream bookkeeping per storage).
    s = torch.cuda.current_stream(next(iter(cuda))).cuda_stream if len(cuda) == 1 else None
    T = _lib.TOKEN_SIZE
    nt = len(tokens) // T
    uniq = []    # a hold per token: per buffer of the message (tix[i]: storage i's)
    holds = []
    made_all = False
    t0 = time.perf_counter_ns() if _PROFILE else 0
    try:
        for k in range(0, nt, _BATCH_MAX):
            uniq += c._open_holds(tokens[k * T:(k + _BATCH_MAX) * T], False, s)
        if len(uniq) > 1:
            # Let go of together: freeing the message's tensors costs one request, not one each.
            g = _Group(c._conn, len(uniq))
            for h in uniq:
                h.group = g
        holds = [uniq[j] for j in tix] if tix is not None else list(uniq)
        if t0:
            t0 = _step("receive: open", t0)
        if s is None:
            for h in uniq:
                if h.kind == _lib.MEM_DEVICE:
                    h.used_in(torch.cuda.current_stream(h.cuda_device).cuda_stream)
        # Takes the holds out of the list; `made` has the tensors made whole from memory.
        storages, made = _storages_of(holds, offs, sizes, whole)
        # Each hold is some storage's (the message names each buffer for a storage of it):
        # nothing to let go of here.
        made_all = len(uniq) == (len(set(tix)) if tix is not None else len(holds))
    finally:
        if not made_all:
            # A hold no storage took (none could be made): it goes now. One a storage took
            # stays referenced by it (several storages may share one hold: a pack's).
            taken = {id(uniq[tix[i]] if tix is not None else uniq[i]) for i in range(len(holds))
                     if holds[i] is None}
            for h in uniq:
                if id(h) not in taken:
                    h.release()
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
        _install_spec(spec)
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
    if _fast is not None and _FAST_STORAGES:
        with _S.lock:
            got = _fast.storages_of(holds, offs, sizes, whole, _S.received, _S.owned)
            _prune_received_locked()
            _prune_owned_locked()
        return got
    with _S.lock:
        # As in C: the records are read, and their weak references used, while no other
        # thread can let go of them (a record replaced or pruned frees its reference).
        return _storages_of_locked(holds, offs, sizes, whole)


def _storages_of_locked(holds, offs, sizes, whole):
    """_storages_of in Python, with _S.lock held."""
    n = len(holds)
    storages = [None] * n
    keys = [(h.buffer_id, offs[i], sizes[i]) for i, h in enumerate(holds)]
    get = _S.received.get
    refs = [get(k) for k in keys]
    new = []
    expired = torch.UntypedStorage._expired
    for i, ref in enumerate(refs):
        if ref is not None and not expired(ref):
            st = torch.UntypedStorage._new_with_weak_ptr(ref)
            if st is not None:
                storages[i] = st
                # This process holds the buffer already, through that storage: the hold goes
                # with its last reference (other storages of the message may share it).
                holds[i] = None
                continue
        new.append(i)
    # The storages' deleters drop the holds (each view keeps its hold referenced till then).
    by_dev = {}
    for i in new:
        by_dev.setdefault((holds[i].dl_device, bool(whole and whole[i])), []).append(i)
    made = {}
    for (dev, as_view), idx in by_dev.items():
        if as_view:
            ts = _views(dev, [(holds[i].ptr + offs[i], whole[i][0], whole[i][1], whole[i][2],
                               holds[i]) for i in idx])
            for i, t in zip(idx, ts):
                made[i] = t
                storages[i] = t.untyped_storage()
        else:
            ts = _byte_views(dev, [(holds[i].ptr + offs[i], sizes[i], holds[i]) for i in idx])
            for i, t in zip(idx, ts):
                storages[i] = t.untyped_storage()
    owners = [holds[i] for i in new]
    for i in new:
        holds[i] = None
    free = torch.UntypedStorage._free_weak_ref
    received = _S.received
    for i in new:
        # The entry's weak reference (one weak count of torch's) now names the new storage;
        # the one it had, if any, is let go.
        old = received.get(keys[i])
        received[keys[i]] = storages[i]._weak_ref()
        if old is not None:
            free(old)
    # Sent on from here: shared in place (each storage's data pointer is where its view was
    # made).
    _remember_many_locked([(h.ptr + offs[i], h, offs[i]) for i, h in zip(new, owners)])
    _prune_received_locked()
    return storages, made


def _prune_received_locked():
    """Forget the received memory whose storages are gone (letting go of each weak reference),
    once there are twice as many entries as after the last time (at least 1024). With _S.lock
    held."""
    received = _S.received
    if len(received) > _S.received_prune:
        expired, free = torch.UntypedStorage._expired, torch.UntypedStorage._free_weak_ref
        for k in [k for k, r in received.items() if expired(r)]:
            free(received.pop(k))
        _S.received_prune = max(1024, 2 * len(received))


_BYTE = (1, 8)  # DLPack's uint8: (kDLUInt, bits)


def _views(dev, items):
    """Tensors on device dev (DLPack type, id) for (data, (code, bits), shape, strides, owner)
    items: views of the memory at data, each keeping its owner (a hold) until torch lets go
    of it. The extension makes them in one call; else DLPack capsules made in Python."""
    if _fast is not None:
        return _fast.views(_from_dlpack, dev[0], dev[1], items)
    return [_from_dlpack(cap) for cap in _dlpack.view_capsules(dev, items)]


def _byte_views(dev, items):
    """_views of (data, nbytes, owner) items: flat uint8 tensors, to take the storage of."""
    if _fast is not None:
        return _fast.views(_from_dlpack, dev[0], dev[1],
                           [(data, _BYTE, (n,), (1,), owner) for data, n, owner in items])
    return [_from_dlpack(cap) for cap in _dlpack.bytes_capsules(dev, items)]


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


if _fast is not None:
    # pickle calls it by the same name (gpupool._torch_recv._rebuild_batched) on either side.
    _fast.setup(_tls, _rebuild_tensor, _as_sent, torch.Tensor)
    _rebuild_batched = _fast.rebuild_batched  # noqa: F811


def _setup_torch_shim():
    """Hand gpupool._fast torch's own C functions for making tensors of memory (torch's stable
    C shim: torch_from_blob with a deleter, torch 2.10 and later) and for turning a list of
    them into Python tensors in one call: a received message's tensors are then made without a
    DLPack capsule each (7-25% less per tensor, bench/torch_floor.py). Where this torch lacks
    them, or GPUPOOL_TORCH_SHIM=0, the views go through DLPack as before. Returns whether the
    extension uses them."""
    if _fast is None or not hasattr(_fast, "setup_torch") or os.environ.get("GPUPOOL_TORCH_SHIM") == "0":
        return False
    wrap = getattr(getattr(torch._C, "_aoti", None), "alloc_tensors_by_stealing_from_void_ptrs", None)
    if wrap is None:
        return False
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch.so"):
        try:
            # Loaded already by import torch: this only finds it.
            lib = ctypes.CDLL(os.path.join(libdir, name), mode=os.RTLD_NOLOAD | os.RTLD_NOW)
            from_blob, delete = lib.torch_from_blob, lib.aoti_torch_delete_tensor_object
            types = []
            for dt, (code, bits) in _DL_TYPES.items():
                fn = getattr(lib, "aoti_torch_dtype_" + str(dt).rsplit(".", 1)[1])
                fn.restype = ctypes.c_int32
                fn.argtypes = []
                types.append((code, bits, fn()))
        except (OSError, AttributeError):
            continue
        _fast.setup_torch(ctypes.cast(from_blob, ctypes.c_void_p).value,
                          ctypes.cast(delete, ctypes.c_void_p).value, wrap, tuple(types))
        return True
    return False


_TORCH_SHIM = _setup_torch_shim()


def _setup_storages():
    """Hand gpupool._fast what its storages_of calls, where the extension has it (one built
    before it does not: _storages_of then runs in Python)."""
    if _fast is None or not hasattr(_fast, "storages_of"):
        return False
    U = torch.UntypedStorage
    _fast.setup_recv((U._expired, U._new_with_weak_ptr, U._free_weak_ref, _from_dlpack),
                     _lib.MEM_DEVICE, _lib.MEM_HOST_NUMA)
    return True


_FAST_STORAGES = _setup_storages()


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
        _install_spec(spec)
    obj = cls.__new__(cls)
    if isinstance(state, tuple):
        state = state[0]
    if state:
        obj.__dict__.update(state)
    return obj
