"""Loading libgpupool-client and declaring its C API for ctypes.

This module owns the one handle on the shared library, the ctypes mirrors of the public C
structs (include/gpupool/gpupool.h), and the translation of a negative GPUPOOL_E* return
code into an exception with the library's own message (gpupool_last_error(); the classes
are in _errors).

The library is found, in order, at $GPUPOOL_LIBRARY (a full path), through
ctypes.util.find_library("gpupool-client"), then by the loader names libgpupool-client.so.0
and libgpupool-client.so. It is loaded on first use, so `import gpupool` works on a machine
without it.
"""

import ctypes
import ctypes.util
import os
import threading

from ._errors import GpupoolError, LibraryNotFoundError
from ._errors import error as _error

__all__ = ["GpupoolError", "LibraryNotFoundError", "lib", "check"]

NAME_MAX = 255
MAX_NDIM = 16
TOKEN_SIZE = 24
READ_ONLY = 0x1
FILE_HOST_ONLY = 0x2
KEEP_MAPPED = 0x4
TARGET_DEVICE = 0x8
COPY_SRC_ON_STREAM_DEVICE = 0x1  # gpupool_buffer_copy_in_many's flag
# Timeouts (ms): 0 = do not wait; TIMEOUT_DEFAULT = the library's default (connect only).
TIMEOUT_FOREVER = -1
TIMEOUT_DEFAULT = -2
CONNECT_TIMEOUT_DEFAULT_MS = 5000

MEM_HOST = 1
MEM_DEVICE = 2
MEM_HOST_NUMA = 3
MEM_KIND_NAMES = {MEM_HOST: "host", MEM_DEVICE: "device", MEM_HOST_NUMA: "host-numa"}

class Buffer(ctypes.Structure):
    """Opaque gpupool_buffer."""


class ClientHandle(ctypes.Structure):
    """Opaque gpupool_client."""


BufferP = ctypes.POINTER(Buffer)
ClientP = ctypes.POINTER(ClientHandle)


class TensorMeta(ctypes.Structure):
    _fields_ = [
        ("dtype_code", ctypes.c_uint8),
        ("dtype_bits", ctypes.c_uint8),
        ("dtype_lanes", ctypes.c_uint16),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_NDIM),
        ("strides", ctypes.c_int64 * MAX_NDIM),
        ("strides_present", ctypes.c_int32),
        ("byte_offset", ctypes.c_uint64),
    ]


class PoolStats(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_uint32),
        ("name", ctypes.c_char * 64),
        ("kind", ctypes.c_int),
        ("device", ctypes.c_int32),
        ("capacity", ctypes.c_uint64),
        ("slab_size", ctypes.c_uint64),
        ("max_alloc", ctypes.c_uint64),
        ("used", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64),
        ("used_high", ctypes.c_uint64),
        ("reserved_high", ctypes.c_uint64),
        ("backend_used", ctypes.c_uint64),
        ("backend_reserved", ctypes.c_uint64),
        ("buffers", ctypes.c_uint64),
        ("slabs", ctypes.c_uint64),
        ("simulated_device", ctypes.c_int32),
    ]


class DaemonStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "clients", "buffers", "holds", "names", "requests", "errors", "open_fds",
        "pending_frees", "uptime_s", "opens_waited", "opens_waiting")]


class File(ctypes.Structure):
    """Opaque gpupool_file."""


FileP = ctypes.POINTER(File)


class FileInfo(ctypes.Structure):
    _fields_ = [
        ("offset", ctypes.c_uint64),
        ("length", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("dev", ctypes.c_uint64),
        ("ino", ctypes.c_uint64),
        ("mtime_sec", ctypes.c_int64),
        ("mtime_nsec", ctypes.c_uint32),
    ]


class Token(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint8 * TOKEN_SIZE)]


class BundleHandle(ctypes.Structure):
    """Opaque gpupool_bundle."""


class PendingHandle(ctypes.Structure):
    """Opaque gpupool_pending."""


BundleP = ctypes.POINTER(BundleHandle)
PendingP = ctypes.POINTER(PendingHandle)

# Most members a bundle may have (GPUPOOL_BUNDLE_MAX_MEMBERS; the daemon's limit may be lower).
BUNDLE_MAX_MEMBERS = 65536


class MemberSpec(ctypes.Structure):
    """gpupool_member_spec: a member asked for by gpupool_bundle_alloc."""
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("size", ctypes.c_uint64),
        ("meta", ctypes.POINTER(TensorMeta)),
    ]


class Member(ctypes.Structure):
    """gpupool_member: a member of a bundle as this process sees it."""
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("ptr", ctypes.c_void_p),
        ("size", ctypes.c_uint64),
        ("has_meta", ctypes.c_int),
        ("meta", TensorMeta),
        ("buffer", ctypes.c_int),
        ("offset", ctypes.c_uint64),
    ]


class MemberRef(ctypes.Structure):
    """gpupool_member_ref: a range of a held buffer, published by gpupool_bundle_publish_members."""
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("buffer", BufferP),
        ("offset", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("meta", ctypes.POINTER(TensorMeta)),
    ]


# The same structs as struct-module formats (little-endian x86-64/aarch64 layout, padding
# spelled out), for packing and unpacking whole tables at C speed: reading a 1,000-member
# table field by field through ctypes costs milliseconds, struct.iter_unpack a fraction.
# check_layouts() proves them equal to the ctypes mirrors above.
META_FMT = "<BBHi16q16qi4xQ"
MEMBER_FMT = "<QQQi4x" + META_FMT[1:] + "i4xQ"
SPEC_FMT = "<QQQ"
REF_FMT = "<QQQQQ"


_c_int = ctypes.c_int
_vp = ctypes.c_void_p
_cp = ctypes.c_char_p

# name: (restype, argtypes), in the order of gpupool.h's table of functions. tests/python
# test_header.py checks each against the header's declaration.
_u64 = ctypes.c_uint64
_PROTOTYPES = {
    "gpupool_err_name": (_cp, [_c_int]),
    "gpupool_strerror": (_cp, [_c_int]),
    "gpupool_last_error": (_cp, []),
    "gpupool_version_string": (_cp, []),
    # client
    "gpupool_client_default_socket_path": (_c_int, [_cp, ctypes.c_size_t]),
    "gpupool_client_connect": (_c_int, [_cp, _cp, _c_int, ctypes.POINTER(ClientP)]),
    "gpupool_client_host_fences": (_c_int, [ClientP]),
    "gpupool_client_set_devices": (_c_int, [ClientP, ctypes.POINTER(_c_int), _c_int]),
    "gpupool_client_disconnect": (None, [ClientP]),
    "gpupool_client_stats_sized": (_c_int, [ClientP, ctypes.POINTER(DaemonStats), ctypes.c_size_t,
                                            ctypes.POINTER(PoolStats), ctypes.c_size_t, _c_int,
                                            ctypes.POINTER(_c_int)]),
    "gpupool_client_trim": (_c_int, [ClientP]),
    "gpupool_client_reconnect_count": (_u64, [ClientP]),
    "gpupool_client_slab_maps": (_u64, [ClientP]),
    "gpupool_client_ready_waits": (_u64, [ClientP]),
    "gpupool_client_nowait_failures": (_u64, [ClientP, _cp, ctypes.c_size_t]),
    "gpupool_client_lost_names": (_c_int, [ClientP, _vp, _c_int, ctypes.POINTER(_c_int)]),
    # buffer
    "gpupool_buffer_alloc": (_c_int, [ClientP, _cp, ctypes.c_size_t, _c_int, _vp,
                                      ctypes.POINTER(BufferP)]),
    "gpupool_buffer_release": (_c_int, [BufferP, _vp]),
    "gpupool_buffer_ptr": (_vp, [BufferP]),
    "gpupool_buffer_size": (ctypes.c_size_t, [BufferP]),
    "gpupool_buffer_device": (_c_int, [BufferP]),
    "gpupool_buffer_kind": (_c_int, [BufferP]),
    "gpupool_buffer_id": (_u64, [BufferP]),
    "gpupool_buffer_facts": (None, [BufferP, ctypes.POINTER(_u64)]),
    "gpupool_buffer_facts_many": (None, [ctypes.POINTER(BufferP), _c_int, ctypes.POINTER(_u64)]),
    "gpupool_buffer_read_only": (_c_int, [BufferP]),
    "gpupool_buffer_client": (ClientP, [BufferP]),
    "gpupool_buffer_tensor": (_c_int, [BufferP, ctypes.POINTER(TensorMeta)]),
    "gpupool_buffer_share": (_c_int, [BufferP, _vp, ctypes.POINTER(Token)]),
    "gpupool_buffer_share_kept": (_c_int, [BufferP, _vp, ctypes.POINTER(Token)]),
    "gpupool_buffer_open": (_c_int, [ClientP, ctypes.POINTER(Token), ctypes.c_uint, _vp,
                                     ctypes.POINTER(BufferP)]),
    "gpupool_buffer_alloc_many": (_c_int, [ClientP, _cp, ctypes.POINTER(ctypes.c_size_t), _c_int,
                                           _vp, ctypes.POINTER(BufferP)]),
    "gpupool_buffer_share_kept_many": (_c_int, [ctypes.POINTER(BufferP), _c_int, _vp,
                                                ctypes.POINTER(Token), ctypes.POINTER(BufferP),
                                                _c_int, ctypes.POINTER(_c_int)]),
    "gpupool_buffer_share_kept_many_nowait": (_c_int, [ctypes.POINTER(BufferP), _c_int, _vp,
                                                       ctypes.POINTER(Token)]),
    "gpupool_buffer_open_many": (_c_int, [ClientP, ctypes.POINTER(Token), _c_int, ctypes.c_uint,
                                          _vp, ctypes.POINTER(BufferP)]),
    "gpupool_buffer_idle_many": (_c_int, [ctypes.POINTER(BufferP), _c_int,
                                          ctypes.POINTER(_c_int)]),
    "gpupool_buffer_release_many": (_c_int, [ctypes.POINTER(BufferP), _c_int, _vp]),
    "gpupool_buffer_copy_in_many": (_c_int, [ctypes.POINTER(BufferP), ctypes.POINTER(_u64),
                                             ctypes.POINTER(_vp), ctypes.POINTER(ctypes.c_size_t), _c_int, _vp,
                                             ctypes.c_uint, ctypes.POINTER(_c_int)]),
    "gpupool_buffer_publish": (_c_int, [BufferP, _cp, ctypes.POINTER(TensorMeta), _vp,
                                        ctypes.POINTER(_u64)]),
    "gpupool_buffer_publish_to": (_c_int, [BufferP, _cp, ctypes.POINTER(TensorMeta), _vp,
                                           ctypes.POINTER(_c_int), _c_int, ctypes.POINTER(_u64)]),
    "gpupool_buffer_get": (_c_int, [ClientP, _cp, _u64, _c_int, ctypes.c_uint, _vp,
                                    ctypes.POINTER(BufferP), ctypes.POINTER(_u64)]),
    "gpupool_buffer_get_begin": (_c_int, [ClientP, _cp, _u64, _c_int, ctypes.c_uint,
                                          ctypes.POINTER(PendingP)]),
    "gpupool_buffer_get_end": (_c_int, [PendingP, _vp, ctypes.POINTER(BufferP),
                                        ctypes.POINTER(_u64)]),
    "gpupool_buffer_publish_begin": (_c_int, [BufferP, _cp, ctypes.POINTER(TensorMeta), _vp,
                                              ctypes.POINTER(PendingP)]),
    "gpupool_buffer_release_begin": (_c_int, [BufferP, _vp, ctypes.POINTER(PendingP)]),
    "gpupool_buffer_idle_many_begin": (_c_int, [ctypes.POINTER(BufferP), _c_int, ctypes.POINTER(PendingP)]),
    "gpupool_buffer_idle_many_end": (_c_int, [PendingP, ctypes.POINTER(_c_int)]),
    # name
    "gpupool_name_unpublish": (_c_int, [ClientP, _cp]),
    # file
    "gpupool_file_publish": (_c_int, [ClientP, _cp, _cp, _u64, _u64, ctypes.POINTER(FileInfo)]),
    "gpupool_file_get": (_c_int, [ClientP, _cp, _c_int, ctypes.c_uint, ctypes.POINTER(FileP)]),
    "gpupool_file_ptr": (_vp, [FileP]),
    "gpupool_file_device_ptr": (_vp, [FileP]),
    "gpupool_file_size": (ctypes.c_size_t, [FileP]),
    "gpupool_file_info_get": (_c_int, [FileP, ctypes.POINTER(FileInfo)]),
    "gpupool_file_release": (None, [FileP]),
    # bundle (the member tables are passed as raw addresses: they are packed with struct)
    "gpupool_bundle_alloc": (_c_int, [ClientP, _cp, _vp, _c_int, _u64, _c_int, _vp,
                                      ctypes.POINTER(BundleP)]),
    "gpupool_bundle_publish": (_c_int, [BundleP, _cp, _vp, ctypes.POINTER(_u64)]),
    "gpupool_bundle_publish_to": (_c_int, [BundleP, _cp, _vp, ctypes.POINTER(_c_int), _c_int,
                                           ctypes.POINTER(_u64)]),
    "gpupool_bundle_publish_members": (_c_int, [ClientP, _cp, _vp, _c_int, _vp,
                                                ctypes.POINTER(_u64)]),
    "gpupool_bundle_get": (_c_int, [ClientP, _cp, _u64, _c_int, ctypes.c_uint, _vp,
                                    ctypes.POINTER(BundleP)]),
    "gpupool_bundle_get_begin": (_c_int, [ClientP, _cp, _u64, _c_int, ctypes.c_uint,
                                          ctypes.POINTER(PendingP)]),
    "gpupool_bundle_get_end": (_c_int, [PendingP, _vp, ctypes.POINTER(BundleP)]),
    "gpupool_bundle_release": (_c_int, [BundleP, _vp]),
    "gpupool_bundle_count": (_c_int, [BundleP]),
    "gpupool_bundle_version": (_u64, [BundleP]),
    "gpupool_bundle_layout_id": (_u64, [BundleP]),
    "gpupool_bundle_member": (_c_int, [BundleP, _c_int, ctypes.POINTER(Member)]),
    "gpupool_bundle_members": (_c_int, [BundleP, _c_int, _c_int, _vp]),
    "gpupool_bundle_find": (_c_int, [BundleP, _cp]),
    "gpupool_bundle_buffers": (_c_int, [BundleP]),
    "gpupool_bundle_buffer": (BufferP, [BundleP, _c_int]),
    # pending
    "gpupool_pending_end": (_c_int, [PendingP, ctypes.POINTER(_u64)]),
    "gpupool_pending_cancel": (None, [PendingP]),
    # tensor
    "gpupool_tensor_span": (_u64, [ctypes.POINTER(TensorMeta), ctypes.POINTER(_c_int)]),
}


def check_layouts():
    """Raise if the struct formats above disagree with the ctypes mirrors of the header."""
    import struct

    for fmt, st in ((META_FMT, TensorMeta), (MEMBER_FMT, Member), (SPEC_FMT, MemberSpec),
                    (REF_FMT, MemberRef)):
        if struct.calcsize(fmt) != ctypes.sizeof(st):
            raise AssertionError("layout of %s: struct %d bytes, ctypes %d"
                                 % (st.__name__, struct.calcsize(fmt), ctypes.sizeof(st)))
    if (Member.meta.offset, Member.buffer.offset, Member.offset.offset) != (32, 312, 320):
        raise AssertionError("unexpected gpupool_member layout on this platform")

_lock = threading.Lock()
_lib = None


def _candidates():
    env = os.environ.get("GPUPOOL_LIBRARY")
    if env:
        return [env], True
    names = []
    # Installed with pip: the wheel carries the library next to this file.
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libgpupool-client.so")
    if os.path.exists(here):
        names.append(here)
    found = ctypes.util.find_library("gpupool-client")
    if found:
        names.append(found)
    names += ["libgpupool-client.so.0", "libgpupool-client.so"]
    return names, False


def _load():
    names, from_env = _candidates()
    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name, use_errno=False)
        except OSError as e:
            errors.append("%s: %s" % (name, e))
    if from_env:
        raise LibraryNotFoundError(
            "cannot load GPUPOOL_LIBRARY=%s (%s); set GPUPOOL_LIBRARY to the full path of "
            "libgpupool-client.so (after tools/demo.sh or tools/test.sh: "
            "build/release/client/libgpupool-client.so)"
            % (names[0], "; ".join(errors)))
    raise LibraryNotFoundError(
        "cannot find libgpupool-client (tried %s); 'pip install ./python' from the gpupool "
        "source tree builds it into the package; or install gpupool (cmake --install), or set "
        "GPUPOOL_LIBRARY to the full path of libgpupool-client.so (after tools/demo.sh or "
        "tools/test.sh: build/release/client/libgpupool-client.so)"
        % ", ".join(names))


def lib():
    """The loaded library with its prototypes declared (loads it on first call)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            handle = _load()
            for name, (res, args) in _PROTOTYPES.items():
                try:
                    fn = getattr(handle, name)
                except AttributeError:
                    raise LibraryNotFoundError(
                        "%s lacks %s: it is not a compatible libgpupool-client; point "
                        "GPUPOOL_LIBRARY at the library built with this package"
                        % (handle._name, name)) from None
                fn.restype = res
                fn.argtypes = args
            _lib = handle
    return _lib


def err_name(code):
    try:
        return lib().gpupool_err_name(code).decode()
    except LibraryNotFoundError:
        return "E%d" % code


def error(code, context=None):
    """The GpupoolError subclass of a negative return code, with the library's last message."""
    L = lib()
    msg = (L.gpupool_last_error() or b"").decode(errors="replace")
    if not msg:
        msg = L.gpupool_strerror(code).decode()
    if context:
        msg = "%s: %s" % (context, msg)
    return _error(code, msg)


def check(rc, context=None):
    """Raise GpupoolError when rc < 0; return rc otherwise."""
    if rc < 0:
        raise error(rc, context)
    return rc
