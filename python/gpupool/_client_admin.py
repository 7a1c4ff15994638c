"""Client's questions about the daemon: pools, stats, host fences, lost names, trim, set_devices."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Iterable, List, Tuple

from . import _dlpack, _lib
from ._errors import error
from ._lib import check
from ._client_args import _parse_device


class _Admin:
    """The daemon's pools and counters, and the connection's settings."""

    def pools(self) -> List[Dict[str, Any]]:
        """The daemon's pools: a list of dicts (id, name, kind, device, capacity, ...)."""
        return self.stats()["pools"]

    def _pool_list(self):
        if self._pools is None:
            self._pools = self.pools()
        return self._pools

    def _pool_for(self, dev_type, dev_id, what):
        pools = self._pool_list()
        if not pools:
            raise error("ENOENT", "the daemon has no pools")
        if dev_type == _dlpack.kDLCUDA:
            order = [p for p in pools if p["kind"] == "device" and p["device"] == dev_id]
            # memfd pools standing for GPUs (host backend, testing replicas without GPUs)
            order += [p for p in pools if p.get("simulated_device", -1) == dev_id]
            order += [p for p in pools if p["kind"] == "device"]
        else:
            order = [p for p in pools if p["kind"] == "host"]
            order += [p for p in pools if p["kind"] == "host-numa"]
        if not order:
            if what is not None:
                raise error(
                    "ENOENT",
                    "no pool for device %s; the daemon has %s (pass pool= or another device)"
                    % (what, ", ".join("%s (%s%s)" % (p["name"], p["kind"],
                                                      ":%d" % p["device"] if p["kind"] == "device"
                                                      else "") for p in pools)))
            order = pools
        return order[0]["name"]

    def _pool_for_device(self, device):
        if device is None:
            return None
        return self._pool_for(*_parse_device(device))

    def stats(self) -> Dict[str, Any]:
        """Daemon counters (clients, buffers, holds, names, requests, errors, open_fds,
        pending_frees, uptime_s, opens_waited, opens_waiting) and 'pools': one dict per pool."""
        d = _lib.DaemonStats()
        pools = (_lib.PoolStats * 64)()
        n = ctypes.c_int(0)
        check(self._lib.gpupool_client_stats_sized(self._conn.usable(), ctypes.byref(d),
                                            ctypes.sizeof(d), pools, ctypes.sizeof(_lib.PoolStats),
                                            64, ctypes.byref(n)), "stats")
        out = {f: getattr(d, f) for f, _ in _lib.DaemonStats._fields_}
        plist = []
        for i in range(n.value):
            p = pools[i]
            e = {f: getattr(p, f) for f, _ in _lib.PoolStats._fields_}
            e["name"] = p.name.decode(errors="replace")
            e["kind"] = _lib.MEM_KIND_NAMES.get(p.kind, str(p.kind))
            plist.append(e)
        out["pools"] = plist
        self._pools = plist
        return out

    @property
    def slab_maps(self) -> int:
        """How many slab mappings this client has made over its life: each an import of
        daemon memory (on CUDA, an IPC open). A get of memory already mapped here (kept by
        keep_mapped, or a slab another buffer of this process maps) adds none."""
        return int(self._lib.gpupool_client_slab_maps(self._conn.usable()))

    @property
    def ready_waits(self) -> int:
        """How many times this client made a stream wait on a producer's ready event (its
        work was still running when the buffer was got or opened); the buffers of one message
        opened together wait once per stream they were shared from."""
        return int(self._lib.gpupool_client_ready_waits(self._conn.usable()))

    def nowait_failures(self) -> Tuple[int, str]:
        """How many of this client's shares that did not wait for the daemon's reply (a
        gpupool.torch message's) failed, as far as their replies were read, and the last
        one's reason ("" when none failed). Their tokens' Opens fail with that reason too."""
        msg = ctypes.create_string_buffer(512)
        n = int(self._lib.gpupool_client_nowait_failures(self._conn.usable(), msg, len(msg)))
        return n, msg.value.decode(errors="replace")

    @property
    def host_fences(self) -> bool:
        """True when this connection orders GPU work with host-side fences instead of the
        daemon's inter-process events (a client of another uid than gpupoold's, or
        GPUPOOL_HOST_FENCES=1): publish and release then wait for the stream's work on the
        host, and gets come once the producer's work is done. See gpupool_client_host_fences in
        gpupool.h."""
        return bool(self._lib.gpupool_client_host_fences(self._conn.usable()))

    def lost_names(self) -> List[str]:
        """Names this client had published that the daemon no longer has after it went away.

        A daemon that keeps its state in an fd store (systemd's, or ``gpupoold --supervise``)
        brings names back across a crash or restart; those are not reported. Each lost name is
        reported once."""
        per = _lib.NAME_MAX + 1
        batch = 64
        buf = ctypes.create_string_buffer(per * batch)
        out: List[str] = []
        while True:
            n = ctypes.c_int(0)
            check(self._lib.gpupool_client_lost_names(self._conn.usable(), buf, batch, ctypes.byref(n)),
                  "lost_names")
            for i in range(n.value):
                out.append(buf.raw[i * per:(i + 1) * per].split(b"\0", 1)[0].decode("utf-8", "replace"))
            if n.value < batch:
                return out

    def trim(self) -> None:
        """Ask the daemon to give every tenant's unused slabs back to the backend.

        Operators only (root or the daemon's own uid): others get PermissionError."""
        check(self._lib.gpupool_client_trim(self._conn.usable()), "trim")

    def set_devices(self, devices: Iterable[int]) -> None:
        """CUDA devices this process touches pool memory from (cudaMemPoolSetAccess)."""
        devs = [int(d) for d in devices]
        arr = (ctypes.c_int * max(len(devs), 1))(*devs)
        check(self._lib.gpupool_client_set_devices(self._conn.usable(), arr, len(devs)),
              "set_devices %r" % (devs,))
