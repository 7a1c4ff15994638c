"""Bundle member tables and framework views of a bundle's members.

A bundle (a state dict, a batch) can have thousands of members, and the issue's budget for
handing over a 1,000-tensor dict is 5 ms with the framework views built. Everything here
therefore works on whole tables:

- Tables going to the C library (gpupool_member_spec, gpupool_member_ref and their
  gpupool_tensor_meta) are packed with the struct module into one ctypes buffer each, not
  filled field by field through ctypes (about 10 us a member).
- The table coming back (gpupool_member, from one gpupool_bundle_members call) is unpacked
  with struct.iter_unpack, and the member names (C strings) are read in one go through an
  array of char pointers rather than one ctypes.string_at call each.
- Framework views are slices of ONE import per buffer: the buffer is imported once through
  DLPack as a flat uint8 tensor ("region"), viewed once as each element type in use, and
  every member is an as_strided view of that. Members of the same type and shape that lie at
  equal distances (the 1,000 equal tensors, or layer i's q projection for every i of a model)
  form a run, viewed as one tensor of shape (k, *shape) and unbound: one C++ call for k
  views.

  Measured on an H100 host (torch 2.11, Python 3.11, 1,000 members; per member):
  region[a:b].view(dtype).view(shape) 9.0 us, narrow().view() 7.9 us, region_dt[a:b].view()
  7.1 us, Tensor.set_(storage, ...) 6.5 us, split_with_sizes + view 5.4 us,
  region_dt.as_strided(shape, strides, offset) 1.4-2.7 us, as_strided((k, ...)).unbind(0)
  0.87 us. Hence as_strided, and unbind for runs.
"""

import ctypes
import gc
import operator
import struct
import threading

from . import _dlpack, _dtypes, _lib
from ._errors import error, framework

__all__ = ["Layout", "Member", "parse_members", "plan_runs", "pack_specs", "pack_refs"]

_META = struct.Struct(_lib.META_FMT)
_SPEC = struct.Struct(_lib.SPEC_FMT)
_REF = struct.Struct(_lib.REF_FMT)
# gpupool_member without its strides (read separately for the few members that have them):
# name, ptr, size, has_meta, code, bits, lanes, ndim, shape[16], strides_present,
# byte_offset, buffer, offset.
_MEMBER_LEAN = struct.Struct("<QQQi4xBBHi16q128xi4xQi4xQ")
_STRIDES = struct.Struct("<16q")
_STRIDES_AT = _lib.Member.meta.offset + _lib.TensorMeta.strides.offset
MEMBER_SIZE = _MEMBER_LEAN.size
if MEMBER_SIZE != ctypes.sizeof(_lib.Member):
    raise ImportError("gpupool: the lean member format is %d bytes, gpupool_member %d" % (
        MEMBER_SIZE, ctypes.sizeof(_lib.Member)))
_UINT8 = _dtypes.dtype("uint8")
_ZEROS = (0,) * _lib.MAX_NDIM


class Member(tuple):
    """One member as the views need it: (name, part, offset, dtype, shape, strides, size).

    part: index of its buffer in the bundle; offset: bytes from that buffer's start to
    element 0; dtype: _dtypes.DType; strides: in elements, None when C-contiguous; size: the
    member's bytes. A member published without a description is its raw bytes (uint8)."""

    __slots__ = ()
    name = property(lambda s: s[0])
    part = property(lambda s: s[1])
    offset = property(lambda s: s[2])
    dtype = property(lambda s: s[3])
    shape = property(lambda s: s[4])
    strides = property(lambda s: s[5])
    size = property(lambda s: s[6])


def read_raw_names(addrs):
    """The C strings at these addresses as bytes, in one pass over an array of char*."""
    n = len(addrs)
    if n == 0:
        return []
    ptrs = (ctypes.c_void_p * n)(*addrs)
    return (ctypes.c_char_p * n).from_buffer(ptrs)[:]


class _NoGC:
    """Cyclic garbage collection paused while many objects are made at once: a
    collection that a 1,000-view dict happens to trigger walks every object of the
    interpreter (torch's included) and costs more than building the views."""

    __slots__ = ("was",)

    def __enter__(self):
        self.was = gc.isenabled()
        if self.was:
            gc.disable()

    def __exit__(self, *exc):
        if self.was:
            gc.enable()
        return False


class Layout:
    """A parsed member table: members (list of Member) and, computed once, their runs
    (plan_runs). Layouts are cached: the next version of a name, or the other buffer of a
    double-buffered pair, has the same table but for addresses, and is not parsed again."""

    __slots__ = ("key", "raw_names", "names", "members", "_runs", "_torch", "_torch_fast")

    def __init__(self, key, raw_names, members):
        self.key = key
        self.raw_names = raw_names
        self.names = [m[0] for m in members]
        self.members = members
        self._runs = None
        self._torch = None
        self._torch_fast = False  # not computed yet (None: no fast plan for this layout)

    @property
    def runs(self):
        if self._runs is None:
            self._runs = plan_runs(self.members)
        return self._runs

    def torch_plan(self, torch):
        """The runs as torch needs them, computed once per layout: (part, torch dtype or
        None when the members are imported alone, itemsize, shape, strides, offset and
        step in elements, member indices)."""
        if self._torch is None:
            plan = []
            for part, dt, shape, strides, off, step, idx, alone in self.runs:
                tdt = getattr(torch, dt.name, None) if (dt.typestr or
                                                        dt.name == "bfloat16") else None
                if alone or not isinstance(tdt, torch.dtype):
                    tdt = None
                isz = dt.itemsize
                st = strides if strides is not None else _dlpack.contiguous_strides(shape)
                plan.append((part, tdt, isz, shape, st, off // isz, step // isz, tuple(idx)))
            self._torch = plan
        return self._torch

    def torch_fast(self, torch):
        """The plan of torch_views' fast path, computed once per layout, or None when some
        member must be imported alone: (regions, steps, pick). regions: the (part, torch
        dtype, itemsize) to view each buffer as; steps: (region index, size, stride,
        offset, unbind) for one as_strided call each (unbind: a run of several, viewed as
        one tensor and unbound); pick(flat): the views in member order from the list that
        the steps make, one C call (operator.itemgetter)."""
        if self._torch_fast is False:
            self._torch_fast = _torch_fast(self.torch_plan(torch), len(self.members))
        return self._torch_fast


_Q_PER_MEMBER = MEMBER_SIZE // 8
_cache = []  # type: list  # the last few Layouts, most recent first
_cache_lock = threading.Lock()
_CACHE_SIZE = 4


def parse_members(raw, n):
    """The Layout of a gpupool_member table (raw: a buffer holding n records). Offsets are
    counted from the start of each member's buffer (member.offset + meta.byte_offset), so a
    layout does not depend on where the buffers are mapped."""
    nbytes = n * MEMBER_SIZE
    view = memoryview(raw).cast("B")[:nbytes]
    # The table less its two address columns (name, ptr) identifies the layout.
    key = bytearray(view)
    if n:
        q = memoryview(key).cast("Q")
        zeros = memoryview(bytes(8 * n)).cast("Q")
        q[0::_Q_PER_MEMBER] = zeros
        q[1::_Q_PER_MEMBER] = zeros
    raw_names = read_raw_names(view.cast("Q")[0::_Q_PER_MEMBER].tolist() if n else [])
    with _cache_lock:
        for i, lay in enumerate(_cache):
            if lay.key == key and lay.raw_names == raw_names:
                if i:
                    _cache.insert(0, _cache.pop(i))
                return lay
    names = [b.decode("utf-8", "surrogateescape") for b in raw_names]
    lay = Layout(key, raw_names, _parse(view, names))
    with _cache_lock:
        _cache.insert(0, lay)
        del _cache[_CACHE_SIZE:]
    return lay


def _parse(view, names):
    by_code = _dtypes._BY_CODE
    out = []
    append = out.append
    for i, r in enumerate(_MEMBER_LEAN.iter_unpack(view)):
        base = r[27]
        if not r[3]:
            append(Member((names[i], r[26], base, _UINT8, (r[2],), None, r[2])))
            continue
        nd = r[7]
        dt = by_code.get((r[4], r[5], r[6])) or _dtypes.from_dlpack_code(r[4], r[5], r[6])
        strides = None
        if r[24]:
            strides = _STRIDES.unpack_from(view, i * MEMBER_SIZE + _STRIDES_AT)[:nd]
            if _dlpack._is_contiguous(r[8:8 + nd], strides):
                strides = None
        append(Member((names[i], r[26], base + r[25], dt, r[8:8 + nd], strides, r[2])))
    return out


def plan_runs(members):
    """Group members into runs viewable as one (k, *shape) tensor each.

    A run is [part, dtype, shape, strides, offset of its first member, step in bytes,
    member indices, alone]: members of one buffer, type, shape and strides at offsets
    first, first + step, first + 2 step, ... alone=True marks a member that cannot be
    viewed from a typed region (offset not a multiple of its element size, negative
    strides): the caller imports it on its own. Runs come in the order of their first
    member.

    Members of one kind need not be next to each other nor evenly spaced in table order:
    a model's layers interleave them (layer i's q and o projections have one shape, its two
    norms another), so the offsets of a kind repeat with a period p (q0, o0, q1, o1, ...:
    p = 2) and make p runs, one per position in the period. Each kind is cut into the
    fewest such runs: per layout once, so that viewing a version costs a call or two per
    run instead of per member (146 members of a Llama state dict: 12 runs, not 66)."""
    runs = []
    groups = {}
    for i, m in enumerate(members):
        name, part, off, dt, shape, strides, _ = m
        isz = dt.itemsize
        if isz == 0 or off % isz or (strides is not None and min(strides, default=0) < 0):
            runs.append((i, [part, dt, shape, strides, off, 0, [i], True]))
            continue
        g = groups.get((part, dt, shape, strides))
        if g is None:
            g = groups[(part, dt, shape, strides)] = []
        g.append(i)
    for (part, dt, shape, strides), idx in groups.items():
        offs = [members[i][2] for i in idx]
        isz = dt.itemsize
        j = 0
        n = len(idx)
        while j < n:
            p, m = _period(offs, j, isz)
            if m < 2 * p:  # no run here: one member alone
                runs.append((idx[j], [part, dt, shape, strides, offs[j], 0, [idx[j]], False]))
                j += 1
                continue
            step = offs[j + p] - offs[j]
            for r in range(p):
                sel = idx[j + r:j + m:p]
                runs.append((sel[0], [part, dt, shape, strides, offs[j + r], step, sel,
                                      False]))
            j += m
    runs.sort(key=lambda r: r[0])
    return [r for _, r in runs]


_MAX_PERIOD = 8


def _period(offs, j, isz):
    """(p, m): the period p (1.._MAX_PERIOD) that covers the most offsets from j on, m of
    them, as p evenly spaced sequences with one positive step (a multiple of isz) each;
    m is a multiple of p."""
    best_p, best_m = 1, 1
    n = len(offs) - j
    for p in range(1, min(_MAX_PERIOD, n // 2) + 1):
        step = offs[j + p] - offs[j]
        if step <= 0 or step % isz:
            continue
        k = j + p
        while k < j + n and offs[k] - offs[k - p] == step:
            k += 1
        m = (k - j) // p * p
        if m > best_m and m >= 2 * p:
            best_p, best_m = p, m
    return best_p, best_m


def _torch_fast(plan, n):
    if any(tdt is None for _, tdt, *_ in plan):
        return None
    keys, steps, pos = {}, [], [0] * n
    at = 0
    for part, tdt, isz, shape, st, off, step, idx in plan:
        ri = keys.setdefault((part, tdt, isz), len(keys))
        if len(idx) == 1:
            steps.append((ri, shape, st, off, False))
        else:
            steps.append((ri, (len(idx),) + shape, (step,) + st, off, True))
        for i in idx:
            pos[i] = at
            at += 1
    if n == 1:
        pick = lambda flat: (flat[pos[0]],)  # noqa: E731  itemgetter of one is not a tuple
    else:
        pick = operator.itemgetter(*pos)
    return list(keys), steps, pick


# --- framework views -----------------------------------------------------------------------
def torch_views(layout, region_of, alone_view):
    """name -> torch tensor for every member. region_of(part): the buffer as a flat uint8
    torch tensor (imported once); alone_view(i): member i imported on its own."""
    torch = framework("torch", "TensorDict.torch()")

    fast = layout.torch_fast(torch)
    if fast is not None and layout.members:
        regions, steps, pick = fast
        with _NoGC():
            typed = {}
            regs = [_typed_region(torch, typed, region_of, part, tdt, isz)
                    for part, tdt, isz in regions]
            flat = []
            for ri, size, stride, off, unbind in steps:
                if unbind:
                    flat.extend(regs[ri].as_strided(size, stride, off).unbind(0))
                else:
                    flat.append(regs[ri].as_strided(size, stride, off))
            return dict(zip(layout.names, pick(flat)))
    plan = layout.torch_plan(torch)
    n = len(layout.members)
    with _NoGC():
        typed = {}
        if len(plan) == 1 and plan[0][1] is not None and len(plan[0][7]) == n > 1:
            # One run of every member in order (equal tensors): one call makes them all.
            part, tdt, isz, shape, st, off, step, idx = plan[0]
            r = _typed_region(torch, typed, region_of, part, tdt, isz)
            return dict(zip(layout.names,
                            r.as_strided((n,) + shape, (step,) + st, off).unbind(0)))
        views = [None] * n
        for part, tdt, isz, shape, st, off, step, idx in plan:
            if tdt is None:
                for i in idx:
                    views[i] = alone_view(i)
                continue
            r = _typed_region(torch, typed, region_of, part, tdt, isz)
            if len(idx) == 1:
                views[idx[0]] = r.as_strided(shape, st, off)
            else:
                for i, v in zip(idx, r.as_strided((len(idx),) + shape, (step,) + st,
                                                  off).unbind(0)):
                    views[i] = v
        return dict(zip(layout.names, views))


def _typed_region(torch, typed, region_of, part, tdt, isz):
    """Buffer `part` as a flat tensor of type tdt (imported once per call of torch_views)."""
    key = (part, tdt)
    r = typed.get(key)
    if r is None:
        r8 = typed.get(part)
        if r8 is None:
            r8 = typed[part] = region_of(part)
        r = r8
        if tdt is not torch.uint8:
            n = r8.shape[0]
            r = (r8[:n - n % isz] if n % isz else r8).view(tdt)
        typed[key] = r
    return r


def _run_type_and_region(members, dt, idx, part, raw, lib, method, regions, region_of):
    """The array-interface type of a run (its raw unsigned type with raw=True when `lib` lacks
    it, else TypeError naming the member) and its buffer's region, imported once per part."""
    typestr = dt.typestr
    if typestr is None:
        if not raw:
            raise TypeError("member %r is %s, which %s lacks: use %s(raw=True) for its bits, "
                            "or torch()" % (members[idx[0]][0], dt.name, lib, method))
        typestr = dt.raw_typestr
    r = regions.get(part)
    if r is None:
        r = regions[part] = region_of(part)
    return typestr, r


def numpy_views(layout, region_of, raw=False):
    """name -> NumPy array for every member (host memory). region_of(part): the buffer as a
    flat uint8 array. raw=True views types NumPy lacks (bfloat16) as unsigned integers of
    their size."""
    numpy = framework("numpy", "TensorDict.numpy()")

    with _NoGC():
        return _numpy_views(numpy, layout, region_of, raw)


def _numpy_views(numpy, layout, region_of, raw):
    members = layout.members
    views = [None] * len(members)
    regions = {}
    for part, dt, shape, strides, off, step, idx, alone in layout.runs:
        typestr, r = _run_type_and_region(members, dt, idx, part, raw, "NumPy", "numpy",
                                          regions, region_of)
        isz = dt.itemsize
        bst = None if strides is None else tuple(s * isz for s in strides)
        if alone and strides is not None and min(strides, default=0) < 0:
            # NumPy takes negative strides from an explicit base: place element 0 by offset.
            for i in idx:
                m = members[i]
                views[i] = numpy.ndarray(m[4], typestr, r, m[2], bst)
            continue
        if len(idx) == 1 or alone:
            for i in idx:
                views[i] = numpy.ndarray(shape, typestr, r, members[i][2], bst)
            continue
        if bst is None:
            bst = tuple(s * isz for s in _dlpack.contiguous_strides(shape))
        many = numpy.ndarray((len(idx),) + shape, typestr, r, off, (step,) + bst)
        if shape:
            for i, v in zip(idx, many):
                views[i] = v
        else:
            for j, i in enumerate(idx):
                views[i] = many[j, ...]
    return dict(zip(layout.names, views))


def cupy_views(layout, region_of, raw=False):
    """name -> CuPy array for every member (device memory). region_of(part): the buffer as a
    flat uint8 CuPy array (imported once)."""
    cupy = framework("cupy", "TensorDict.cupy()")

    with _NoGC():
        return _cupy_views(cupy, layout, region_of, raw)


def _cupy_views(cupy, layout, region_of, raw):
    members = layout.members
    views = [None] * len(members)
    regions = {}
    for part, dt, shape, strides, off, step, idx, alone in layout.runs:
        typestr, r = _run_type_and_region(members, dt, idx, part, raw, "CuPy", "cupy",
                                          regions, region_of)
        isz = dt.itemsize
        st = strides if strides is not None else _dlpack.contiguous_strides(shape)
        bst = tuple(s * isz for s in st)
        for i in idx:
            m = members[i]
            views[i] = cupy.ndarray(shape, typestr, r.data + m[2], bst)
    return dict(zip(layout.names, views))


# --- tables to the C library ---------------------------------------------------------------
def _names(bnames):
    """A char* array holding the names, and the names' addresses."""
    arr = (ctypes.c_char_p * len(bnames))(*bnames)
    return arr, (ctypes.c_void_p * len(bnames)).from_buffer(arr)[:]


def pack_metas(metas):
    """gpupool_tensor_meta[n] from (dtype, shape, strides or None, byte_offset) tuples."""
    buf = ctypes.create_string_buffer(max(len(metas), 1) * _META.size)
    pack = _META.pack_into
    size = _META.size
    for i, (dt, shape, strides, byte_offset) in enumerate(metas):
        nd = len(shape)
        if nd > _lib.MAX_NDIM:
            raise error("EMETA", "tensor has %d dimensions; gpupool carries at most %d"
                        % (nd, _lib.MAX_NDIM))
        sh = tuple(shape) + _ZEROS[nd:]
        if strides is None or _dlpack._is_contiguous(shape, strides):
            pack(buf, i * size, dt.code, dt.bits, dt.lanes, nd, *sh, *_ZEROS, 0, byte_offset)
        else:
            st = tuple(strides) + _ZEROS[nd:]
            pack(buf, i * size, dt.code, dt.bits, dt.lanes, nd, *sh, *st, 1, byte_offset)
    return buf


def pack_specs(bnames, sizes, metas):
    """gpupool_member_spec[n]; returns (table, keepalive)."""
    names, addrs = _names(bnames)
    mbuf = pack_metas(metas)
    mbase = ctypes.addressof(mbuf)
    buf = ctypes.create_string_buffer(max(len(bnames), 1) * _SPEC.size)
    for i in range(len(bnames)):
        _SPEC.pack_into(buf, i * _SPEC.size, addrs[i], sizes[i], mbase + i * _META.size)
    return buf, (names, mbuf)


def pack_refs(bnames, buffers, offsets, sizes, metas):
    """gpupool_member_ref[n] (buffers: gpupool_buffer* as ints); returns (table, keepalive)."""
    names, addrs = _names(bnames)
    mbuf = pack_metas(metas)
    mbase = ctypes.addressof(mbuf)
    buf = ctypes.create_string_buffer(max(len(bnames), 1) * _REF.size)
    for i in range(len(bnames)):
        _REF.pack_into(buf, i * _REF.size, addrs[i], buffers[i], offsets[i], sizes[i],
                       mbase + i * _META.size)
    return buf, (names, mbuf)
