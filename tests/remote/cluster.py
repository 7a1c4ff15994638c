"""Several gpupoolds, each in a network namespace of its own, that fetch from one another over
UCX (TCP): the shared pieces of the peer tests (tests/remote/test_*.py) and of
bench/remote_bench.py.

    with Cluster(("A", "B")) as cl:
        a, b = cl["A"], cl["B"]
        with a.client() as c:
            c.publish("weights", x)
        with b.client() as c:
            t = c.get("A:weights", timeout=60)       # B fetches it from A

Node I (0-based) is namespace <prefix>I at 10.77.0.(I+1), its daemon serving peers on port
7470 there; every node lists every other as a [peer NAME] with one shared secret. Clients
connect from this process's namespace: a daemon's Unix socket is a path, and paths are not
namespaced. Needs root; require() exits 77 (the ctest skip status) with the reason when a
test cannot run here, and fails when the daemon predates peer support.

Environment: GPUPOOLD, GPUPOOLCTL (the binaries; ctest sets them), GPUPOOL_LIBRARY (the client
library for the Python package), GPUPOOL_REMOTE_KEEP=1 keeps the directory of a failed run.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PYROOT = os.path.join(REPO, "python")
if PYROOT not in sys.path:
    sys.path.insert(0, PYROOT)

import gpupool  # noqa: E402

NETNS = os.path.join(HERE, "netns.sh")
WORKER = os.path.join(HERE, "worker.py")
PEER_PORT = 7470
TENANT = "ml"            # the tenant the tests' root clients belong to on every node
HIDDEN_UID = 65534       # nobody: the tenant "hidden", which exports nothing
GIB = 1 << 30
MIB = 1 << 20

# `gpupoolctl --json peers` gives {"peers": [row, ...]}; the tests read these keys of a row:
# name, state (connected | connecting | authenticating | down), last_error, fetches_in_flight,
# fetches (completed), bytes_fetched (counted when a fetch completes), versions_served.


def skip(reason):
    print("SKIP: " + reason, flush=True)
    sys.exit(77)


def binary(var, default_name):
    p = os.environ.get(var) or shutil.which(default_name)
    if not p or not os.access(p, os.X_OK):
        print("set %s to the %s binary (ctest does)" % (var, default_name), file=sys.stderr)
        sys.exit(2)
    return p


def require():
    """Exit 77 with the reason when the peer tests cannot run here; fail (exit 1) when the daemon
    knows nothing of peers (it predates them: that is a missing feature, not a skip)."""
    if os.geteuid() != 0:
        skip("needs root for network namespaces (CI runs as root)")
    r = subprocess.run([NETNS, "check"], capture_output=True, text=True)
    if r.returncode == 77:
        skip((r.stdout + r.stderr).strip())
    if r.returncode != 0:
        sys.exit("netns.sh check failed:\n" + r.stdout + r.stderr)
    out = subprocess.run([binary("GPUPOOLD", "gpupoold"), "--version"], capture_output=True,
                         text=True).stdout
    m = re.search(r"^peers: (.*)$", out, re.M)
    if not m:
        sys.exit("gpupoold --version has no 'peers:' line, so this daemon has no peer support:\n"
                 + out)
    if not m.group(1).startswith("ucx"):
        skip("gpupoold was built without UCX (%s); install libucx-dev (tools/deps.sh) and rebuild"
             % m.group(0))


class Node:
    def __init__(self, cluster, index, name):
        self.cluster = cluster
        self.index = index
        self.name = name
        self.ns = "%s%d" % (cluster.prefix, index)
        self.dev = "gpv%d" % index
        self.addr = "10.77.0.%d" % (index + 1)
        self.sock = os.path.join(cluster.dir, "%s.sock" % self.ns)
        self.conf = os.path.join(cluster.dir, "%s.conf" % self.ns)
        self.log_path = os.path.join(cluster.dir, "%s.log" % self.ns)
        self.secret_file = cluster.secret_file
        self.peer_names = [n for n in cluster.names if n != name]  # [peer] sections
        self.exports = "*"            # export_peers of tenant ml
        self.extra = ""               # more config text
        self.proc = None
        self._log = None

    # --- the daemon ----------------------------------------------------------------------
    def write_config(self):
        cl = self.cluster
        lines = ["[daemon]", "socket_mode = 0666", "log_level = info",
                 "peer_listen = %s:%d" % (self.addr, PEER_PORT),
                 "peer_secret_file = %s" % self.secret_file,
                 # No fetch here is slow by design; a loaded CI machine may be.
                 "peer_fetch_timeout_ms = 600000", "",
                 "[pool main]"]
        if cl.backend == "cuda":
            lines += ["kind = device", "device = %d" % cl.device]
        else:
            lines.append("kind = host")
        lines += ["capacity = %s" % cl.capacity, "slab_size = %s" % cl.slab_size, ""]
        for p in self.peer_names:
            lines += ["[peer %s]" % p, "address = %s:%d" % (cl[p].addr, PEER_PORT), ""]
        lines += ["[tenant %s]" % TENANT, "uids = 0"]
        if self.exports:
            lines.append("export_peers = %s" % self.exports)
        lines += ["", "[tenant hidden]", "uids = %d" % HIDDEN_UID, "", self.extra, ""]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines))

    def start(self):
        self.write_config()
        env = dict(os.environ, UCX_TLS=self.cluster.tls, UCX_NET_DEVICES=self.dev)
        for k in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "NOTIFY_SOCKET"):
            env.pop(k, None)
        if "libasan" in env.get("LD_PRELOAD", ""):
            # A sanitizer build: the runtime was preloaded for the interpreter, with leak
            # checks off; the daemon links its own and checks its leaks.
            env.pop("LD_PRELOAD")
            env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=1"
        self._log = open(self.log_path, "ab")
        # ip netns exec execs the daemon: self.proc.pid is gpupoold's own.
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, self.cluster.gpupoold, "--backend",
             self.cluster.backend,
             "--config", self.conf, "--socket", self.sock],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise AssertionError("gpupoold of %s exited with %s at start:\n%s"
                                     % (self.name, self.proc.returncode, self.log()))
            if os.path.exists(self.sock):
                try:
                    gpupool.Client(self.sock, name="remote-tests").close()
                    break
                except gpupool.GpupoolError:
                    pass
            if time.monotonic() > deadline:
                raise AssertionError("gpupoold of %s did not answer in 30 s:\n%s"
                                     % (self.name, self.log()))
            time.sleep(0.02)
        return self

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None
        if os.path.exists(self.sock) and sig == signal.SIGKILL:
            os.unlink(self.sock)  # a killed daemon leaves its socket; the restart takes its path

    def stop(self):
        """SIGTERM; returns the exit status, or raises if the daemon had died by itself."""
        if self.proc is None:
            return None
        died = self.proc.poll()
        if died is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None
        if died is not None:
            raise AssertionError("gpupoold of %s died during the test with status %s:\n%s"
                                 % (self.name, died, self.log()))
        log = self.log()
        for mark in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:"):
            if mark in log:
                raise AssertionError("gpupoold of %s reported '%s':\n%s" % (self.name, mark, log))
        return rc

    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-20000:]
        except OSError:
            return ""

    # --- clients and counters ------------------------------------------------------------
    def client(self, name=None):
        return gpupool.Client(self.sock, name=name or "remote-tests")

    def ctl(self, *args):
        r = subprocess.run([self.cluster.gpupoolctl, "--json", "--socket", self.sock] +
                           [str(a) for a in args], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise AssertionError("gpupoolctl %s on %s failed (%d): %s%s"
                                 % (" ".join(map(str, args)), self.name, r.returncode,
                                    r.stdout, r.stderr))
        return json.loads(r.stdout)

    def stats(self):
        return self.ctl("stats")

    def peers(self):
        """name -> that peer's row of `gpupoolctl --json peers`."""
        doc = self.ctl("peers")
        rows = doc.get("peers", []) if isinstance(doc, dict) else doc
        return {r["name"]: r for r in rows}

    def peer(self, name):
        rows = self.peers()
        if name not in rows:
            raise AssertionError("%s lists no peer %s: %r" % (self.name, name, rows))
        return rows[name]

    def usage(self):
        """What 'nothing leaked' compares: the daemon's buffers, holds, names, frees still
        pending and bytes used in every pool."""
        st = self.stats()
        return {"buffers": st["buffers"], "holds": st["holds"], "names": st["names"],
                "pending_frees": st["pending_frees"],
                "used": sum(p["used"] for p in st["pools"])}

    def worker(self, *args, uid=None):
        """tests/remote/worker.py with args, a client of this node's daemon (as uid if given)."""
        worker, pyroot = WORKER, PYROOT
        env = dict(os.environ, GPUPOOL_SOCKET=self.sock)
        kw = {}
        if uid is not None:
            kw = {"user": uid, "group": uid, "extra_groups": []}
            worker, pyroot, lib = reachable_copies(self.cluster.dir)
            if lib:
                env["GPUPOOL_LIBRARY"] = lib
        env["PYTHONPATH"] = pyroot + os.pathsep + os.environ.get("PYTHONPATH", "")
        p = subprocess.Popen([sys.executable, worker] + [str(a) for a in args],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, text=True, **kw)
        self.cluster._children.append(p)
        return p


def reachable_copies(tmp):
    """worker.py, the Python package and the client library copied where another uid can read
    them (a 0755 folder in tmp, the cluster's folder, itself 0755): the checkout may lie in a
    0700 home (a clone in /root), which that uid cannot enter. (worker, python root, library
    or None)."""
    d = os.path.join(tmp, "shared")
    pkg = os.path.join(d, "python", "gpupool")
    if not os.path.isdir(pkg):
        os.makedirs(os.path.dirname(pkg), exist_ok=True)
        shutil.copytree(os.path.join(PYROOT, "gpupool"), pkg,
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(WORKER, os.path.join(d, "worker.py"))
        shutil.copy2(os.path.abspath(__file__), os.path.join(d, "cluster.py"))  # worker's import
        lib = os.environ.get("GPUPOOL_LIBRARY")
        if lib and os.path.exists(lib):
            shutil.copy2(lib, os.path.join(d, os.path.basename(lib)))
        for root, dirs, files in os.walk(d):
            os.chmod(root, 0o755)
            for f in files:
                os.chmod(os.path.join(root, f), 0o755)
    lib = os.environ.get("GPUPOOL_LIBRARY")
    lib = os.path.join(d, os.path.basename(lib)) if lib else None
    return os.path.join(d, "worker.py"), os.path.join(d, "python"), lib


class Cluster:
    """Nodes named by names, started in order; rate caps every link (netns.sh). backend "cuda"
    gives each daemon a device pool on GPU device (benchmarks on a GPU machine); tls is what
    UCX may use (UCX_TLS; UCX_NET_DEVICES is always the node's veth)."""

    def __init__(self, names=("A", "B"), capacity="3G", slab_size="256M", rate=None,
                 configure=None, backend="host", device=0, tls="tcp"):
        self.names = list(names)
        self.backend = backend
        self.device = device
        self.tls = tls
        self.capacity = capacity
        self.slab_size = slab_size
        self.rate = rate
        self.gpupoold = binary("GPUPOOLD", "gpupoold")
        self.gpupoolctl = binary("GPUPOOLCTL", "gpupoolctl")
        # One prefix per run: two suites side by side never share a namespace.
        reap_stale()
        self.prefix = "gpr%d-" % os.getpid()
        self.dir = tempfile.mkdtemp(prefix="gpupool-remote-")
        os.chmod(self.dir, 0o755)  # the hidden tenant's client (nobody) reaches the sockets
        self.secret_file = self.write_secret("secret", b"remote-tests-shared-secret-0123456789")
        self.nodes = [Node(self, i, n) for i, n in enumerate(self.names)]
        self._children = []
        self._up = False
        self.failed = False
        if configure:
            configure(self)

    def __getitem__(self, name):
        return self.nodes[self.names.index(name)]

    def write_secret(self, name, data):
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def netns(self, *args):
        env = dict(os.environ, GPUPOOL_NETNS_PREFIX=self.prefix)
        env.pop("LD_PRELOAD", None)  # a sanitizer build's runtime is for the interpreter only
        if self.rate:
            env["GPUPOOL_NETNS_RATE"] = self.rate
        r = subprocess.run([NETNS] + list(args), env=env, capture_output=True, text=True)
        if r.returncode == 77:
            skip((r.stdout + r.stderr).strip())
        if r.returncode != 0:
            raise AssertionError("netns.sh %s failed:\n%s%s" % (" ".join(args), r.stdout, r.stderr))

    def up(self):
        """The namespaces alone (__enter__ does this, then starts the daemons)."""
        if not self._up:
            self.netns("up", str(len(self.nodes)))
            self._up = True
        return self

    def __enter__(self):
        self.up()
        try:
            for n in self.nodes:
                n.start()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, et, ev, tb):
        for p in self._children:
            if p.poll() is None:
                p.kill()
            p.communicate()
        errors = []
        # Fetchers first: a source stopping under its fetchers is a test of its own
        # (test_kill.py), not something every test should depend on.
        for n in reversed(self.nodes):
            try:
                n.stop()
            except AssertionError as e:
                errors.append(str(e))
        if et is not None or errors:
            self.failed = True
            for n in self.nodes:
                sys.stderr.write("---- log of %s (%s)\n%s\n" % (n.name, n.ns, n.log()))
        if self._up:
            self.netns("down")
        if self.failed and os.environ.get("GPUPOOL_REMOTE_KEEP") == "1":
            sys.stderr.write("kept %s\n" % self.dir)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        if errors and et is None:
            raise AssertionError("\n".join(errors))
        return False


def reap_stale():
    """Namespaces of runs that were killed before their cleanup (a ctest timeout kills with
    SIGKILL): gpr<pid>-... whose pid is gone. Their daemons are killed, the namespaces removed."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for ns in (line.split()[0] for line in out.splitlines() if line.strip()):
        m = re.match(r"^gpr(\d+)-(br|\d+)$", ns)
        if not m or os.path.exists("/proc/%s" % m.group(1)):
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def wait_for(pred, what, timeout=60.0, interval=0.02):
    """Poll until pred() returns a true value, which is returned."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError("never reached: %s (last: %r)" % (what, v))
        time.sleep(interval)


def pattern(seed, nbytes):
    """Deterministic bytes (NumPy uint8) that differ for every seed and every position."""
    import numpy as np

    words = (nbytes + 7) // 8
    x = np.arange(words, dtype=np.uint64)
    x += np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(31)
    return x.view(np.uint8)[:nbytes]


def run_tests(tests):
    """Run each (name, fn) in order, print PASS/FAIL lines; exit 1 if any failed."""
    require()
    # SIGTERM (ctest stopping the run, a user) unwinds like an exception: daemons stopped,
    # namespaces removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    failed = []
    for name, fn in tests:
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001: report every failure, run the rest
            import traceback

            traceback.print_exc()
            failed.append(name)
            print("FAIL %s: %s" % (name, e), flush=True)
        else:
            print("PASS %s (%.1f s)" % (name, time.monotonic() - t0), flush=True)
    if failed:
        print("%d of %d failed: %s" % (len(failed), len(tests), ", ".join(failed)))
        sys.exit(1)
