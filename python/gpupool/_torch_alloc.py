"""gpupool.torch, allocating for sharing: empty/zeros/empty_like in gpupool buffers, and the
whole-process CUDA allocator (use_allocator)."""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional, Sequence

import torch

from . import _dlpack, _lib
from ._client import Client
from ._dict import _UINT8
from ._errors import error
from ._torch_state import _S, _client, _remember, _stream_of


# --- allocating for sharing ----------------------------------------------------------------
def _size_arg(size):
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return tuple(int(n) for n in size)


def empty(*size: Any, dtype: Optional[torch.dtype] = None, device: Any = None,
          requires_grad: bool = False, pool: Optional[str] = None,
          client: Optional[Client] = None) -> torch.Tensor:
    """torch.empty whose storage is a gpupool buffer of its own: install() shares it without a
    copy, and both processes see each other's writes. device: as torch's (default: torch's
    default device); pool: a pool name instead of the pool of that device."""
    shape = _size_arg(size)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    dev = torch.device(device) if device is not None else torch.get_default_device()
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    c = client if client is not None else _client()
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if pool is None:
        pool = c._pool_for(_dlpack.kDLCUDA, dev.index, str(dev)) if dev.type == "cuda" \
            else c._pool_for(_dlpack.kDLCPU, 0, "cpu")
    s = _stream_of(dev)
    g = c._alloc((max(nbytes, 1),), _UINT8, pool, 0, s)
    hold = g._hold
    x = torch.from_dlpack(g)
    if x.device != dev:
        raise error("EINVAL", "pool %r holds %s memory, not %s" % (pool, x.device, dev))
    st = x.untyped_storage()
    _remember(st.data_ptr(), hold, 0)
    del g
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    t = torch.empty((0,), dtype=dtype, device=dev).set_(st, 0, shape, tuple(reversed(strides)))
    if requires_grad:
        t.requires_grad_(True)
    return t


def zeros(*size: Any, **kw: Any) -> torch.Tensor:
    """gpupool.torch.empty filled with zeros."""
    t = empty(*size, **kw)
    with torch.no_grad():
        t.zero_()
    return t


def empty_like(other: torch.Tensor, *, dtype: Optional[torch.dtype] = None, device: Any = None,
               requires_grad: bool = False, pool: Optional[str] = None,
               client: Optional[Client] = None) -> torch.Tensor:
    """gpupool.torch.empty of other's shape, dtype and device (C-contiguous)."""
    return empty(tuple(other.shape), dtype=dtype or other.dtype,
                 device=device if device is not None else other.device,
                 requires_grad=requires_grad, pool=pool, client=client)


# --- the whole-process allocator -----------------------------------------------------------
def _alloc_library_path():
    env = os.environ.get("GPUPOOL_TORCH_ALLOC_LIBRARY")
    if env:
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libgpupool-torch-alloc.so")
    if os.path.exists(here):
        return here
    client_lib = os.environ.get("GPUPOOL_LIBRARY")
    if client_lib:
        p = os.path.join(os.path.dirname(client_lib), "libgpupool-torch-alloc.so")
        if os.path.exists(p):
            return p
    return "libgpupool-torch-alloc.so"


def use_allocator(socket: Optional[str] = None, pools: Optional[Sequence[Optional[str]]] = None) -> None:
    """Make every CUDA tensor of this process a gpupool buffer of its own, through torch's
    CUDAPluggableAllocator: install() then shares every CUDA storage without a copy. Call it
    before the process's first CUDA allocation (torch cannot swap an allocator in use).
    socket: the daemon (default: $GPUPOOL_SOCKET or the default); pools: a pool name per
    device index (default: the daemon's device pool for each device). Tensors are blocks of
    gpupool buffers kept in a cache in the process, as torch's caching allocator keeps its
    own: most allocations and frees make no request to gpupoold (docs/TORCH.md)."""
    if _S.alloc_lib is not None:
        raise error("EBUSY", "gpupool.torch.use_allocator() already runs in this process")
    path = _alloc_library_path()
    try:
        L = ctypes.CDLL(path)
    except OSError as e:
        raise error("ENOENT", "cannot load %s (%s): build gpupool (target gpupool-torch-alloc) "
                    "or set GPUPOOL_TORCH_ALLOC_LIBRARY to the library's full path" % (path, e)) from None
    try:
        L.gpupool_torch_alloc_lookup.argtypes = [ctypes.c_void_p, ctypes.POINTER(_lib.BufferP),
                                                 ctypes.POINTER(ctypes.c_size_t),
                                                 ctypes.POINTER(ctypes.c_size_t)]
    except AttributeError:
        raise error("EINVAL", "%s is an older libgpupool-torch-alloc than this gpupool package "
                    "(no gpupool_torch_alloc_lookup): rebuild it with the package, or point "
                    "GPUPOOL_TORCH_ALLOC_LIBRARY at the one built with it" % path) from None
    L.gpupool_torch_alloc_lookup.restype = ctypes.c_int
    # A message's storages looked up in one call (absent from a library older than the
    # package: gpupool.torch then asks per storage).
    many = getattr(L, "gpupool_torch_alloc_lookup_many", None)
    if many is not None:
        many.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                         ctypes.c_void_p]
        many.restype = ctypes.c_size_t
    L.gpupool_torch_alloc_empty_cache.restype = ctypes.c_int
    L.gpupool_torch_alloc_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
    L.gpupool_torch_alloc_stats.restype = ctypes.c_int
    L.gpupool_torch_alloc_last_error.restype = ctypes.c_char_p
    L.gpupool_torch_alloc_configure.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p),
                                                ctypes.c_int]
    L.gpupool_torch_alloc_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64)] * 3
    if socket is None and _S.opts is not None:
        socket = _S.opts.socket
    if pools is None:
        # The daemon's device pool of each device (none: allocations there fail, saying so).
        with Client(socket, name="torch allocator setup") as c:
            have = c.pools()
        pools = []
        for d in range(torch.cuda.device_count()):
            mine = [p["name"] for p in have if p["kind"] == "device" and p["device"] == d]
            pools.append(mine[0] if mine else None)
    names = (ctypes.c_char_p * max(len(pools), 1))(*[None if p is None else p.encode() for p in pools])
    if L.gpupool_torch_alloc_configure(None if socket is None else str(socket).encode(), names,
                                       len(pools)) != 0:
        raise error("ENOMEM", "out of memory configuring the gpupool torch allocator")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "gpupool_torch_alloc", "gpupool_torch_free")
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise error("EINVAL", "gpupool.torch.use_allocator() must run before this process's first "
                    "CUDA allocation (torch cannot swap an allocator already in use: %s); call it "
                    "first thing, e.g. right after import torch" % e) from None
    _S.alloc_lib = L
    _wrap_empty_cache()


def _wrap_empty_cache():
    """torch.cuda.empty_cache gives back use_allocator()'s cached segments too (torch's
    pluggable allocator interface has no hook for it that Python can set)."""
    mod = torch.cuda.memory
    orig = mod.empty_cache
    if getattr(orig, "_gpupool", False):
        return

    def empty_cache_too() -> None:
        orig()
        empty_cache()

    empty_cache_too._gpupool = True
    empty_cache_too.__doc__ = orig.__doc__
    mod.empty_cache = empty_cache_too
    if getattr(torch.cuda, "empty_cache", None) is orig:
        torch.cuda.empty_cache = empty_cache_too


def empty_cache() -> int:
    """Give back to gpupoold every segment use_allocator()'s cache keeps with no block in use
    (torch.cuda.empty_cache does this too under use_allocator). Returns how many went."""
    if _S.alloc_lib is None:
        return 0
    return int(_S.alloc_lib.gpupool_torch_alloc_empty_cache())


_STATS = ("allocs", "frees", "live", "segments", "segment_bytes", "daemon_allocs", "daemon_releases",
          "idle_asks", "parked")


def allocator_counts() -> dict:
    """What use_allocator()'s allocator did and keeps: allocs, frees and live (torch's
    allocations), segments and segment_bytes (gpupool buffers its cache keeps), daemon_allocs
    and daemon_releases (its requests to gpupoold for segments), idle_asks (whether a shared
    segment is still held elsewhere) and parked (shared blocks freed, not reused yet)."""
    if _S.alloc_lib is None:
        return {k: 0 for k in _STATS}
    v = (ctypes.c_uint64 * len(_STATS))()
    n = _S.alloc_lib.gpupool_torch_alloc_stats(v, len(_STATS))
    return {k: int(v[i]) if i < n else 0 for i, k in enumerate(_STATS)}


def allocator_last_error() -> str:
    """Why use_allocator()'s allocator last failed ("" if it never did)."""
    if _S.alloc_lib is None:
        return ""
    return _S.alloc_lib.gpupool_torch_alloc_last_error().decode(errors="replace")
