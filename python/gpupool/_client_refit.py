"""Client's sharded versions and refit plans (docs/REFIT.md; the work is in _refit.py)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Tuple

from ._util import Stream


class _Refit:
    """Sharded versions and refit plans."""

    def publish_shard(self, name: str, shards: Mapping[str, Any], rank: int | None = None,
                      world: int | None = None, version: int | None = None,
                      stream: Stream = None, pool: str | None = None) -> bool:
        """Publish this rank's slices as part `rank` of `world` parts of version `version`
        of `name` (greater than the published one; the same in every rank). shards: key ->
        (tensor, slices, global_shape): the tensor holds global[slices] (a tuple of slices
        with step 1, one per dimension, None or missing = the whole dimension); the global
        shape may be left out when the slices' stops say it. Or shards is a state dict of
        torch DTensors (``Shard(d)`` and ``Replicate()`` placements, on any mesh), and rank
        and world are left out: the placements say each rank's slice, one rank publishes
        each replicated slice, and a rank with nothing of its own to publish returns False
        at once (the version is complete without it). A tensor that lives in gpupool
        memory of this client (from ``alloc``, ``alloc_dict``, ``gpupool.torch.empty``, the
        allocator) is published in place; any other is copied once into gpupool memory. The
        version is visible to readers when its last part is in; returns
        True for the call that completed it. Stay connected until then: a rank whose
        connection closes first takes the pending version with it."""
        from . import _refit

        return _refit.publish_shard(self, name, shards, rank, world, version, stream, pool)

    def refit_plan(self, name: str, targets: Mapping[str, Any] | Sequence[Tuple[str, Any]],
                   newer_than: int = 0, timeout: float | None = None) -> Any:
        """A RefitPlan writing versions of `name` into your own tensors in place. targets:
        name -> (tensor, pieces) or (tensor, pieces, dim): pieces are global keys, or (key,
        slices) pairs (the slice of the global tensor the piece is), stacked along dim
        (default 0) in order (a fused qkv: [("q", (slice(a, b),)), ("k", ...), ("v", ...)]);
        a tensor of another float dtype is cast on the copy. A torch DTensor target (alone,
        or (dtensor, key)) is its local shard, filled with the slice of global tensor `key`
        (default: the target's name) its placements give; one whose local shard is empty is
        left out. The plan is computed from the
        version published now (or newer than newer_than, waiting up to timeout seconds);
        ``plan.refit()`` writes each next version."""
        from . import _refit

        return _refit.refit_plan(self, name, targets, newer_than, timeout)
