"""torch DTensors as the slices of sharded versions (docs/REFIT.md), read as they are.

A trainer's state dict of DTensors says, for every weight, its global shape and dtype and,
through its placements on its device mesh, which slice every rank holds: torch's own
compute_local_shape_and_global_offset gives this rank's (uneven shards as torch chunks them:
the last ranks get fewer rows, or none). Sharded dimensions (``Shard(d)``) give each rank its
slice; replicated ones (``Replicate()``) give every rank of that mesh dimension the same
slice, which only the rank at coordinate 0 of each replicated mesh dimension publishes.
``Partial`` (pending sums) and ``_StridedShard`` (interleaved rows) are not one slice per rank
and are refused with what to do instead.

Every rank derives the same set of publishing ranks from the placements alone (no
collective): a rank that publishes nothing for any tensor (every slice of it empty or
replicated elsewhere) is no part of the version, and the parts are the publishing ranks in
the order of their global rank. On the engine's side a DTensor target stands for its local
shard, filled in place.

torch is imported only when a DTensor is met (``import gpupool`` does not import torch).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Mapping, Tuple

from ._errors import error


def is_dtensor(obj: Any) -> bool:
    """Whether obj is a torch DTensor (without importing torch when nobody has)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(obj, DTensor)


def _placement_kinds(placements, what):
    """Per mesh dimension: ("shard", dim) or ("replicate", None); refuses the rest."""
    from torch.distributed.tensor import Replicate, Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # older torch: no strided shards to meet
        _StridedShard = ()
    out = []
    for m, p in enumerate(placements):
        # _StridedShard first: it may derive from Shard in some torch versions.
        if _StridedShard and isinstance(p, _StridedShard):
            raise error("EINVAL", "%s: placement %r on mesh dimension %d interleaves rows across "
                        "ranks, not one slice per rank; redistribute it to Shard(%d) or "
                        "Replicate() first (dtensor.redistribute(mesh, placements))"
                        % (what, p, m, p.dim))
        if isinstance(p, Shard):
            out.append(("shard", p.dim))
        elif isinstance(p, Replicate):
            out.append(("replicate", None))
        else:
            raise error("EINVAL", "%s: placement %r on mesh dimension %d holds no slice of the "
                        "tensor (a Partial holds addends of it); redistribute it to Shard(d) or "
                        "Replicate() first (dtensor.redistribute(mesh, placements), or "
                        "full_tensor())" % (what, p, m))
    return out


def _numel(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


# (global shape, placements, mesh ranks, mesh shape, this rank's coordinate) -> (the global
# ranks that publish a slice, this rank's local shape, its offsets): a model's weights have
# few distinct shapes, and asking the mesh costs tens of microseconds a time.
_layouts: Dict[Any, Tuple[Tuple[int, ...], Tuple[int, ...], Any]] = {}


def _mesh_info(mesh, memo):
    """(global ranks in mesh order, mesh shape, this rank's coordinate or None), asked of
    the mesh once per call of the caller (memo: id(mesh) -> it, the meshes alive meanwhile)."""
    got = memo.get(id(mesh))
    if got is None:
        coord = mesh.get_coordinate()
        got = memo[id(mesh)] = (tuple(int(r) for r in mesh.mesh.flatten().tolist()),
                                tuple(int(n) for n in mesh.shape),
                                None if coord is None else tuple(int(c) for c in coord))
    return got


def _layout(dt, memo, what):
    """(publishers, local shape, offsets) of dt on this rank: publishers are the global ranks
    that publish a slice of it, the nonempty slices, each from the rank at coordinate 0 of
    every replicated mesh dimension (a tensor with no elements: from the rank at coordinate 0
    of every mesh dimension); local shape and offsets are this rank's as torch's
    compute_local_shape_and_global_offset gives them (None when this rank is not in the
    mesh)."""
    import itertools

    from torch.distributed.tensor._utils import (_compute_local_shape_and_global_offset,
                                                 compute_local_shape_and_global_offset)

    mesh, placements = dt.device_mesh, tuple(dt.placements)
    ranks, mshape, coord = _mesh_info(mesh, memo)
    gshape = tuple(int(n) for n in dt.shape)
    key = (gshape, placements, ranks, mshape, coord)
    got = _layouts.get(key)
    if got is not None:
        return got
    kinds = _placement_kinds(placements, what)
    empty = _numel(gshape) == 0
    who = []
    for flat, c in enumerate(itertools.product(*(range(n) for n in mshape))):
        if any(i and (empty or kind == "replicate") for i, (kind, _) in zip(c, kinds)):
            continue
        if not empty:
            lshape, _ = _compute_local_shape_and_global_offset(gshape, mshape, list(c), placements,
                                                              skip_offset=True)
            if _numel(lshape) == 0:
                continue
        who.append(ranks[flat])
    lshape = offset = None
    if coord is not None:
        lshape, offset = compute_local_shape_and_global_offset(gshape, mesh, placements)
        lshape = tuple(int(n) for n in lshape)
        # An empty slice's offset is the dimension's size (torch's convention): any will do.
        offset = tuple(min(int(o), n) for o, n in zip(offset, gshape))
    if len(_layouts) > 4096:  # bound it anyway
        _layouts.clear()
    got = _layouts[key] = (tuple(who), lshape, offset)
    return got


def _local_slices(dt, lshape, offset, what):
    """(local tensor, its slices of the global tensor), checked against torch's account."""
    local = dt.to_local()
    if tuple(local.shape) != lshape:
        raise error("EINVAL", "%s: the local tensor is %s, but placements %r on a mesh of %s give "
                    "this rank %s; make the DTensor with distribute_tensor, or from_local with "
                    "the shape torch chunks it to" % (what, tuple(local.shape),
                                                      tuple(dt.placements),
                                                      tuple(dt.device_mesh.shape), lshape))
    return local, tuple(slice(o, o + n) for o, n in zip(offset, lshape))


def shard_part(shards: Mapping[str, Any], what: str):
    """(part, parts, {key: (local, slices, global_shape)}) of this rank from a state dict of
    DTensors; part is None when this rank publishes nothing."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise error("EINVAL", "%s: DTensors need torch.distributed's default process group (its "
                    "ranks number the parts); call init_process_group first" % what)
    me = dist.get_rank()
    everyone: set = set()
    mine: Dict[str, Any] = {}
    memo: Dict[int, Any] = {}
    for key, dt in shards.items():
        kw = "%s: %r" % (what, key)
        if isinstance(dt, (tuple, list)) and dt:
            if len(dt) > 1 and is_dtensor(dt[0]):
                raise error("EINVAL", "%s: give the DTensor alone: its placements say its slice "
                            "and global shape" % kw)
            dt = dt[0]
        if not is_dtensor(dt):
            raise error("EINVAL", "%s is a %s among DTensors: give every tensor as a DTensor (a "
                        "plain one that every rank holds: DTensor.from_local(t, mesh, "
                        "[Replicate()]); one rank then publishes it), or publish explicit slices "
                        "with rank and world" % (kw, type(dt).__name__))
        who, lshape, offset = _layout(dt, memo, kw)
        everyone.update(who)
        if me in who:
            local, slices = _local_slices(dt, lshape, offset, kw)
            mine[key] = (local, slices, tuple(int(n) for n in dt.shape))
    order = sorted(everyone)
    if me not in order:
        return None, len(order), {}
    return order.index(me), len(order), mine


def refit_target(name: str, spec: Any, what: str):
    """(local tensor, pieces, dim) of a DTensor target, or None when spec names no DTensor.
    A DTensor alone (or (dtensor,), (dtensor, key)) is the slice of global tensor `key`
    (default: the target's name) its placements give this rank; with a list of pieces, the
    DTensor stands for its local tensor and the pieces say what it holds. An empty local
    shard gives (local, None, 0): nothing to fill."""
    if is_dtensor(spec):
        dt, pieces, dim = spec, None, 0
    elif isinstance(spec, (tuple, list)) and spec and is_dtensor(spec[0]):
        dt = spec[0]
        pieces = spec[1] if len(spec) > 1 else None
        dim = int(spec[2]) if len(spec) > 2 else 0
    else:
        return None
    if pieces is not None and not isinstance(pieces, (str, bytes)):
        _placement_kinds(tuple(dt.placements), what)
        return dt.to_local(), pieces, dim
    key = name if pieces is None else pieces
    if isinstance(key, bytes):
        key = key.decode()
    _, lshape, offset = _layout(dt, {}, what)
    if lshape is None or _numel(lshape) == 0:
        return dt.to_local(), None, 0
    local, slices = _local_slices(dt, lshape, offset, what)
    return local, [(key, slices)], 0

