#!/usr/bin/env python3
"""gpupoold as an operator meets it: start-up failures, the socket path, metrics over TCP,
client timeouts and what gpupoolctl says about the daemon.

  startup   --check-config accepts a valid file and refuses a bad one with exit 2 and the
            file:line; a daemon started on a bad config exits 2 at once, logs the reason at
            error priority ("<3>" under journald) and sends it as STATUS= to its service
            manager; the unit stops restarting on exit 2 (RestartPreventExitStatus=2), and
            its start limit stops a loop of starts that each fail, slowly or at once.
  unlink    --socket naming a regular file, a directory or a symlink refuses to start and
            leaves the file as it was; a stale socket (nobody listening) is replaced; a
            metrics_socket naming a regular file keeps the file; at exit only sockets go.
  tcp       metrics_listen: off by default; "metrics_listen = PORT" serves Prometheus text
            on 127.0.0.1 only; an explicit address is honoured; a bad value is a config error.
  timeout   a client (gpupoolctl, and the C library through Python's gpupool.Client) gives
            up on a SIGSTOPped daemon, and on a listener whose backlog is full, within its
            connect timeout with "the daemon did not answer in N s", and on a socket that is not gpupoold with "this socket is not
            gpupoold" (an HTTP server, a server that closes at once).
  config    --check-config reports every error at its key's line with sizes as written; a
            non-root daemon without XDG_RUNTIME_DIR refused /run/gpupool says what to do.
  health    a TCP metrics exporter that cannot bind is degraded (metric, status line) and
            retried until it serves; a reload that left restart-only keys says so in status.
  quiet     log_level = error (or --log-level error) leaves no line below error in the log,
            the backend's choice included; auto serving host memory advises no driver install.
  identity  Hello and Stats carry the daemon's own pid, uid and version: gpupoolctl status
            shows them even when the daemon was socket-activated; --json prints {"error": ...}
            on failure; a refused connection names the socket's real owner, group and mode.
  configerror  socket-activated with an invalid configuration, the daemon is up but not
            serving: gpupoolctl exits 4 with its reason (3 is for a daemon not there), and
            STATUS= says so; after the fix and SIGHUP, exit 0.
  reload    the unit's ExecReload= fails for a file the daemon would reject (a misspelt
            key), without signalling the daemon; a good file reloads.

Usage: test_ops.py MODE GPUPOOLD GPUPOOLCTL UNIT_TEMPLATE PYTHON_DIR LIBGPUPOOL
"""
import grp
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

from svc_common import check, fail, read_to_end, recv_notify

MODE, GPUPOOLD, GPUPOOLCTL, UNIT_TEMPLATE, PYTHON_DIR, LIBGPUPOOL = sys.argv[1:7]
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if k not in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC",
                          "WATCHDOG_PID", "NOTIFY_SOCKET", "JOURNAL_STREAM", "GPUPOOL_SOCKET")}
PROCS = []


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def host_conf(tmp, sock, extra=""):
    conf = os.path.join(tmp, "gpupoold.conf")
    write(conf, f"[daemon]\nsocket = {sock}\nbackend = host\n{extra}"
                "[pool default]\nkind = host\ncapacity = 16M\nslab_size = 2M\n")
    return conf


class Notify:
    """A stand-in NOTIFY_SOCKET: collects what the daemon tells its service manager."""

    count = 0

    def __init__(self, tmp):
        Notify.count += 1
        self.path = os.path.join(tmp, f"notify{Notify.count}.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)

    def messages(self, timeout=0.2):
        out = []
        self.sock.settimeout(timeout)
        while True:
            try:
                out.append(self.sock.recv(4096).decode())
            except socket.timeout:
                return out

    def wait(self, want, timeout=15):
        msg = recv_notify(self.sock, want, timeout)
        if msg is not None:
            return msg
        fail(f"the daemon did not send {want} within {timeout} s")


def start_daemon(tmp, args, notify=None, env_extra=None):
    env = dict(CLEAN_ENV)
    if notify:
        env["NOTIFY_SOCKET"] = notify.path
    env.update(env_extra or {})
    log = open(os.path.join(tmp, f"gpupoold-{len(PROCS)}.log"), "w+")
    p = subprocess.Popen([GPUPOOLD, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    p.logfile = log
    PROCS.append(p)
    return p


def start_ready(tmp, sock, extra=""):
    """A daemon on host_conf(tmp, sock, extra), once it has told its service manager it is
    ready."""
    n = Notify(tmp)
    p = start_daemon(tmp, ["--config", host_conf(tmp, sock, extra)], notify=n)
    n.wait("READY=1")
    return p


def log_of(p):
    p.logfile.flush()
    with open(p.logfile.name) as f:
        return f.read()


def stop(p):
    if p.poll() is None:
        os.kill(p.pid, signal.SIGCONT)
        p.send_signal(signal.SIGTERM)
        p.wait(15)


def ctl(sock, *args, expect=0, user=None, env=None, timeout=30, exe=None):
    cmd = [exe or GPUPOOLCTL, "--socket", sock, *args]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, timeout=timeout, env=env or CLEAN_ENV)
    out, err = p.stdout.decode(), p.stderr.decode("utf-8", "replace")
    print(f"$ gpupoolctl {' '.join(args)} -> {p.returncode} in {time.monotonic() - t0:.1f} s\n"
          f"{out}{err}", end="")
    if expect is not None and p.returncode != expect:
        fail(f"gpupoolctl {' '.join(args)} exited {p.returncode}, expected {expect}")
    return out, err


# ---- startup ---------------------------------------------------------------------------------

def test_startup(tmp):
    sock = os.path.join(tmp, "gp.sock")
    good = host_conf(tmp, sock)
    p = subprocess.run([GPUPOOLD, "--check-config", "--config", good], capture_output=True,
                       text=True, env=CLEAN_ENV, timeout=30)
    print(p.stdout + p.stderr)
    check(p.returncode == 0 and "configuration OK" in p.stdout, "--check-config on a good file")
    check(not os.path.exists(sock), "--check-config bound the socket")

    bad = os.path.join(tmp, "bad.conf")
    write(bad, "[daemon]\nbackend = host\n[pool p]\nkind = host\ncapacity = lots\n")
    p = subprocess.run([GPUPOOLD, "--check-config", "--config", bad], capture_output=True,
                       text=True, env=CLEAN_ENV, timeout=30)
    print(p.stdout + p.stderr)
    check(p.returncode == 2, f"--check-config on a bad file exited {p.returncode}, not 2")
    check(f"{bad}:5:" in p.stderr and "not a size" in p.stderr, "--check-config message")
    # Pools checked against the backend, not only parsed.
    write(bad, "[daemon]\nbackend = host\n[pool p]\nkind = host\ncapacity = 1G\nslab_size = 5G\n")
    p = subprocess.run([GPUPOOLD, "--check-config", "--config", bad], capture_output=True,
                       text=True, env=CLEAN_ENV, timeout=30)
    check(p.returncode == 2 and "4G" in p.stderr, f"slab over 4G: {p.returncode} {p.stderr}")

    # Under a service manager: exit 2 at once, the reason at error priority and in STATUS=.
    write(bad, "[daemon]\nbackend = host\n[pool p]\ncapacity = lots\n")
    n = Notify(tmp)
    t0 = time.monotonic()
    d = start_daemon(tmp, ["--config", bad, "--socket", sock], notify=n,
                     env_extra={"JOURNAL_STREAM": "8:12345"})
    rc = d.wait(10)
    took = time.monotonic() - t0
    out = log_of(d)
    print(out)
    check(rc == 2, f"a bad config made the daemon exit {rc}, not 2")
    check(took < 5, f"the daemon took {took:.1f} s to refuse its config")
    lines = [l for l in out.splitlines() if "not a size" in l]
    check(lines and lines[0].startswith("<3>"), f"the reason is not logged at error priority: {out!r}")
    msgs = n.messages()
    status = [m for m in msgs if m.startswith("STATUS=") or "\nSTATUS=" in m]
    check(any("not a size" in m and f"{bad}:4" in m for m in status),
          f"STATUS= does not carry the reason: {msgs}")
    # Unknown options and bad values on the command line are configuration errors too.
    d = start_daemon(tmp, ["--backend", "tpu", "--socket", sock], notify=n)
    check(d.wait(10) == 2, "--backend tpu did not exit 2")
    check(any("tpu" in m for m in n.messages()), "STATUS= lacks the bad --backend")

    with open(UNIT_TEMPLATE) as f:
        unit = f.read()
    check(re.search(r"^RestartPreventExitStatus=.*\b2\b", unit, re.M),
          "gpupoold.service does not stop restarting on exit status 2")
    check(re.search(r"^Restart=on-failure$", unit, re.M), "gpupoold.service lost Restart=")
    # systemctl status and help show the unit's documentation: the man pages first.
    check(re.search(r"^Documentation=.*\bman:gpupoold\(8\)", unit, re.M),
          "gpupoold.service's Documentation= lacks man:gpupoold(8)")
    check_start_limit(unit)


def unit_seconds(unit, key):
    """A time span setting of the unit (30, 30s, 5min, 1min 30s) in seconds."""
    m = re.search(rf"^{key}=(.+)$", unit, re.M)
    check(m, f"gpupoold.service has no {key}=")
    total = 0.0
    for n, u in re.findall(r"(\d+)\s*(ms|s|sec|min|m|h)?", m.group(1)):
        total += int(n) * {"ms": 0.001, "": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}[u]
    return total


def check_start_limit(unit):
    """A daemon that cannot start (a library missing) is restarted RestartSec= after each
    failure; a start may take up to the watchdog's interval to fail. Such a loop must reach
    StartLimitBurst= starts within StartLimitIntervalSec=, or it runs forever (a loop of
    starts 3.5-8 s apart ran 23 times under ten in 30 s)."""
    burst = int(re.search(r"^StartLimitBurst=(\d+)$", unit, re.M).group(1))
    interval = unit_seconds(unit, "StartLimitIntervalSec")
    restart = unit_seconds(unit, "RestartSec")
    for fails_after in (0, 1.5, 6, unit_seconds(unit, "WatchdogSec")):
        span = (burst - 1) * (restart + fails_after)
        check(span <= interval,
              f"a loop of starts failing {fails_after} s in, restarted {restart} s later, needs "
              f"{span} s for StartLimitBurst={burst} starts: more than StartLimitIntervalSec="
              f"{interval} s, so the start limit never stops it")
    check(not re.search(r"^(RestartSteps|RestartMaxDelaySec)=", unit, re.M),
          "RestartSteps=/RestartMaxDelaySec= need systemd 254; Debian 12 has 252")


# ---- unlink ----------------------------------------------------------------------------------

def replace_and_stop(d, path, what):
    """Puts a regular file where daemon d's socket `what` was bound, then stops d: the daemon
    must exit cleanly and leave the file alone."""
    os.unlink(path)
    write(path, "replaced\n")
    stop(d)
    check(d.returncode == 0, f"gpupoold exited {d.returncode}")
    check(os.path.isfile(path) and open(path).read() == "replaced\n",
          f"gpupoold removed a regular file at its {what} path when it stopped")


def test_unlink(tmp):
    path = os.path.join(tmp, "precious.txt")
    write(path, "do not delete\n")
    d = start_daemon(tmp, ["--backend", "host", "--socket", path])
    rc = d.wait(10)
    out = log_of(d)
    print(out)
    check(rc == 2, f"gpupoold on a regular file exited {rc}, not 2")
    check(os.path.isfile(path) and open(path).read() == "do not delete\n",
          "gpupoold removed or changed the regular file at --socket")
    check("not a socket" in out and path in out, "the refusal does not say the path is not a socket")

    os.mkdir(os.path.join(tmp, "adir"))
    d = start_daemon(tmp, ["--backend", "host", "--socket", os.path.join(tmp, "adir")])
    check(d.wait(10) == 2 and os.path.isdir(os.path.join(tmp, "adir")), "directory at --socket")
    link = os.path.join(tmp, "link.sock")
    os.symlink(path, link)
    d = start_daemon(tmp, ["--backend", "host", "--socket", link])
    check(d.wait(10) == 2 and os.path.islink(link) and os.path.isfile(path), "symlink at --socket")

    # A stale socket (bound, nobody listening) is replaced; at exit only the socket goes.
    sock = os.path.join(tmp, "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)
    s.close()
    mfile = os.path.join(tmp, "metrics-file")
    write(mfile, "keep me\n")
    d = start_ready(tmp, sock, f"metrics_socket = {mfile}\n")
    out = log_of(d)
    check("not a socket" in out, f"metrics_socket on a regular file was not refused: {out}")
    check(open(mfile).read() == "keep me\n", "metrics_socket's regular file was changed")
    check(stat.S_ISSOCK(os.lstat(sock).st_mode), "the stale socket was not replaced")
    ctl(sock, "status")
    # Something else takes the socket's place while the daemon runs: it must survive exit.
    replace_and_stop(d, sock, "socket")
    check(os.path.isfile(mfile), "gpupoold removed the metrics_socket regular file when it stopped")

    # The same for the metrics socket: served, then replaced by a file while the daemon runs.
    os.unlink(sock)
    msock = os.path.join(tmp, "metrics.sock")
    d = start_ready(tmp, sock, f"metrics_socket = {msock}\n")
    check(stat.S_ISSOCK(os.lstat(msock).st_mode), "metrics_socket was not bound")
    replace_and_stop(d, msock, "metrics_socket")


# ---- tcp -------------------------------------------------------------------------------------

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http_get(host, port, timeout=5):
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        return read_to_end(s)


def non_loopback_ipv4():
    """An address of this machine outside 127/8, or None."""
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect(("192.0.2.1", 9))  # no packet is sent
        addr = s.getsockname()[0]
        s.close()
        return None if addr.startswith("127.") else addr
    except OSError:
        return None


def test_tcp(tmp):
    sock = os.path.join(tmp, "gp.sock")
    # Off by default: no TCP socket among the daemon's fds.
    d = start_ready(tmp, sock)
    inodes = set()
    for fd in os.listdir(f"/proc/{d.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{d.pid}/fd/{fd}")
        except OSError:
            continue
        m = re.match(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(m.group(1))
    tcp = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in open(table).readlines()[1:]:
                f = line.split()
                if f[9] in inodes:
                    tcp.append(line)
    check(not tcp, f"the daemon has TCP sockets without metrics_listen: {tcp}")
    stop(d)

    port = free_port()
    d = start_ready(tmp, sock, f"metrics_listen = {port}\n")
    body = http_get("127.0.0.1", port)
    check(body.startswith("HTTP/1.0 200"), f"TCP metrics answer: {body[:200]!r}")
    check("gpupool_pool_capacity_bytes{pool=\"default\"} 16777216" in body, "TCP metrics body")
    other = non_loopback_ipv4()
    if other:
        try:
            http_get(other, port, timeout=2)
            fail(f"metrics_listen = PORT is reachable on {other}, not only on loopback")
        except OSError:
            print(f"not reachable on {other}: ok")
    else:
        print("(no non-loopback address here: loopback-only not probed from outside)")
    stop(d)
    check(d.returncode == 0, "daemon exit status with TCP metrics")

    port = free_port()
    d = start_ready(tmp, sock, f"metrics_listen = 127.0.0.2:{port}\n")
    check(http_get("127.0.0.2", port).startswith("HTTP/1.0 200"), "explicit address")
    stop(d)

    for bad in ("70000", "localhost:x", "300.1.1.1:9000", "[::1:9000"):
        p = subprocess.run([GPUPOOLD, "--check-config", "--config",
                            host_conf(tmp, sock, f"metrics_listen = {bad}\n")],
                           capture_output=True, text=True, env=CLEAN_ENV, timeout=30)
        check(p.returncode == 2 and "metrics_listen" in p.stderr, f"metrics_listen = {bad}: {p.stderr}")


# ---- config ----------------------------------------------------------------------------------

def test_config(tmp):
    """--check-config lists every error of a file, each at its own line (a pool's at the line
    of the key at fault, not its [pool] header), sizes written as the file writes them; the
    daemon refusing the file says how many more there are. A daemon of another user than root
    with no XDG_RUNTIME_DIR, refused the system socket's directory, says why and what to do."""
    bad = os.path.join(tmp, "bad.conf")
    write(bad, "[daemon]\n"                 # 1
               "backend = host\n"           # 2
               "max_clinets = 5\n"          # 3
               "log_level = loud\n"         # 4
               "[pool p]\n"                 # 5
               "kind = host\n"              # 6
               "capacity = 1G\n"            # 7
               "slab_size = 5G\n"           # 8
               "[pool q]\n"                 # 9
               "kind = host\n"              # 10
               "slab_size = 64M\n"          # 11
               "capacity = 3M\n"            # 12
               "[weird]\n"                  # 13
               "x = 1\n"                    # 14
               "[pool r]\n"                 # 15
               "capacity = lots\n")         # 16
    p = subprocess.run([GPUPOOLD, "--check-config", "--config", bad], capture_output=True, text=True,
                       env=CLEAN_ENV, timeout=30)
    print(p.stdout + p.stderr)
    check(p.returncode == 2, f"--check-config exited {p.returncode}")
    for line, what in ((3, "did you mean 'max_clients'"), (4, "unknown log level 'loud'"), (13, "unknown section"),
                       (16, "not a size"), (8, "slab_size 5G exceeds 4G"), (12, "capacity 3M is smaller than one slab (64M)")):
        check(re.search(rf"^gpupoold: {re.escape(bad)}:{line}: .*{re.escape(what)}", p.stderr, re.M),
              f"--check-config does not report line {line} ({what}): {p.stderr}")
    check(":14:" not in p.stderr, f"a key of a refused section was refused again: {p.stderr}")
    check("6 errors" in p.stderr, f"--check-config does not count the errors: {p.stderr}")
    check(not re.search(r"\b\d{7,}\b", p.stderr), f"raw byte counts in the messages: {p.stderr}")
    # The daemon itself stops at the file and says there is more.
    d = start_daemon(tmp, ["--config", bad, "--socket", os.path.join(tmp, "x.sock")])
    check(d.wait(10) == 2, "a bad file did not make the daemon exit 2")
    check("3 more errors" in log_of(d) and "--check-config" in log_of(d), f"the daemon's message: {log_of(d)}")
    # A pool error without a key line (the section only) still points at the section.
    write(bad, "[daemon]\nbackend = host\n[pool s]\nkind = host\nshare = nobody\n")
    p = subprocess.run([GPUPOOLD, "--check-config", "--config", bad], capture_output=True, text=True,
                       env=CLEAN_ENV, timeout=30)
    check(p.returncode == 2 and f"{bad}:5: [pool s]" in p.stderr, f"share of an unknown group: {p.stderr}")

    if os.geteuid() != 0:
        print("(not root: the non-root daemon's socket path is not exercised)")
        return
    os.chmod(tmp, 0o755)
    exe = reachable_copy(tmp, GPUPOOLD)
    if os.path.isdir("/run/gpupool") and os.stat("/run/gpupool").st_uid == 65534:
        print("(/run/gpupool belongs to nobody here: not exercised)")
        return
    env = {k: v for k, v in CLEAN_ENV.items() if k != "XDG_RUNTIME_DIR"}
    p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", exe, "--backend", "host"],
                       capture_output=True, text=True, env=env, timeout=30)
    print(p.stdout + p.stderr)
    check(p.returncode != 0 and "/run/gpupool" in p.stderr and "XDG_RUNTIME_DIR" in p.stderr
          and "--socket" in p.stderr, f"a non-root daemon refused /run/gpupool gives no hint: {p.stderr}")


# ---- health ----------------------------------------------------------------------------------

def metrics_over_socket(path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        return read_to_end(s)


def wait_for(what, pred, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    fail(f"{what} within {timeout} s")


def test_health(tmp):
    """A TCP metrics exporter whose port is taken at start is degraded, says so (a metric, a
    gpupoolctl status line) and serves once the port is free again; a reload that read keys
    only a restart applies leaves that visible in gpupoolctl status until the file agrees
    with what runs again."""
    sock = os.path.join(tmp, "gp.sock")
    msock = os.path.join(tmp, "metrics.sock")
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    n = Notify(tmp)
    conf = host_conf(tmp, sock, f"metrics_socket = {msock}\nmetrics_listen = {port}\n")
    d = start_daemon(tmp, ["--config", conf], notify=n)
    n.wait("READY=1")
    out, _ = ctl(sock, "status")
    check(re.search(r"^metrics exporters: .*tcp degraded: cannot listen", out, re.M)
          and "socket ok" in out, f"status does not show the degraded exporter: {out}")
    check(json.loads(ctl(sock, "--json", "status")[0])["metrics_exporters"].find("tcp degraded") >= 0,
          "--json status metrics_exporters")
    body = metrics_over_socket(msock)
    check('gpupool_metrics_exporter_up{exporter="tcp"} 0' in body
          and 'gpupool_metrics_exporter_up{exporter="socket"} 1' in body, f"exporter metric: {body[:2000]}")
    blocker.close()
    wait_for("the TCP exporter did not serve once its port was free",
             lambda: "tcp ok" in ctl(sock, "status")[0])
    check(http_get("127.0.0.1", port).startswith("HTTP/1.0 200"), "TCP metrics after the retry")
    check('gpupool_metrics_exporter_up{exporter="tcp"} 1' in metrics_over_socket(msock), "metric after recovery")
    check("recovered" in log_of(d), "the log does not say the exporter recovered")

    # A reload that left restart-only keys: status keeps saying so.
    out, _ = ctl(sock, "status")
    check("restart pending" not in out, f"restart pending before any reload: {out}")
    write(conf, open(conf).read().replace("[daemon]\n", "[daemon]\nlisten_backlog = 77\nmax_clients = 99\n"))
    d.send_signal(signal.SIGHUP)
    n.wait("READY=1")
    out, _ = ctl(sock, "status")
    check(re.search(r"^restart pending: .*listen_backlog", out, re.M) and "max_clients" not in out,
          f"status after a reload that left listen_backlog for a restart: {out}")
    check("listen_backlog" in json.loads(ctl(sock, "--json", "status")[0])["restart_pending"], "--json restart_pending")
    time.sleep(1.2)  # status is asked again later: the trace lasts
    check("restart pending" in ctl(sock, "status")[0], "the restart-pending line did not last")
    write(conf, open(conf).read().replace("listen_backlog = 77\n", ""))
    d.send_signal(signal.SIGHUP)
    n.wait("READY=1")
    out, _ = ctl(sock, "status")
    check("restart pending" not in out, f"restart pending after the file agrees with what runs: {out}")
    stop(d)


# ---- quiet -----------------------------------------------------------------------------------

def test_quiet(tmp):
    """log_level = error: not one line below it, from start to stop (the backend's choice
    included, which is made before the file is applied); and on a host where auto picks host
    memory, the log gives no advice to install a GPU driver."""
    sock = os.path.join(tmp, "gp.sock")
    for backend in ("host", "auto"):
        conf = os.path.join(tmp, f"quiet-{backend}.conf")
        write(conf, f"[daemon]\nsocket = {sock}\nbackend = {backend}\nlog_level = error\n"
                    "[pool default]\nkind = host\ncapacity = 16M\nslab_size = 2M\n")
        n = Notify(tmp)
        d = start_daemon(tmp, ["--config", conf], notify=n)
        n.wait("READY=1")
        ctl(sock, "status")
        stop(d)
        log = log_of(d)
        check(d.returncode == 0, f"exit status {d.returncode}")
        check(not re.search(r"\b(info|warn|debug): ", log), f"log_level = error, backend {backend}: {log}")
        # The same through --log-level, which the command line sets over the file.
        d = start_daemon(tmp, ["--config", host_conf(tmp, sock), "--log-level", "error"], notify=(n := Notify(tmp)))
        n.wait("READY=1")
        stop(d)
        check(not re.search(r"\b(info|warn|debug): ", log_of(d)), f"--log-level error: {log_of(d)}")

    # auto on this host: whichever backend it picks, no advice to install a driver when it
    # serves host memory (a choice, not a failure).
    conf = os.path.join(tmp, "auto.conf")
    write(conf, f"[daemon]\nsocket = {sock}\nbackend = auto\nlog_level = info\n")
    n = Notify(tmp)
    d = start_daemon(tmp, ["--config", conf], notify=n)
    n.wait("READY=1")
    stop(d)
    log = log_of(d)
    if "backend: host (auto" in log:
        check("install the NVIDIA driver" not in log and "rebuild" not in log and "--backend host" not in log,
              f"auto chose host memory and the log advises a fix: {log}")
    else:
        print("(auto chose the GPU here: the host-memory line is not exercised)")


# ---- timeout ---------------------------------------------------------------------------------

def python_client(sock, code, timeout=60):
    env = dict(CLEAN_ENV, PYTHONPATH=PYTHON_DIR, GPUPOOL_LIBRARY=LIBGPUPOOL)
    if os.environ.get("GPUPOOL_TEST_PY_PRELOAD"):
        # The interpreter's own allocations are not ours to check: no leak detection there.
        env.update(LD_PRELOAD=os.environ["GPUPOOL_TEST_PY_PRELOAD"], ASAN_OPTIONS="detect_leaks=0")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code, sock], capture_output=True, text=True,
                       env=env, timeout=timeout)
    print(f"python -> {p.returncode} in {time.monotonic() - t0:.1f} s\n{p.stdout}{p.stderr}")
    return p, time.monotonic() - t0


def serve_fake(path, answer):
    """A Unix socket that is not gpupoold: answers every connection with `answer` and closes."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)

    def loop():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            try:
                c.settimeout(2)
                try:
                    c.recv(4096)
                except OSError:
                    pass
                c.sendall(answer)
            except OSError:
                pass
            c.close()

    threading.Thread(target=loop, daemon=True).start()
    return srv


def test_timeout(tmp):
    sock = os.path.join(tmp, "gp.sock")
    d = start_ready(tmp, sock)
    os.kill(d.pid, signal.SIGSTOP)
    try:
        env = dict(CLEAN_ENV, GPUPOOL_CONNECT_TIMEOUT_MS="1500")
        t0 = time.monotonic()
        _, err = ctl(sock, "status", expect=3, env=env)
        took = time.monotonic() - t0
        check("did not answer in 1.5 s" in err, f"gpupoolctl on a stopped daemon: {err}")
        check(took < 10, f"gpupoolctl took {took:.1f} s on a stopped daemon")
        out, _ = ctl(sock, "--json", "status", expect=3, env=env)
        check("did not answer" in json.loads(out)["error"], "--json error on a stopped daemon")

        # Python: the default timeout (a few seconds), and one set in the constructor.
        p, took = python_client(sock, "import sys, gpupool\n"
                                "try:\n    gpupool.Client(sys.argv[1])\n"
                                "except gpupool.GpupoolError as e:\n    print(e); sys.exit(7)\n")
        check(p.returncode == 7 and "did not answer in 5 s" in p.stdout,
              "gpupool.Client() on a stopped daemon did not time out with the message")
        check(took < 20, f"gpupool.Client() took {took:.1f} s")
        p, took = python_client(sock, "import sys, gpupool\n"
                                "try:\n    gpupool.Client(sys.argv[1], connect_timeout=0.5)\n"
                                "except gpupool.GpupoolError as e:\n    print(e); sys.exit(7)\n")
        check(p.returncode == 7 and "did not answer in 0.5 s" in p.stdout and took < 10,
              "gpupool.Client(connect_timeout=0.5)")
        # gpupoolctl's own default is the library's: an operator and a program wait alike.
        _, err = ctl(sock, "status", expect=3)
        check("did not answer in 5 s" in err, f"gpupoolctl's default timeout is not the library's 5 s: {err}")
    finally:
        os.kill(d.pid, signal.SIGCONT)
    ctl(sock, "status")
    stop(d)

    # A listener whose backlog is full (it never accepts): connect() itself would block.
    full = os.path.join(tmp, "full.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(full)
    srv.listen(0)
    fillers = []
    while True:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(full)
        except BlockingIOError:
            c.close()
            break
        fillers.append(c)
        check(len(fillers) < 1000, "the backlog never filled")
    env = dict(CLEAN_ENV, GPUPOOL_CONNECT_TIMEOUT_MS="1000")
    t0 = time.monotonic()
    _, err = ctl(full, "status", expect=3, env=env)
    check("did not answer in 1 s" in err and time.monotonic() - t0 < 10,
          f"gpupoolctl on a full backlog: {err}")
    p, took = python_client(full, "import sys, gpupool\n"
                            "try:\n    gpupool.Client(sys.argv[1], connect_timeout=1)\n"
                            "except gpupool.GpupoolError as e:\n    print(e); sys.exit(7)\n")
    check(p.returncode == 7 and "did not answer in 1 s" in p.stdout and took < 10,
          "gpupool.Client() on a full backlog")
    for c in fillers:
        c.close()
    srv.close()

    # Not gpupoold: an HTTP server, and one that closes without a word.
    for name, answer in (("http", b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"),
                         ("silent", b"")):
        path = os.path.join(tmp, f"{name}.sock")
        srv = serve_fake(path, answer)
        _, err = ctl(path, "status", expect=3)
        check("this socket is not gpupoold" in err and path in err, f"{name}: {err}")
        check("restart" not in err, f"{name}: the message blames a daemon restart: {err}")
        # A socket closed before Hello is also what a gpupoold that failed to start looks
        # like: the message says where to look.
        check(name != "silent" or ("journalctl -u gpupoold" in err and "--check-config" in err),
              f"{name}: the message does not say where to look: {err}")
        p, _ = python_client(path, "import sys, gpupool\n"
                             "try:\n    gpupool.Client(sys.argv[1])\n"
                             "except gpupool.GpupoolError as e:\n    print(e); sys.exit(7)\n")
        check(p.returncode == 7 and "this socket is not gpupoold" in p.stdout, f"python {name}")
        # What came is another protocol, not a gpupool frame too large: no frame-size advice.
        for text in (err, p.stdout):
            check("frame" not in text.replace("gpupool frame", "").replace("gpupool reply", "")
                  and "max_frame" not in text and "smaller messages" not in text,
                  f"{name}: the message carries frame-size advice: {text}")
        check(name != "http" or '"HTTP"' in err, f"{name}: the message does not say what came: {err}")
        srv.close()

    # GPUPOOL_SOCKET naming a directory (/tmp): the library's message whole, never "remove it".
    env = dict(CLEAN_ENV, PYTHONPATH=PYTHON_DIR, GPUPOOL_LIBRARY=LIBGPUPOOL, GPUPOOL_SOCKET="/tmp")
    if os.environ.get("GPUPOOL_TEST_PY_PRELOAD"):
        env.update(LD_PRELOAD=os.environ["GPUPOOL_TEST_PY_PRELOAD"], ASAN_OPTIONS="detect_leaks=0")
    p = subprocess.run([sys.executable, "-c", "import gpupool\ntry:\n    gpupool.Client()\n"
                        "except gpupool.GpupoolError as e:\n    print(e)\n"], capture_output=True, text=True,
                       env=env, timeout=60)
    print(p.stdout, p.stderr)
    check("/tmp is a directory, not a socket" in p.stdout and "remove" not in p.stdout
          and p.stdout.rstrip().endswith("GPUPOOL_SOCKET"), f"python with GPUPOOL_SOCKET=/tmp: {p.stdout!r}")


# ---- identity --------------------------------------------------------------------------------

def reachable_copy(tmp, exe):
    """A copy of exe that any uid can run: the build tree may sit in a 0700 home."""
    d = os.path.join(tmp, "bin")
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o755)
    dst = os.path.join(d, os.path.basename(exe))
    shutil.copy2(exe, dst)
    os.chmod(dst, 0o755)
    return dst


def test_identity(tmp):
    os.chmod(tmp, 0o755)
    sock = os.path.join(tmp, "gp.sock")
    # Socket activation: the daemon gets a pre-bound socket as fd 3, as under systemd.
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(sock)
    lsock.listen(16)
    os.chmod(sock, 0o660)
    n = Notify(tmp)
    env = dict(CLEAN_ENV, NOTIFY_SOCKET=n.path, LISTEN_FDS="1")
    log = open(os.path.join(tmp, "activated.log"), "w+")

    conf = host_conf(tmp, "", "")
    # LISTEN_PID must name the daemon itself: exec through sh, which keeps its pid.
    d = subprocess.Popen(["sh", "-c", 'LISTEN_PID=$$ exec "$0" --config "$1" 3<&"$2"', GPUPOOLD,
                          conf, str(lsock.fileno())], env=env, stdout=log,
                         stderr=subprocess.STDOUT, pass_fds=(lsock.fileno(),))
    d.logfile = log
    PROCS.append(d)
    lsock.close()
    n.wait("READY=1")
    out, _ = ctl(sock, "status")
    check(re.search(rf"\bpid {d.pid}\b", out), f"status does not show the daemon's pid {d.pid}")
    check(not re.search(r"\bpid 1\b", out), "status shows pid 1")
    check(re.search(rf"\buid {os.geteuid()}\b", out), "status does not show the daemon's uid")
    st = json.loads(ctl(sock, "--json", "status")[0])
    check(st["daemon_pid"] == d.pid and st["daemon_uid"] == os.geteuid(), f"--json status {st}")
    # One version key (the daemon's, as daemon_pid and daemon_uid), as stats has it.
    check(st["daemon_version"] and "version" not in st, f"--json version {st}")
    stats = json.loads(ctl(sock, "--json", "stats")[0])
    check(stats["daemon_pid"] == d.pid and stats["daemon_uid"] == os.geteuid(), f"stats {stats}")

    # A failure under --json is JSON too.
    out, err = ctl(os.path.join(tmp, "none.sock"), "--json", "status", expect=3)
    try:
        e = json.loads(out)
    except ValueError:
        fail(f"--json printed no JSON on failure: {out!r}")
    check(isinstance(e.get("error"), str) and "none.sock" in e["error"], f"--json error {e}")

    if os.geteuid() != 0:
        print("(not root: permission messages are not exercised)")
        stop(d)
        return
    # Refused by the socket's mode: the message names its real owner, group and mode.
    exe = reachable_copy(tmp, GPUPOOLCTL)
    gid = 4242
    try:
        gname = grp.getgrgid(gid).gr_name
    except KeyError:
        gname = str(gid)
    os.chown(sock, 0, gid)
    os.chmod(sock, 0o660)
    _, err = ctl(sock, "status", expect=3, user=65534, exe=exe)
    owner = pwd.getpwuid(0).pw_name
    check("permission denied" in err and f"owner {owner}" in err and f"group {gname}" in err
          and "mode 0660" in err, f"permission message: {err}")
    check("group (gpupool)" not in err, f"message names gpupool whatever the group: {err}")
    os.chmod(sock, 0o666)
    out, _ = ctl(sock, "status", user=65534, exe=exe)
    check(re.search(rf"\bpid {d.pid}\b", out), "status as another uid")
    _, err = ctl(sock, "clients", user=65534, exe=exe, expect=1)
    check(f"uid {os.geteuid()}" in err, f"admin refusal does not name the daemon's uid: {err}")
    stop(d)


# ---- configerror -----------------------------------------------------------------------------

def start_activated(tmp, conf, name):
    """gpupoold socket-activated on tmp/NAME.sock with conf, as under systemd: the listening
    socket at fd 3, LISTEN_PID naming the daemon itself. Returns (daemon, socket, notify)."""
    sock = os.path.join(tmp, f"{name}.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(sock)
    lsock.listen(16)
    n = Notify(tmp)
    env = dict(CLEAN_ENV, NOTIFY_SOCKET=n.path, LISTEN_FDS="1")
    log = open(os.path.join(tmp, f"{name}.log"), "w+")
    # LISTEN_PID must name the daemon itself: exec through sh, which keeps its pid.
    d = subprocess.Popen(["sh", "-c", 'LISTEN_PID=$$ exec "$0" --config "$1" 3<&"$2"', GPUPOOLD,
                          conf, str(lsock.fileno())], env=env, stdout=log,
                         stderr=subprocess.STDOUT, pass_fds=(lsock.fileno(),))
    d.logfile = log
    PROCS.append(d)
    lsock.close()
    return d, sock, n


def test_configerror(tmp):
    """A daemon up in config-error mode is told apart from one that is down: gpupoolctl exits
    4 (not 3, "could not be reached") with the daemon's reason, and STATUS= says it."""
    conf = os.path.join(tmp, "gpupoold.conf")
    write(conf, "[daemon]\nbackend = host\nmax_clients = lots\n")
    d, sock, n = start_activated(tmp, conf, "ce")
    status = n.wait("STATUS=Configuration error, not serving")
    check(f"{conf}:3:" in status and "'lots'" in status, f"STATUS= lacks the reason: {status!r}")
    n.wait("READY=1")
    _, err = ctl(sock, "status", expect=4)
    check("not serving" in err and f"{conf}:3:" in err and "'lots'" in err and "--check-config" in err,
          f"gpupoolctl status does not say why the daemon does not serve: {err!r}")
    check("could not be reached" not in err and "closed the connection" not in err,
          f"gpupoolctl reads an answering daemon as unreachable: {err!r}")
    out, _ = ctl(sock, "--json", "status", expect=4)
    check("'lots'" in json.loads(out).get("error", ""), f"--json: {out!r}")
    # Another command answers the same; a missing daemon is still 3.
    ctl(sock, "stats", expect=4)
    ctl(os.path.join(tmp, "none.sock"), "status", expect=3)
    # Fixed and reloaded: served, exit 0.
    write(conf, "[daemon]\nbackend = host\nmax_clients = 64\n")
    os.kill(d.pid, signal.SIGHUP)
    n.wait("STATUS=Serving")
    ctl(sock, "status", expect=0)
    stop(d)
    check(d.returncode == 0, f"gpupoold exited {d.returncode}")



# ---- reload ----------------------------------------------------------------------------------

def exec_reload(conf, mainpid):
    """The unit's ExecReload= lines run as systemd runs them: in order, with $MAINPID, the
    first failure failing the job. Returns (exit status of the job, what they printed)."""
    with open(UNIT_TEMPLATE) as f:
        lines = [l[len("ExecReload="):] for l in f.read().splitlines() if l.startswith("ExecReload=")]
    check(lines, "gpupoold.service has no ExecReload=")
    out = ""
    for line in lines:
        line = (line.replace("@CMAKE_INSTALL_FULL_SBINDIR@/gpupoold", GPUPOOLD)
                .replace("@GPUPOOL_CONFIG_FILE@", conf).replace("$MAINPID", str(mainpid)))
        check("@" not in line, f"an unreplaced placeholder in ExecReload={line}")
        p = subprocess.run(shlex.split(line), capture_output=True, text=True, timeout=60,
                           env=dict(CLEAN_ENV, MAINPID=str(mainpid)))
        out += p.stdout + p.stderr
        if p.returncode != 0:
            return p.returncode, out
    return 0, out


def test_reload(tmp):
    """`systemctl reload` fails for a file the daemon would reject, and the daemon keeps its
    configuration; a good file reloads."""
    sock = os.path.join(tmp, "gp.sock")
    n = Notify(tmp)
    conf = host_conf(tmp, sock)
    d = start_daemon(tmp, ["--config", conf], notify=n)
    n.wait("READY=1")
    write(conf, open(conf).read().replace("[daemon]\n", "[daemon]\nmax_clinets = 5\n"))
    rc, out = exec_reload(conf, d.pid)
    print(f"reload of a file with max_clinets: {rc}\n{out}")
    check(rc != 0, "the reload of a file the daemon rejects succeeded")
    check("max_clinets" in out, f"the failed reload does not say why: {out!r}")
    time.sleep(0.3)
    log = log_of(d)
    check("reload: configuration not changed" not in log and "reloaded " not in log,
          f"the daemon was signalled although the file was rejected: {log}")
    ctl(sock, "status", expect=0)
    # A good change reloads, and the daemon applies it.
    write(conf, open(conf).read().replace("max_clinets = 5", "max_clients = 99"))
    rc, out = exec_reload(conf, d.pid)
    print(f"reload of a good file: {rc}\n{out}")
    check(rc == 0, f"the reload of a good file failed: {out!r}")
    end = time.monotonic() + 10
    while "changed: max_clients" not in log_of(d) and time.monotonic() < end:
        time.sleep(0.05)
    check("changed: max_clients" in log_of(d), f"the daemon did not apply the reload: {log_of(d)}")
    stop(d)
    check(d.returncode == 0, f"gpupoold exited {d.returncode}")



def main():
    tmp = tempfile.mkdtemp(prefix="gpupool-ops-")
    try:
        {"startup": test_startup, "unlink": test_unlink, "tcp": test_tcp, "quiet": test_quiet, "config": test_config,
         "health": test_health, "timeout": test_timeout, "identity": test_identity,
         "configerror": test_configerror, "reload": test_reload}[MODE](tmp)
    except BaseException:
        for p in PROCS:
            if hasattr(p, "logfile"):
                sys.stderr.write(f"---- daemon {p.pid} log ----\n{log_of(p)}----\n")
        print(f"files kept in {tmp}", file=sys.stderr)
        raise
    finally:
        for p in PROCS:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    shutil.rmtree(tmp, ignore_errors=True)
    print("ok")


if __name__ == "__main__":
    main()
