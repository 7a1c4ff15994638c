"""gpupool.torch, sending: the reducers install() registers, and a message's storages shared
in one Share request (copies into kept buffers first) through ForkingPickler's dump."""

from __future__ import annotations

import array
import ctypes
import io
import os
import time
from multiprocessing.reduction import ForkingPickler

import torch

from . import _dlpack, _lib
from ._dict import _UINT8
from ._errors import GpupoolError, error
from ._native import fast as _fast
from ._torch_recv import (_batched_storage, _open_message, _rebuild_batched, _rebuild_empty,
                          _rebuild_storage, _rebuild_tensor)
from ._torch_state import (_BATCH_MAX, _CACHE_AGE, _DL_TYPES, _PROFILE, _S, _SMALL, _client,
                           _collector_paused, _from_dlpack, _say_fallback, _step, _stream_of, _tls)


def _owned_hold(ptr, n, conn):
    """The live hold of conn this process shares the n bytes at ptr by (a storage it received,
    or made with gpupool.torch.empty), and the storage's offset in it; or None."""
    got = _S.owned.get(ptr)
    if got is not None:
        h = got[0]()
        if h is not None and not h.released and h.conn is conn and got[1] + n <= h.size:
            return h, got[1]
    return None


def _find(storage, c):
    """How storage is gpupool memory shared as it is: (C buffer handle, offset of the storage
    in it), or None."""
    ptr = storage.data_ptr()
    n = storage.nbytes()
    got = _owned_hold(ptr, n, c._conn)
    if got is not None:
        return got[0].buf, got[1]
    if _S.alloc_lib is not None and storage.device.type == "cuda":
        # A block of the allocator's cache: its segment's buffer, at the block's offset.
        buf = _lib.BufferP()
        off, size = ctypes.c_size_t(), ctypes.c_size_t()
        if _S.alloc_lib.gpupool_torch_alloc_lookup(ctypes.c_void_p(ptr), ctypes.byref(buf),
                                                   ctypes.byref(off), ctypes.byref(size)) \
                and n <= size.value:
            return buf, off.value
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


if _fast is not None:
    # The reducer pickle calls: its common case in C, anything else handed to _reduce_tensor.
    _fast.setup_send(_tls, _reduce_tensor, _rebuild_batched, torch.strided)
    _tensor_reducer = _fast.reduce_tensor
else:
    _tensor_reducer = _reduce_tensor


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
    __slots__ = ("storages", "ptrs", "sizes", "devs", "views", "index", "usable", "cpu")

    def __init__(self, cpu=False):
        self.storages = []
        self.ptrs = []     # each storage's data pointer
        self.sizes = []
        self.devs = []     # CUDA device index, -1 for host memory
        # The one tensor of the message on each storage (None: none or several), or what
        # whole() says of it, noted so by gpupool._fast's add.
        self.views = []
        self.index = {}
        self.usable = None  # whether gpupool serves this message (asked at its first tensor)
        self.cpu = cpu      # install(cpu=...) as the message began (gpupool._fast reads it)

    def add(self, storage, device, tensor=None):
        n = storage.nbytes()
        ptr = storage.data_ptr()
        key = (device.type, device.index, ptr, n)
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.storages)
            self.storages.append(storage)
            self.ptrs.append(ptr)
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
            if type(t) is tuple:
                out[i] = t  # gpupool._fast's add noted it so already
                continue
            code = _DL_TYPES.get(t.dtype)
            if code is not None and t.storage_offset() == 0 and t.is_contiguous() \
                    and t.numel() * t.element_size() == self.sizes[i]:
                out[i] = (code, tuple(t.size()), tuple(t.stride()))
        return out


if _fast is not None and hasattr(_fast, "setup_batch"):
    # The reducer adds a tensor to a message in C (_Batch.add and what whole() says of it).
    _fast.setup_batch(_Batch, _DL_TYPES)


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
    return _collector_paused(_dump_message, self, obj, f, dump)


def _dump_message(self, obj, f, dump):
    t0 = time.perf_counter_ns() if _PROFILE else 0
    batch = _tls.batch = _Batch(_S.opts.cpu)
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


# A message's copies go into copy buffers (packs) of at most _PACK_MAX bytes each, one per
# device and so many bytes, each storage at an offset aligned to _PACK_ALIGN: a message of many
# storages is then a handful of buffers, each shared once and opened once (one hold, one ready
# event), not one per storage. A storage above _PACK_ALONE gets a buffer of its own: a receiver
# that keeps one tensor of a message keeps its whole pack, which stays small that way.
_PACK_MAX = 256 << 20
_PACK_ALONE = 64 << 20
_PACK_ALIGN = 256


class _Span:
    """What _copy_targets asks of a storage, for a pack of several: its device and size."""
    __slots__ = ("device", "n")

    def __init__(self, device, n):
        self.device = device
        self.n = n

    def nbytes(self):
        return self.n


def _packs(copies, storages, sizes, devs):
    """The copies (places in the message) grouped into packs: [its places, their offsets in
    the pack, its size, its device], in the order given, a new pack once a device's is full."""
    packs = []
    cur = {}  # device -> the pack being filled
    for i in copies:
        if sizes[i] > _PACK_ALONE:
            packs.append([[i], [0], sizes[i], storages[i].device])
            continue
        p = cur.get(devs[i])
        at = 0 if p is None else (p[2] + _PACK_ALIGN - 1) // _PACK_ALIGN * _PACK_ALIGN
        if p is None or at + sizes[i] > _PACK_MAX:
            p = cur[devs[i]] = [[], [], 0, storages[i].device]
            packs.append(p)
            at = 0
        p[0].append(i)
        p[1].append(at)
        p[2] = at + sizes[i]
    return packs


def _find_many(batch, c):
    """_find for every storage of a message at once: per storage its buffer (a C handle, None
    when it is not gpupool memory), its offset in it, a key naming the buffer (one per
    buffer, to share each once) and whose it is (0: this process's client; 1: use_allocator()'s
    own client). The blocks of use_allocator()'s cache are looked up in one call for all."""
    storages, ptrs, sizes, devs = batch.storages, batch.ptrs, batch.sizes, batch.devs
    n = len(storages)
    bufs = [None] * n
    offs = [0] * n
    keys = [0] * n
    owner = [0] * n
    owned = _S.owned
    conn = c._conn
    # Storages this process shares by a hold of its own (received ones, gpupool.torch.empty's):
    # looked up one by one only when there is one (a process that received memory and sends
    # use_allocator()'s blocks has records, none of them its message's).
    if owned and not owned.keys().isdisjoint(ptrs):
        rest = []
        for i in range(n):
            got = _owned_hold(ptrs[i], sizes[i], conn)
            if got is not None:
                h, off = got
                bufs[i], offs[i], keys[i] = h.buf, off, id(h)
                continue
            rest.append(i)
    else:
        rest = range(n)
    L = _S.alloc_lib
    cuda = [i for i in rest if devs[i] >= 0] if L is not None else ()
    if cuda:
        many = getattr(L, "gpupool_torch_alloc_lookup_many", None)
        if many is not None:
            # Arrays of the machine's words, made and read in C (array), not item by item.
            m = len(cuda)
            every = m == n  # every storage asked (use_allocator()'s message): no scattering
            in_p = array.array("Q", ptrs if every else [ptrs[i] for i in cuda])
            in_n = array.array("Q", sizes if every else [sizes[i] for i in cuda])
            out_b, out_o = array.array("Q", bytes(8 * m)), array.array("Q", bytes(8 * m))
            many(in_p.buffer_info()[0], in_n.buffer_info()[0], m, out_b.buffer_info()[0],
                 out_o.buffer_info()[0])
            found_b, found_o = out_b.tolist(), out_o.tolist()
            # A handle object per segment, not per block.
            handles = {a: ctypes.cast(a, _lib.BufferP) for a in set(found_b) if a}
            if every and all(found_b):
                bufs = [handles[a] for a in found_b]
                offs, keys, owner = found_o, found_b, [1] * n
            else:
                for i, a, o in zip(cuda, found_b, found_o):
                    if a:
                        bufs[i], offs[i], keys[i], owner[i] = handles[a], o, a, 1
        else:
            for i in cuda:
                b, o, size = _lib.BufferP(), ctypes.c_size_t(), ctypes.c_size_t()
                if L.gpupool_torch_alloc_lookup(ctypes.c_void_p(ptrs[i]), ctypes.byref(b), ctypes.byref(o),
                                                ctypes.byref(size)) and sizes[i] <= size.value:
                    bufs[i], offs[i], owner[i] = b, o.value, 1
                    keys[i] = ctypes.cast(b, ctypes.c_void_p).value
        rest = [i for i in rest if bufs[i] is None]
    if rest and _S.user_client:
        for i in rest:
            found = _find(storages[i], c)
            if found is not None:
                bufs[i], offs[i] = found
                keys[i] = ctypes.cast(found[0], ctypes.c_void_p).value
    return bufs, offs, keys, owner


def _share_groups(devs, owner, keys, bufs):
    """The buffers of a message to share, one Share per group: [(device, owner, [buffer, ...])]
    by device and owner (0: this process's client, 1: use_allocator()'s), each buffer named
    once, in the order its storages first come (one key is one buffer: the same handle, or
    handles of one address); and tix[i], the place of storage i's buffer among all the
    groups' buffers in that order (its token's)."""
    n = len(keys)
    kinds = sorted(set(zip(devs, owner)))
    groups, tix, base = [], [0] * n, 0
    for d, o in kinds:
        idx = range(n) if len(kinds) == 1 else [i for i in range(n) if devs[i] == d and owner[i] == o]
        # Built by C loops (dict, zip, comprehensions): a message has thousands of storages.
        where = dict(zip([keys[i] for i in idx], [bufs[i] for i in idx]))
        pos = {k: base + j for j, k in enumerate(where)}
        if len(kinds) == 1:
            tix = [pos[k] for k in keys]
        else:
            for i in idx:
                tix[i] = pos[keys[i]]
        groups.append((d, o, list(where.values())))
        base += len(where)
    return groups, tix


def _send_batch(batch, payload):
    opts = _S.opts
    c = _client()
    storages, sizes, devs = batch.storages, batch.sizes, batch.devs
    n = len(storages)
    t0 = time.perf_counter_ns() if _PROFILE else 0
    if _S.copying:
        _copies_forget()
    if _S.asking:
        _asked_read()
        if t0:
            t0 = _step("send: idle answers read", t0)
    bufs, offs, keys, owner = _find_many(batch, c)
    copies = [i for i in range(n) if bufs[i] is None]
    if copies and not opts.copy:
        i = copies[0]
        raise error("EINVAL", "a %s storage of %d bytes is not gpupool memory and install(copy=False) "
                    "refuses to copy it: allocate it with gpupool.torch.empty/zeros/empty_like or "
                    "under gpupool.torch.use_allocator(), or install(copy=True)" % (storages[i].device, sizes[i]))
    packs = _packs(copies, storages, sizes, devs) if copies else []
    entries = _copy_targets(c, [_Span(dev, total) for _, _, total, dev in packs]) if packs else []
    if t0:
        t0 = _step("send: find and pick buffers", t0)
    try:
        # Each device's copies in one call, on its current stream (the share records the
        # ready events there): the library runs those within the GPU in its gather kernel, a
        # launch per 255 storages, instead of a torch copy_ (and its Python) each.
        lib = c._lib
        per_dev = {}  # device -> the places of its copies, in pack order
        for (idx, poffs, _, _), e in zip(packs, entries):
            buf, k = e.hold.buf, id(e.hold)
            for i, o in zip(idx, poffs):
                bufs[i] = buf
                offs[i] = o
                keys[i] = k
            per_dev.setdefault(devs[idx[0]], []).extend(idx)
        ptrs = batch.ptrs
        # Each device's current stream, looked up once for the copies and the Share.
        streams = {d: torch.cuda.current_stream(d) for d in set(devs) if d >= 0}
        for d, idx in per_dev.items():
            m = len(idx)
            _lib.check(lib.gpupool_buffer_copy_in_many(
                (_lib.BufferP * m)(*[bufs[i] for i in idx]), _u64s([offs[i] for i in idx]),
                _u64s([ptrs[i] for i in idx], ctypes.c_void_p), _u64s([sizes[i] for i in idx], ctypes.c_size_t),
                m, streams[d].cuda_stream if d >= 0 else None,
                _lib.COPY_SRC_ON_STREAM_DEVICE if d >= 0 else 0, None), "copying a message's storages")
        if t0:
            t0 = _step("send: copies launched", t0)
        # The copies are not waited for: the Share below records each buffer's ready event
        # after them in the stream, all of a Share's together, so the receiver's stream waits
        # on one per Share while its process opens the message and makes its tensors as the
        # GPU copies (an inter-process event wait costs ~0.1 ms even once complete: one, not
        # one per buffer). Until they are done, what they read stays referenced here (torch's
        # allocator may hand a freed storage's memory out again in another stream), and each
        # target's release is ordered after them.
        if packs:
            _copies_queued(packs, entries, storages, streams)
        if t0:
            t0 = _step("send: copies queued", t0)
        # Each buffer shared once, however many storages of the message lie in it (a pack's,
        # the blocks of one use_allocator() segment): tix[i] is the token of storage i. One
        # request per device (the ready events are recorded in its current stream), and per
        # _BATCH_MAX buffers. A request names buffers of one client: use_allocator()'s
        # storages are buffers of the allocator's own client. The Share does not wait for its
        # reply: its tokens are made in the library from ids the daemon reserved for this
        # connection, and the request goes out before the message does (a receiver's Open
        # that the daemon reads first waits for it).
        tokens = []
        groups, tix = _share_groups(devs, owner, keys, bufs)
        for d, o, uniq in groups:
            s = streams[d].cuda_stream if d >= 0 else None
            for k in range(0, len(uniq), _BATCH_MAX):
                blob, _ = c._share_kept_many(uniq[k:k + _BATCH_MAX], s)
                tokens.append(blob)  # a token per buffer of part, in its order
        # Which kept copy buffers nobody holds any more: asked now, the answer read when the
        # next message picks its buffers (it has come by then), so that it writes them without
        # asking. Each asked buffer by the hold _ask_idle took with it: another thread's
        # _copies_done may drop the entry's own reference meanwhile.
        asked = [a for a in _ask_idle(entries) if a[2].buf is not None]
        if asked:
            p = c._idle_begin([h.buf for _, _, h in asked])
            with _S.lock:
                _S.asking.append((c, p, asked))
        if t0:
            t0 = _step("send: share request", t0)
    finally:
        _copies_done(entries)
    return _Message((opts.spec(), b"".join(tokens), offs, sizes, devs, payload, batch.whole(), tix))


def _u64s(values, ctype=ctypes.c_uint64):
    """A ctypes array of 64-bit words (ctype: c_uint64, c_void_p or c_size_t) holding values,
    made in C (array) rather than element by element."""
    a = array.array("Q", values)
    return (ctype * len(a)).from_buffer(a)


def _copies_queued(packs, entries, storages, streams):
    """A message's copies are queued in streams (device index -> torch stream; packs and
    their entries as _send_batch made them): each target's hold is used in its stream (its
    release comes after the copy), and the sources stay referenced until an event recorded
    after the copies completes (_copies_forget lets them go)."""
    events = {}
    for (idx, _, _, dev), e in zip(packs, entries):
        if dev.type == "cuda":
            st = streams[dev.index]
            h = e.hold
            if h.streams != [st.cuda_stream]:  # made or last used in another stream
                h.used_in(st.cuda_stream)
            if dev.index not in events:
                events[dev.index] = torch.cuda.Event()
                events[dev.index].record(st)
    if events:
        with _S.lock:
            _S.copying.append((list(events.values()), [storages[i] for idx, _, _, _ in packs for i in idx]))


def _asked_read():
    """The answers to the Idle questions earlier messages asked (_send_batch): the kept copy
    buffers nobody else holds are marked idle, unless sent again meanwhile."""
    with _S.lock:
        asking, _S.asking = _S.asking, []
    for c, p, asked in asking:
        try:
            idle = c._idle_end(p, len(asked))
        except GpupoolError:
            continue  # their state stays unknown: asked again when a message needs them
        with _S.lock:
            for (e, used, _), ok in zip(asked, idle):
                if not e.busy and e.used == used:  # not sent meanwhile by another thread
                    e.idle = ok


def _copies_forget():
    """Let go of the storages of earlier messages whose copies have completed."""
    with _S.lock:
        if _S.copying:
            _S.copying = [m for m in _S.copying if not all(ev.query() for ev in m[0])]


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
        # the Share asks about the old ones, so the next message finds them known. But when
        # the message asks about some buffers anyway (a large one of unknown state), the small
        # ones go in the same Idle request: a state dict's second message would otherwise
        # allocate a new buffer for each of its small storages (new slabs, their imports on
        # both sides, memory kept twice) while the buffers of the first lie idle.
        later = []  # small keys: (their places left, their buffers of unknown state)
        for k, idx in wanted.items():
            lst = _S.cache.get(k, ())
            free = [e for e in lst if not e.busy and e.idle]
            unknown = [e for e in lst if not e.busy and not e.idle]
            if not (k[1] <= _SMALL and len(lst) < 2 * len(idx)):
                free += unknown
            elif len(free) < len(idx) and unknown:
                later.append((idx[len(free):], unknown))
            for i, e in zip(idx, free):
                e.busy = True
                picked[i] = e
        if later and any(e is not None and not e.idle for e in picked):
            for idx, unknown in later:
                for i, e in zip(idx, unknown):
                    e.busy = True
                    picked[i] = e
    cands = [i for i, e in enumerate(picked) if e is not None and not e.idle]
    if cands:
        try:
            # One Idle request names at most _BATCH_MAX buffers (the daemon's max_share_batch).
            idle = []
            for k in range(0, len(cands), _BATCH_MAX):
                idle += c._idle([picked[i].hold.buf for i in cands[k:k + _BATCH_MAX]])
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
        _copies_forget()
    _asked_read()
    with _S.lock:
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
