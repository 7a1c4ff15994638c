"""TensorDict: a bundle of tensors (member name -> Tensor) and the framework views built
from it, one import per buffer."""

from __future__ import annotations

from typing import Any, Dict, Iterator, KeysView, Literal, Mapping, Optional, Tuple

from . import _bundle, _dtypes, _lib
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
        return self._reused_views(
            "torch", build,
            lambda: torch.cuda.current_stream(cuda[0].cuda_device).cuda_stream if cuda else None)

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
            stream = current_stream()
            for p in self._parts:
                if stream is not None:
                    p.used_in(stream)
                else:
                    p.sync_cpu()
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
