"""Sharded versions and refit plans (include/gpupool/refit.h) for Python.

A trainer rank publishes its slices of every weight as one part of a version::

    c.publish_shard("policy", {"layers.0.mlp.down_proj.weight": (t, (slice(0, 2048), slice(None)),
                                                                 (4096, 14336))},
                    rank=r, world=4, version=step)

The version appears to readers once every rank's part is in. An inference engine names its
own tensors and the slices of global tensors each holds, once, and refits them in place for
every later version::

    plan = c.refit_plan("policy", {
        "qkv": (qkv_param, [("q", (slice(q0, q1),)), ("k", (slice(k0, k1),)),
                            ("v", (slice(k0, k1),))]),                         # fused, dim 0
        "o": (o_param, [("o", (slice(None), slice(q0, q1)))], 1),           # row-parallel
    })
    version = plan.refit()          # the newest version, written into the tensors in place

The plan and the copies are the C library's (gpupool_refit_plan, gpupool_refit): this module
describes tensors (NumPy, torch, anything with DLPack) and calls it.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, Mapping, Sequence, Tuple

from . import _dlpack, _lib
from ._errors import error
from ._lib import check
from ._util import _encode_name, stream_handle

PARTS_MAX = 1024
REFIT_DEVICE = 0x1

_u64 = ctypes.c_uint64
_int = ctypes.c_int
_vp = ctypes.c_void_p


class RefitPiece(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("start", ctypes.c_int64 * _lib.MAX_NDIM),
                ("length", ctypes.c_int64)]


class RefitTarget(ctypes.Structure):
    _fields_ = [("ptr", _vp), ("meta", _lib.TensorMeta), ("dim", _int),
                ("pieces", ctypes.POINTER(RefitPiece)), ("npieces", _int)]


class PlanInfo(ctypes.Structure):
    _fields_ = [(f, _u64) for f in ("layout_id", "copies", "bytes", "cast_copies", "plans",
                                    "refits", "gathered")]


class _PlanHandle(ctypes.Structure):
    """Opaque gpupool_plan."""


_PlanP = ctypes.POINTER(_PlanHandle)

# The functions of refit.h, declared on the library the first time they are used.
_PROTOTYPES = {
    "gpupool_shard_member_name": (_int, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, _int, _int,
                                         ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
                                         ctypes.POINTER(ctypes.c_int64)]),
    "gpupool_bundle_publish_part": (_int, [_lib.BundleP, ctypes.c_char_p, _u64, _int, _int, _vp,
                                           ctypes.POINTER(_int)]),
    "gpupool_bundle_publish_members_part": (_int, [_lib.ClientP, ctypes.c_char_p, _u64, _int, _int, _vp,
                                                   _int, _vp, ctypes.POINTER(_int)]),
    "gpupool_refit_plan": (_int, [_lib.BundleP, ctypes.POINTER(RefitTarget), _int, ctypes.c_uint,
                                  ctypes.POINTER(_PlanP)]),
    "gpupool_refit": (_int, [_PlanP, _lib.BundleP, _vp]),
    "gpupool_plan_info_get": (_int, [_PlanP, ctypes.POINTER(PlanInfo)]),
    "gpupool_plan_free": (None, [_PlanP]),
}
_declared = None
_declare_lock = threading.Lock()


def _L():
    global _declared
    L = _lib.lib()
    if _declared is not L:
        with _declare_lock:
            for name, (res, args) in _PROTOTYPES.items():
                f = getattr(L, name)
                f.restype, f.argtypes = res, args
            _declared = L
    return L


def _int64s(values):
    return (ctypes.c_int64 * max(len(values), 1))(*values)


def _slice_bounds(slices, shape, what):
    """(start, stop) per dimension of `shape` from a tuple of slices (None = the whole
    dimension); ints are taken as slice(i, i + 1) would be, keeping the dimension."""
    if slices is None or slices is Ellipsis:
        slices = ()
    if not isinstance(slices, (tuple, list)):
        slices = (slices,)
    if len(slices) > len(shape):
        raise error("EINVAL", "%s: %d slices for %d dimensions" % (what, len(slices), len(shape)))
    out = []
    for d, n in enumerate(shape):
        s = slices[d] if d < len(slices) else slice(None)
        if isinstance(s, int):
            s = slice(s, s + 1)
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise error("EINVAL", "%s: dimension %d: %r is not a slice with step 1" % (what, d, s))
        lo = 0 if s.start is None else int(s.start)
        hi = n if s.stop is None else int(s.stop)
        out.append((lo, hi))
    return out


def shard_member_name(key: str, part: int, global_shape: Sequence[int], start: Sequence[int],
                      shape: Sequence[int]) -> str:
    """The member name a slice of global tensor `key` held by `part` is published under."""
    L = _L()
    buf = ctypes.create_string_buffer(_lib.NAME_MAX + 1)
    nd = len(global_shape)
    check(L.gpupool_shard_member_name(buf, len(buf), _encode_name(key, "shard key"), int(part), nd,
                                      _int64s(global_shape), _int64s(start), _int64s(shape)),
          "shard of %r" % (key,))
    return buf.value.decode()


def publish_shard(client, name: str, shards: Mapping[str, Any], rank: int | None = None,
                  world: int | None = None, version: int | None = None, stream: Any = None,
                  pool: str | None = None) -> bool:
    """Client.publish_shard: see there."""
    nb = _encode_name(name)
    if version is None:
        raise error("EINVAL", "publish_shard %r: give the version (the trainer's step)" % (name,))
    from . import _dtensor

    if any(_dtensor.is_dtensor(v[0] if isinstance(v, (tuple, list)) and v else v)
           for v in shards.values()):
        what = "publish_shard %r of DTensors" % (name,)
        if rank is not None or world is not None:
            raise error("EINVAL", "%s: the DTensors' meshes and placements say which rank "
                        "publishes what; leave rank and world out" % what)
        rank, world, shards = _dtensor.shard_part(shards, what)
        if rank is None:  # every slice of this rank is empty or another rank's to publish
            return False
    elif rank is None or world is None:
        raise error("EINVAL", "publish_shard %r: give rank and world (or DTensors, which say "
                    "them)" % (name,))
    what = "publish_shard %r part %d of %d" % (name, rank, world)
    if not 0 <= rank < world <= PARTS_MAX:
        raise error("EINVAL", "%s: rank 0..world-1, world 1..%d" % (what, PARTS_MAX))
    if int(version) < 1:
        raise error("EINVAL", "%s: versions are 1 or more" % what)
    items = list(shards.items())
    if not items:
        raise error("EINVAL", "%s: a part needs at least one slice" % what)
    s = stream_handle(stream)
    from ._client_args import _HoldIndex, _describe, _torch_desc
    from ._tensor import Tensor
    from ._util import _framework

    index = _HoldIndex(client._holds)
    rows = []
    for key, spec in items:
        if not isinstance(spec, (tuple, list)) or len(spec) not in (1, 2, 3):
            raise error("EINVAL", "%s: %r: give (tensor,), (tensor, slices) or (tensor, slices, "
                        "global_shape)" % (what, key))
        tensor = spec[0]
        hold = None
        if isinstance(tensor, Tensor) and tensor._client is client and not tensor.released \
                and not tensor.read_only and min(tensor.strides, default=0) >= 0:
            hold = tensor._hold
            desc = _dlpack.Desc(tensor.data_ptr, tensor._dl_device, tensor._dtype, tensor.shape,
                                tensor.strides)
        else:
            desc = _torch_desc(tensor) if _framework(tensor) == "torch" else None
            if desc is None:
                desc, s = _describe(tensor, s)
            hold = index.find(desc)
        local = desc.shape
        bounds = _slice_bounds(spec[1] if len(spec) > 1 else None, local, "%s: %r" % (what, key))
        start = [lo for lo, _ in bounds]
        if len(spec) > 2 and spec[2] is not None:
            gshape = [int(n) for n in spec[2]]
        else:  # no global shape: the slice's stops are the ends of the tensor
            gshape = [hi for _, hi in bounds]
        for d, ((lo, hi), n) in enumerate(zip(bounds, local)):
            if hi - lo != n:
                raise error("EINVAL", "%s: %r: dimension %d, slice %d:%d holds %d, the tensor %d"
                            % (what, key, d, lo, hi, hi - lo, n))
        member = shard_member_name(key, rank, gshape, start, local)
        rows.append([member.encode(), hold, desc, tensor])
    copies = [r for r in rows if r[1] is None]
    tmp = client._copy_bundle(copies, s, pool, what) if copies else None
    done = _int(0)
    try:
        if len(copies) == len(rows):  # all copied, in order: the new bundle is the part
            client._conn.usable()
            check(_L().gpupool_bundle_publish_part(tmp._bhold.bundle, nb, int(version), int(rank),
                                                  int(world), s, ctypes.byref(done)), what)
            return bool(done.value)
        # Slices already in gpupool memory of this client are published in place (the rest
        # from the copies), one hold per buffer.
        from . import _bundle

        copied = iter(tmp._copied if tmp is not None else ())
        by_buffer: Dict[Any, Any] = {}
        bnames, bufs, offs, sizes, metas = [], [], [], [], []
        for bk, h, desc, _ in rows:
            if h is None:
                h, desc = next(copied)
            h = by_buffer.setdefault((h.buffer_id, h.ptr), h)
            lo, span = desc.span()
            start = desc.data + lo
            off = start - h.ptr
            if span == 0:
                off, span = min(off, h.size - 1), 1
            bnames.append(bk)
            bufs.append(ctypes.cast(h.buf, ctypes.c_void_p).value)
            offs.append(off)
            sizes.append(span)
            metas.append((desc.dtype, desc.shape, desc.strides, desc.data - start))
        table, keep = _bundle.pack_refs(bnames, bufs, offs, sizes, metas)
        check(_L().gpupool_bundle_publish_members_part(client._conn.usable(), nb, int(version),
                                                      int(rank), int(world), table, len(bnames),
                                                      s, ctypes.byref(done)), what)
        del keep
        return bool(done.value)
    finally:
        if tmp is not None:
            tmp.release()  # the pending version holds what it needs


class RefitPlan:
    """The copies from a version's layout into an engine's own tensors (Client.refit_plan).

    ``refit()`` writes the next version into them in place and returns its number;
    ``info()`` says what the plan does; ``close()`` frees it (also on garbage collection).
    The target tensors are kept alive by the plan."""

    def __init__(self, client, name, keep, plan, version):
        self._client = client
        self._name = name
        self._keep = keep
        self._plan = plan
        self.version = 0  # the version last written into the targets
        self.planned_at = version

    def refit(self, newer_than: int | None = None, timeout: float | None = None,
              stream: Any = None) -> int:
        """Wait for a version newer than `newer_than` (None: newer than the one last
        written, any for the first), write it into the targets in place, and return its
        number. timeout: seconds (None = forever, 0 = ENOENT at once). A version of another
        layout is planned again first (``info()["plans"]`` counts it)."""
        from ._client_args import _timeout_ms

        if self._plan is None:
            raise error("EINVAL", "refit: the plan was closed")
        L = _L()
        s = stream_handle(stream)
        newer = self.version if newer_than is None else int(newer_than)
        b = _lib.BundleP()
        # KEEP_MAPPED: the versions come again and again in the same slabs (a trainer that
        # double-buffers, or slabs the pool reuses): no import per version once they are mapped.
        check(L.gpupool_bundle_get(self._client._conn.usable(), self._name, newer,
                                   _timeout_ms(timeout, forever=True),
                                   _lib.READ_ONLY | _lib.KEEP_MAPPED, s, ctypes.byref(b)),
              "refit %r newer than version %d" % (self._name.decode(), newer))
        try:
            version = L.gpupool_bundle_version(b)
            check(L.gpupool_refit(self._plan, b, s), "refit %r version %d"
                  % (self._name.decode(), version))
        finally:
            L.gpupool_bundle_release(b, s)
        self.version = version
        return version

    def info(self) -> Dict[str, int]:
        """layout_id, copies, bytes (written per refit), cast_copies, plans (times the
        copies were computed), refits, gathered (copies the last device refit did in the
        gather kernel)."""
        if self._plan is None:
            raise error("EINVAL", "info: the plan was closed")
        out = PlanInfo()
        check(_L().gpupool_plan_info_get(self._plan, ctypes.byref(out)))
        return {f: getattr(out, f) for f, _ in PlanInfo._fields_}

    def close(self) -> None:
        if self._plan is not None:
            _L().gpupool_plan_free(self._plan)
            self._plan = None
            self._keep = None

    def __enter__(self) -> RefitPlan:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except BaseException:
            pass


def _target(name, spec, keep):
    """A RefitTarget (and what must stay alive for it) from name -> (tensor, pieces[, dim])."""
    what = "refit target %r" % (name,)
    from . import _dtensor

    dt = _dtensor.refit_target(name, spec, what)
    if dt is not None:  # its local shard, in place
        tensor, pieces, dim = dt
        if pieces is None:
            return None, False  # this rank holds no element of it
    elif not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
        raise error("EINVAL", "%s: give (tensor, pieces), (tensor, pieces, dim) or a DTensor"
                    % what)
    else:
        tensor, pieces = spec[0], spec[1]
        dim = int(spec[2]) if len(spec) > 2 else 0
    from ._client_args import _describe, _meta

    desc, _ = _describe(tensor, None)
    if desc.read_only:
        raise error("EINVAL", "%s: the tensor is read-only" % what)
    if isinstance(pieces, (str, bytes)):
        pieces = [pieces]
    pieces = list(pieces)
    if not pieces:
        raise error("EINVAL", "%s: no pieces" % what)
    arr = (RefitPiece * len(pieces))()
    keys = []
    nd = len(desc.shape)
    for j, p in enumerate(pieces):
        key, slices = (p, None) if isinstance(p, (str, bytes)) else (p[0], p[1] if len(p) > 1 else None)
        kb = key if isinstance(key, bytes) else _encode_name(key, "refit key")
        keys.append(kb)
        arr[j].key = kb
        if slices is None:
            slices = ()
        if not isinstance(slices, (tuple, list)):
            slices = (slices,)
        if len(slices) > nd:
            raise error("EINVAL", "%s, piece %d: %d slices for %d dimensions" % (what, j, len(slices), nd))
        for d in range(nd):
            sl = slices[d] if d < len(slices) else slice(None)
            if isinstance(sl, int):
                sl = slice(sl, sl + 1)
            if not isinstance(sl, slice) or sl.step not in (None, 1):
                raise error("EINVAL", "%s, piece %d: dimension %d: %r is not a slice with step 1"
                            % (what, j, d, sl))
            arr[j].start[d] = 0 if sl.start is None else int(sl.start)
            if d == dim and sl.stop is not None:
                arr[j].length = int(sl.stop) - arr[j].start[d]
    t = RefitTarget()
    t.ptr = desc.data
    t.meta = _meta(desc.dtype, desc.shape, desc.strides, 0)
    t.dim = dim
    t.pieces = arr
    t.npieces = len(pieces)
    keep.extend([spec, tensor, arr, keys])
    return t, desc.device[0] == _dlpack.kDLCUDA


def refit_plan(client, name: str, targets: Mapping[str, Any] | Sequence[Tuple[str, Any]],
               newer_than: int = 0, timeout: float | None = None) -> RefitPlan:
    """Client.refit_plan: see there."""
    from ._client_args import _timeout_ms

    L = _L()
    nb = _encode_name(name)
    items = list(targets.items()) if hasattr(targets, "items") else list(targets)
    if not items:
        raise error("EINVAL", "refit_plan %r: no targets" % (name,))
    keep: list = []
    made = []
    device = False
    for tname, spec in items:
        t, on_gpu = _target(tname, spec, keep)
        if t is not None:
            made.append(t)
            device |= on_gpu
    if not made:
        raise error("EINVAL", "refit_plan %r: every target is a DTensor whose local shard is empty "
                    "on this rank: nothing to fill" % (name,))
    arr = (RefitTarget * len(made))(*made)
    keep.append(arr)
    b = _lib.BundleP()
    check(L.gpupool_bundle_get(client._conn.usable(), nb, int(newer_than),
                               _timeout_ms(timeout, forever=True), _lib.READ_ONLY, None,
                               ctypes.byref(b)), "refit_plan %r" % (name,))
    plan = _PlanP()
    try:
        version = L.gpupool_bundle_version(b)
        check(L.gpupool_refit_plan(b, arr, len(made), REFIT_DEVICE if device else 0,
                                   ctypes.byref(plan)), "refit_plan %r version %d" % (name, version))
    finally:
        L.gpupool_bundle_release(b, None)
    return RefitPlan(client, nb, keep, plan, version)
