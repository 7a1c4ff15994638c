"""TensorDict: a bundle of tensors (member name -> Tensor) and the framework views built
from it, one import per buffer."""

from __future__ import annotations

from typing import Any, Dict, Iterator, KeysView, Literal, Mapping, Optional, Tuple

from . import _bundle, _dlpack, _dtypes, _lib
from ._errors import error, framework
from ._tensor import Tensor

# get_dict(reuse_views=True): how many bundles' views a client keeps (two alternate under
# double buffering; a few more for several names).
_VIEWS_KEPT = 4


class TensorDict(Mapping[str, Tensor]):
    """A bundle: member name -> Tensor, in member order (a read-only Mapping).

    From ``Client.alloc_dict`` (to produce into, then ``Client.publish_dict``) or
    ``Client.get_dict`` (a version of a published name). Values are gpupool Tensors viewing
    the bundle's memory (DLPack, ``__array_interface__``), made on first access. For many
    members at once use ``torch()``, ``cupy()`` or ``numpy()``: a plain dict of framework
    views built from one import per buffer, far cheaper than importing member by member.

    The bundle's memory is released by ``release()``, a ``with`` block, or garbage
    collection, and only once no member Tensor or framework view made from it is alive.

    Attributes: name (the published name, None for an allocation), version (0 for an
    allocation), read_only, nbytes (sum of the members' sizes), buffers (how many buffers
    the members lie in).
    """

    def __init__(self, client, bhold, parts, layout, version, name):
        self._client = client
        self._bhold = bhold
        self._parts = parts
        self._layout = layout
        self._members = layout.members
        self._index = None
        self._tensors = {}
        self.version = version
        self.name = name
        self.read_only = any(p.read_only for p in parts)
        self.buffers = len(parts)
        self._reuse = False  # get_dict(reuse_views=True)

    # Compared and hashed as the object it is (Mapping's content equality would compare
    # Tensors, which mean memory, not values).
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    # --- Mapping ----------------------------------------------------------------------
    def _names(self):
        # name -> index, made on first use (torch() and friends need none).
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self._layout.names)}
        return self._index

    def __getitem__(self, key: str) -> Tensor:
        t = self._tensors.get(key)
        if t is not None:
            return t
        i = self._names()[key]
        t = self._member_tensor(i)
        self._tensors[key] = t
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, key: object) -> bool:
        return key in self._names()

    def keys(self) -> KeysView[str]:
        return self._names().keys()

    def _member_tensor(self, i):
        self._live()
        name, part, off, dt, shape, strides, _ = self._members[i]
        t = self._client._tensor(self._parts[part], dt, shape, strides, off, name)
        t.version = self.version
        return t

    def _live(self):
        bh = self._bhold
        if bh is None or bh.released:
            raise error("EINVAL", "tensor dict %r was released; get or allocate it again"
                        % (self.name,))
        return bh

    # --- description ------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(m[6] for m in self._members)

    @property
    def released(self) -> bool:
        return self._bhold is None or self._bhold.released

    def member_info(self, key: str) -> Tuple[str, Tuple[int, ...], Optional[Tuple[int, ...]], int, int]:
        """(dtype name, shape, strides or None, buffer index, byte offset in the buffer)."""
        name, part, off, dt, shape, strides, _ = self._members[self._names()[key]]
        return dt.name, shape, strides, part, off

    def __repr__(self) -> str:
        return "<gpupool.TensorDict%s version=%d members=%d bytes=%d%s%s>" % (
            " %r" % self.name if self.name else "", self.version, len(self._members),
            self.nbytes, " read-only" if self.read_only else "",
            " released" if self.released else "")

    # --- framework views --------------------------------------------------------------
    def _region(self, part):
        """The whole buffer `part` as a flat uint8 Tensor, to import once."""
        self._live()
        p = self._parts[part]
        return Tensor(p, _UINT8, (p.size,), None, 0, self.name, self._client)

    def torch(self) -> Dict[str, Any]:
        """A plain dict name -> torch.Tensor, views of the bundle's memory (no copy), in
        member order. Each buffer is imported once (torch.from_dlpack, on torch's current
        stream, which is made to wait for the producer) and every member is a view of it;
        the views keep the memory alive after this TensorDict is released."""
        torch = framework("torch", "TensorDict.torch()")

        self._live()

        def build():
            return _bundle.torch_views(
                self._layout, lambda part: torch.from_dlpack(self._region(part)),
                lambda i: torch.from_dlpack(self._member_tensor(i)))

        cuda = [p for p in self._parts if p.kind != _lib.MEM_HOST]

        def current_stream():
            return torch.cuda.current_stream(cuda[0].cuda_device).cuda_stream if cuda else None

        if not self._reuse:
            views = _take_ahead(self, current_stream)
            if views is not None:
                return views
        return self._reused_views("torch", build, current_stream)

    def _reused_views(self, framework, build, current_stream):
        """build(), or with reuse_views the views built earlier for the same memory laid out
        the same way: the same buffers (a buffer id names one allocation for the daemon's
        life, and the cached views keep theirs alive) and the same layout object. A reused
        view costs nothing to make; the stream the framework works on now is made to wait for
        this version's producer, as a fresh import would make it."""
        if not self._reuse:
            return build()
        client = self._client
        key = (framework, self._layout, self.read_only,
               tuple((p.buffer_id, p.ptr, p.size) for p in self._parts))
        with client._views_lock:
            views = client._views.get(key)
            if views is not None:
                client._views.move_to_end(key)
        if views is not None:
            _made_ready(self._parts, current_stream())
            return dict(views)
        views = build()
        with client._views_lock:
            client._views[key] = views
            while len(client._views) > _VIEWS_KEPT:
                client._views.popitem(last=False)
        return dict(views)

    def cupy(self, raw: bool = False) -> Dict[str, Any]:
        """A plain dict name -> cupy.ndarray (device memory), as torch() does for torch.
        raw=True views types CuPy lacks (bfloat16) as unsigned integers of their size."""
        cupy = framework("cupy", "TensorDict.cupy()")

        self._live()
        return _bundle.cupy_views(self._layout,
                                  lambda part: cupy.from_dlpack(self._region(part)), raw)

    def numpy(self, raw: bool = False) -> Dict[str, Any]:
        """A plain dict name -> numpy.ndarray (host memory), as torch() does for torch.
        raw=True views types NumPy lacks (bfloat16) as unsigned integers of their size."""
        self._live()
        return self._reused_views(
            "numpy-raw" if raw else "numpy",
            lambda: _bundle.numpy_views(self._layout, lambda part: self._region(part).numpy(), raw),
            lambda: None)

    # --- lifetime ---------------------------------------------------------------------
    def release(self) -> None:
        """Let go of this dict's hold on the bundle and of its member Tensors. Framework
        views made from them keep the memory until they are freed."""
        for t in self._tensors.values():
            t.release()
        self._tensors = {}
        self._bhold = None
        self._parts = None

    def __enter__(self) -> TensorDict:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.release()
        return False


_UINT8 = _dtypes.dtype("uint8")


def _made_ready(parts, stream):
    """Views built before this version came: order `stream` after the version's producer
    (CUDA) or wait for it (host-NUMA read by the CPU), as an import would have."""
    for p in parts:
        if stream is not None:
            p.used_in(stream)
        else:
            p.sync_cpu()


# --- torch views built ahead -----------------------------------------------------------------
# A consumer that follows versions (get_dict(newer_than=..., keep_mapped=True)) waits between
# them, and the next version most likely lies where the one before the last did (a
# double-buffered producer alternates between two bundles). Before it waits, get_dict builds
# torch views of that memory with no hold behind them yet: their regions' DLPack owner is an
# anchor, empty until torch() hands the views out for a version in exactly that memory and
# layout, which then sets the anchor to the version's buffer. Each set is handed out once, so
# every version gets tensors of its own (unlike reuse_views) whose lifetime keeps its own
# version's memory; a set never handed out holds nothing. Building views costs most right
# after a process wakes up (0.4 ms for 146 members on an H200 host, against 0.1 ms in a warm
# loop): ahead, it is paid while the consumer would sleep anyway.
_AHEAD_KEPT = 2


class _Anchor:
    __slots__ = ("owner", "__weakref__")

    def __init__(self):
        self.owner = None


class _Region:
    """A mapped buffer as DLPack sees it, owned by an anchor instead of a hold."""

    __slots__ = ("ptr", "size", "dev", "read_only", "anchor")

    def __init__(self, ptr, size, dev, read_only, anchor):
        self.ptr, self.size, self.dev = ptr, size, dev
        self.read_only, self.anchor = read_only, anchor

    def __dlpack_device__(self):
        return self.dev

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        versioned = max_version is not None and int(max_version[0]) >= 1
        if not versioned and self.read_only:
            raise BufferError("read-only memory needs a DLPack 1.x consumer")
        return _dlpack.make_capsule(self.ptr, self.dev, _UINT8, (self.size,), (1,),
                                    self.anchor, versioned, read_only=self.read_only)


def _ahead_state(client):
    st = client.__dict__.get("_torch_ahead")
    if st is None:
        # recent: (key, layout, facts) of the last bundles viewed, most recent last;
        # sets: key -> (anchors, views) built and not handed out yet.
        st = client.__dict__.setdefault("_torch_ahead", {"recent": [], "sets": {},
                                                          "built": 0, "used": 0})
    return st


def _ahead_key(td):
    return ("torch", td._layout, td.read_only,
            tuple((p.buffer_id, p.ptr, p.size) for p in td._parts))


def _take_ahead(td, current_stream):
    """Views built ahead for this version's memory and layout (its buffers become their
    owners), or None; notes the bundle as viewed either way."""
    client = td._client
    key = _ahead_key(td)
    facts = [(p.ptr, p.size, p.dl_device, p.read_only) for p in td._parts]
    with client._views_lock:
        st = _ahead_state(client)
        got = st["sets"].pop(key, None)
        recent = st["recent"]
        recent.append((key, td._layout, facts))
        del recent[:-2]
        if got is not None:
            st["used"] += 1
    if got is None:
        return None
    anchors, views = got
    for a, p in zip(anchors, td._parts):
        a.owner = p
    _made_ready(td._parts, current_stream())
    return views


def build_ahead(client):
    """Build, once, torch views of the memory the next version most likely lies in (the
    bundle viewed before the last one, or the last one when the two were the same). Only
    where torch is imported already and the layout's views need no import of their own."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return
    with client._views_lock:
        st = _ahead_state(client)
        recent = st["recent"]
        if not recent:
            return
        key, layout, facts = recent[-2] if len(recent) == 2 and recent[0][0] != recent[1][0] \
            else recent[-1]
        if key in st["sets"]:
            return
    if not layout.members or layout.torch_fast(torch) is None:
        return
    anchors = [_Anchor() for _ in facts]
    views = _bundle.torch_views(
        layout, lambda part: torch.from_dlpack(_Region(*facts[part], anchors[part])), None)
    with client._views_lock:
        sets = st["sets"]
        sets[key] = (anchors, views)
        st["built"] += 1
        while len(sets) > _AHEAD_KEPT:
            sets.pop(next(iter(sets)))
