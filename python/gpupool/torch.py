"""PyTorch code as it is, on gpupool: torch.multiprocessing, Pool and DataLoader results travel
as gpupool holds instead of CUDA IPC handles or shared-memory files.

    import gpupool.torch
    gpupool.torch.install()            # once, in the process that sends tensors

After ``install()`` every tensor torch pickles across processes (``mp.Queue``, ``SimpleQueue``,
``Pipe``, ``Pool`` arguments and results, ``Process(args=...)`` under spawn and forkserver) is
sent as a kept share of a gpupool buffer: a storage that is a gpupool buffer (from
``gpupool.torch.empty``/``zeros``/``empty_like``, from ``use_allocator()``, or received from
another process) is shared without a copy and stays one storage in both processes; any other
storage is copied once into gpupool memory on the sender's current stream, so the sender may
free it, reuse it or exit at once. The receiver holds the buffer for exactly as long as its
storage lives (the hold goes with the storage's deleter), needs no ``ipc_collect``, and gets
storages that alias as the sender's did. Nothing of it needs ptrace, pidfd_getfd or a shared
PID namespace: only the daemon's socket.

A message is one request each way, whatever its number of tensors: the sender shares every
storage of it in one Share request, the receiver opens them in one Open request (install()
wraps ForkingPickler's dump for that). The buffers copies go into are kept and written again
for later messages once the daemon says nobody holds them any more; ``trim()`` gives them back.

Importing this module imports torch; ``import gpupool`` does not import it.

The parts: _torch_state (options, the process's client, what it shares and keeps),
_torch_send (the reducers and a message's one Share), _torch_recv (a message's one Open and its
tensors rebuilt), _torch_alloc (empty/zeros/empty_like and use_allocator), and gpupool._fast
(python/ext/fast.c, loaded by _native when built): the per-tensor steps of sending and receiving
in C, the same steps in Python without it. This module installs and uninstalls the reducers,
and is the one users import.
"""

from __future__ import annotations

import os
from multiprocessing.reduction import ForkingPickler
from typing import Optional

import torch
from torch.multiprocessing import reductions as _torch_reductions

from ._client import Client
from ._errors import GpupoolError, error
from ._torch_alloc import (allocator_counts, allocator_last_error, empty, empty_cache, empty_like,
                           use_allocator, zeros)
from ._torch_recv import _process_types, _reduce_process
from ._torch_send import _pickler_dump, _pickler_init, _reduce_storage, _tensor_reducer, trim
# _client and _profile are used by the tests and bench/torch_queue.py --profile.
from ._torch_state import _S, _Options, _client, _forget_parent, _profile, _say_fallback, log  # noqa: F401

__all__ = ["install", "uninstall", "installed", "empty", "zeros", "empty_like", "use_allocator",
           "allocator_counts", "allocator_last_error", "empty_cache", "trim", "GpupoolError"]


# --- install -------------------------------------------------------------------------------
def _tensor_types():
    types = [torch.Tensor, torch.nn.parameter.Parameter]
    types += [t for t in getattr(torch, "_tensor_classes", ()) if t not in types]
    return types


def install(client: Optional[Client] = None, *, copy: bool = True, cpu: bool = False,
            pool: Optional[str] = None, fallback: bool = False,
            socket: Optional[str] = None) -> None:
    """Send every tensor torch pickles across processes as a gpupool hold.

    client: the Client to share through (default: one per process, connected now to
    `socket`, $GPUPOOL_SOCKET or the default socket; after fork the child connects its own).
    copy: copy storages that are not gpupool memory into a new gpupool buffer (True) or
    refuse them with GpupoolError (False). cpu: route CPU storages through gpupool's host
    pools too (default: only CUDA storages; CPU tensors keep torch's shared memory). pool:
    the pool copies go to (default: one on the storage's device). fallback: when gpupoold is
    unreachable, log a warning and use torch's own sharing instead of raising.

    Children need nothing: a spawn or forkserver child (a Process, a Pool worker) installs
    the same options before its target runs, a fork child inherits them, and any process
    that unpickles a gpupool tensor installs them too; each connects a client of its own on
    first use."""
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions first)

    opts = _Options(copy, cpu, pool, fallback, socket)
    with _S.lock:
        if _S.pid != os.getpid():
            _forget_parent()
        _S.opts = opts
        if client is not None:
            _S.client = client
            _S.user_client = True
        else:
            if _S.client is not None and (_S.user_client or _S.client_socket != opts.socket):
                _S.client = None  # another daemon (or the user's client no more): connect anew
            try:
                _client()
            except GpupoolError as e:
                if not fallback:
                    raise error("ECONNECT", "gpupool.torch.install: cannot connect to gpupoold: %s. "
                                "Start gpupoold (or point GPUPOOL_SOCKET at it), or install(fallback=True) "
                                "to fall back to torch's own sharing" % e) from e
                _say_fallback("gpupoold is unreachable (%s)" % e)
        reducers = ForkingPickler._extra_reducers
        if not _S.saved:
            for t in _tensor_types():
                _S.saved[t] = reducers.get(t, _torch_reductions.reduce_tensor)
            _S.saved[torch.UntypedStorage] = reducers.get(torch.UntypedStorage,
                                                          _torch_reductions.reduce_storage)
            for t in _process_types():
                _S.saved[t] = reducers.get(t)
        for t in _tensor_types():
            ForkingPickler.register(t, _tensor_reducer)
        ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
        for t in _process_types():
            ForkingPickler.register(t, _reduce_process)
        if _S.pickler is None:
            _S.pickler = (ForkingPickler.__init__, ForkingPickler.dump,
                          "__init__" in ForkingPickler.__dict__, "dump" in ForkingPickler.__dict__)
            ForkingPickler.__init__ = _pickler_init
            ForkingPickler.dump = _pickler_dump


def uninstall() -> None:
    """Give torch its own reductions back (tensors sent from now on use torch's sharing)."""
    with _S.lock:
        for t, r in _S.saved.items():
            if r is None:
                ForkingPickler._extra_reducers.pop(t, None)
            else:
                ForkingPickler.register(t, r)
        _S.saved = {}
        _S.opts = None
        if _S.pickler is not None:
            init, dump, had_init, had_dump = _S.pickler
            if had_init:
                ForkingPickler.__init__ = init
            else:
                del ForkingPickler.__init__
            if had_dump:
                ForkingPickler.dump = dump
            else:
                del ForkingPickler.dump
            _S.pickler = None


def installed() -> bool:
    return _S.opts is not None


def __getattr__(name: str):
    # gpupool.torch.PinnedLoader is gpupool.torch_data.PinnedLoader, imported on first use
    # (DataLoader machinery is not loaded by code that only sends tensors).
    if name == "PinnedLoader":
        from .torch_data import PinnedLoader
        return PinnedLoader
    raise AttributeError("module 'gpupool.torch' has no attribute %r" % (name,))
