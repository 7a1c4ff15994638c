"""A private gpupoold for tests, examples and benchmarks.

``Daemon`` starts the real daemon binary on a socket in a fresh temporary directory, waits
until it answers a connection, and stops it (SIGTERM, then SIGKILL) on exit::

    with gpupool.testing.Daemon("/path/to/gpupoold", backend="host") as d:
        with gpupool.Client(d.socket) as c:
            ...

The binary is taken from the argument, else $GPUPOOLD, else `gpupoold` on PATH.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import IO, Iterable, Literal, Optional

from ._errors import GpupoolError

__all__ = ["Daemon", "find_gpupoold"]


def find_gpupoold(path: Optional[str] = None) -> str:
    p = path or os.environ.get("GPUPOOLD") or shutil.which("gpupoold")
    if not p or not os.access(p, os.X_OK):
        raise FileNotFoundError(
            "gpupoold not found (%r): pass its path, or set GPUPOOLD to it (in a build tree: "
            "build/daemon/gpupoold)" % (p,))
    return p


class Daemon:
    """A gpupoold of its own: backend 'host' or 'cuda', extra --pool specs, extra args."""

    def __init__(self, binary: Optional[str] = None, backend: str = "host",
                 pools: Iterable[str] = (), args: Iterable[str] = (), log_level: str = "warn",
                 start_timeout: float = 30.0, stop_timeout: float = 5.0) -> None:
        self.binary = find_gpupoold(binary)
        self.backend = backend
        self.pools = list(pools)
        self.args = list(args)
        self.log_level = log_level
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.died: Optional[int] = None
        self.dir: Optional[str] = None
        self.socket: Optional[str] = None
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.log_path: Optional[str] = None
        self._log: Optional[IO[bytes]] = None

    def start(self) -> Daemon:
        self.dir = tempfile.mkdtemp(prefix="gpupool-")
        self.socket = os.path.join(self.dir, "gpupoold.sock")
        self.log_path = os.path.join(self.dir, "gpupoold.log")
        cmd = [self.binary, "--backend", self.backend, "--socket", self.socket,
               "--log-level", self.log_level]
        for p in self.pools:
            cmd += ["--pool", p]
        cmd += self.args
        env = dict(os.environ)
        # A service manager's variables would make the daemon take their socket instead.
        for k in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "NOTIFY_SOCKET",
                  "WATCHDOG_USEC", "WATCHDOG_PID"):
            env.pop(k, None)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)
        self._wait_ready(cmd)
        return self

    def _wait_ready(self, cmd):
        from ._client import Client

        deadline = time.monotonic() + self.start_timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("gpupoold exited with status %s during start-up (%s):\n%s"
                                   % (self.proc.returncode, " ".join(cmd), self.log()))
            if os.path.exists(self.socket):
                try:
                    Client(self.socket, name="gpupool.testing").close()
                    return
                except GpupoolError as e:
                    last = e
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("gpupoold did not answer on %s within %.0f s (last error: %s):\n%s"
                           % (self.socket, self.start_timeout, last, self.log()))

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> Optional[int]:
        """Stop the daemon; returns its exit status (None if it was not running). If it had
        exited before being asked to, that status is also left in self.died."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    # It stops at once: a stopped daemon reuses nothing, so processes
                    # that still map its memory (this one, perhaps) keep it.
                    self.proc.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            else:
                self.died = self.proc.returncode
            rc = self.proc.returncode
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        return rc

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> Literal[False]:
        self.stop()
        return False
