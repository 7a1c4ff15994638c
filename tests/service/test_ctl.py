#!/usr/bin/env python3
"""gpupoolctl and the metrics exporters against a live gpupoold.

Starts the real daemon (host backend, two small pools, metrics on a textfile and a socket,
all in a temp dir) with a private NOTIFY_SOCKET to know when it is ready, and a client
process (svc_holder) that holds and publishes a buffer. Then:

  ctl      status, stats, clients, buffers, names and trim, as text and as JSON (parsed, with
           a client name full of characters JSON must escape); admin refused for another
           uid with a message naming who may; a missing daemon named with its socket path
           and how to start it; drop-client disconnects the holder, whose next request fails
           (reconnection off) or reconnects with its hold reported lost (the default).
  metrics  the textfile appears and holds per-pool gauges and request counters in valid
           exposition format; the socket answers HTTP/1.0 200 with the same families and
           values; both go away when the daemon stops.

Usage: test_ctl.py ctl|metrics GPUPOOLD GPUPOOLCTL SVC_HOLDER
"""
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

from svc_common import check, fail, read_to_end, recv_notify

MODE, GPUPOOLD, GPUPOOLCTL, HOLDER = sys.argv[1:5]
# Quotes, a backslash and UTF-8: what JSON must escape or pass through. (The daemon itself
# replaces control characters in client names.)
HOLDER_NAME = 'svc "holder" \\ caf\u00e9'
PUBLISHED = "svc.test/tensor"
# gpupoolctl shows every name with its namespace (the publisher's tenant).
PUBLISHED_KEY = "uid:0/" + PUBLISHED


class Daemon:
    started = []

    def __init__(self, tmp):
        self.tmp = tmp
        self.sock = os.path.join(tmp, "gp.sock")
        self.prom = os.path.join(tmp, "gpupool.prom")
        self.msock = os.path.join(tmp, "metrics.sock")
        self.conf = os.path.join(tmp, "gpupoold.conf")
        with open(self.conf, "w") as f:
            f.write(
                "[daemon]\n"
                f"socket = {self.sock}\n"
                "backend = host\n"
                "socket_mode = 0666\n"
                f"metrics_textfile = {self.prom}\n"
                f"metrics_socket = {self.msock}\n"
                "metrics_interval_ms = 200\n"
                "[pool default]\n"
                "kind = host\n"
                "capacity = 64M\n"
                "slab_size = 4M\n"
                "[pool second]\n"
                "kind = host\n"
                "capacity = 32M\n"
                "slab_size = 2M\n"
            )
        self.notify_path = os.path.join(tmp, "notify.sock")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        env = dict(os.environ, NOTIFY_SOCKET=self.notify_path)
        for k in ("LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC", "WATCHDOG_PID", "GPUPOOL_SOCKET"):
            env.pop(k, None)
        self.log = open(os.path.join(tmp, "gpupoold.log"), "w")
        self.proc = subprocess.Popen([GPUPOOLD, "--config", self.conf], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        Daemon.started.append(self)
        self.wait_notify("READY=1", 15)

    def wait_notify(self, want, timeout):
        msg = recv_notify(self.notify, want, timeout)
        if msg is not None:
            return msg
        self.dump()
        fail(f"gpupoold did not send {want} within {timeout} s")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(15)
        if rc != 0:
            self.dump()
        check(rc == 0, f"gpupoold exited with {rc} after SIGTERM")

    def dump(self):
        self.log.flush()
        with open(self.log.name) as f:
            sys.stderr.write("---- gpupoold log ----\n" + f.read() + "----\n")


def reachable_copy(tmp, exe):
    """A copy of exe that another uid can run: the build tree may lie in a 0700 home
    (a clone in /root), which that uid cannot enter."""
    d = os.path.join(tmp, "bin")
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o755)
    dst = os.path.join(d, os.path.basename(exe))
    if not os.path.exists(dst):
        shutil.copy2(exe, dst)
        os.chmod(dst, 0o755)
    return dst


def ctl(daemon, *args, user=None, expect=0, socket_path=None):
    exe = GPUPOOLCTL if user is None else reachable_copy(
        daemon.tmp if daemon else os.path.dirname(socket_path), GPUPOOLCTL)
    cmd = [exe, "--socket", socket_path or daemon.sock, *args]
    kw = {}
    if user is not None:
        def drop():
            os.setgroups([])
            os.setgid(user)
            os.setuid(user)
        kw["preexec_fn"] = drop
    p = subprocess.run(cmd, capture_output=True, timeout=30, **kw)
    out, err = p.stdout.decode("utf-8"), p.stderr.decode("utf-8", "replace")
    print(f"$ gpupoolctl {' '.join(args)} -> {p.returncode}\n{out}{err}", end="")
    if expect is not None and p.returncode != expect:
        fail(f"gpupoolctl {' '.join(args)} exited {p.returncode}, expected {expect}:\n{err}")
    return out, err


def ctl_json(daemon, *args):
    out, _ = ctl(daemon, "--json", *args)
    try:
        return json.loads(out)
    except ValueError as e:
        fail(f"gpupoolctl --json {' '.join(args)} printed invalid JSON ({e}):\n{out}")


def start_holder(daemon, mode="closed", name=HOLDER_NAME, published=PUBLISHED, extras=(),
                 size=1 << 20):
    """published: one name, or several separated by commas, all for the one buffer; extras:
    "bundle=NAME" (two members, published twice: version 2), "file=NAME:PATH"."""
    h = subprocess.Popen([HOLDER, daemon.sock, name, published, str(size), mode, *extras],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = h.stdout.readline()
    check(line.strip() == "ready", f"svc_holder did not get ready: {line!r}")
    return h


def test_ctl(tmp):
    d = Daemon(tmp)
    holder = start_holder(d)
    try:
        out, _ = ctl(d, "status")
        check("backend host" in out, "status lacks the backend")
        check(re.search(r"^default\s", out, re.M) and re.search(r"^second\s", out, re.M),
              "status lacks the pool rows")
        check("64.0 MiB" in out and "32.0 MiB" in out, "status lacks the human capacities")
        check("1.00 MiB" in out, "status lacks the 1 MiB in use")

        st = ctl_json(d, "status")
        check(st["backend"] == "host" and st["clients"] >= 2, f"status --json: {st}")
        pools = {p["name"]: p for p in st["pools"]}
        check(set(pools) == {"default", "second"}, f"pools {list(pools)}")
        check(pools["default"]["capacity"] == 64 << 20, "default capacity")
        check(pools["default"]["used"] >= 1 << 20, "default used")
        st2 = ctl_json(d, "stats")
        check(st2["names"] == 1 and st2["buffers"] >= 1, f"stats --json: {st2}")
        out, _ = ctl(d, "stats")
        check(re.search(r"^pool\.default\.capacity 67108864$", out, re.M), "stats text")

        out, _ = ctl(d, "clients")
        check(str(holder.pid) in out, "clients lacks the holder's pid")
        check(HOLDER_NAME in out, "clients lacks the holder's name")
        cl = ctl_json(d, "clients")["clients"]
        mine = [c for c in cl if c["pid"] == holder.pid]
        check(len(mine) == 1, f"holder not in clients: {cl}")
        check(mine[0]["name"] == HOLDER_NAME, f"name did not survive JSON: {mine[0]['name']!r}")
        check(mine[0]["holds"] >= 1 and mine[0]["bytes"] >= 1 << 20, f"holder entry {mine[0]}")
        check(any(c["self"] for c in cl), "gpupoolctl's own connection is not marked self")

        bufs = ctl_json(d, "buffers")["buffers"]
        named = [b for b in bufs if b["name"] == PUBLISHED_KEY]
        check(len(named) == 1, f"published buffer missing: {bufs}")
        b = named[0]
        check(b["pool"] == "default" and b["size"] >= 1 << 20 and b["owner_pid"] == holder.pid
              and b["holders"] >= 1, f"buffer entry {b}")
        out, _ = ctl(d, "buffers")
        check(PUBLISHED in out and "1.00 MiB" in out, "buffers text")
        out, _ = ctl(d, "names")
        check(PUBLISHED in out, "names text")
        names = ctl_json(d, "names")["names"]
        check([n["name"] for n in names] == [PUBLISHED_KEY], f"names --json {names}")

        tr = ctl_json(d, "trim")
        check(isinstance(tr["slabs_freed"], int) and isinstance(tr["slabs_revoked"], int),
              f"trim --json {tr}")
        ctl(d, "trim")

        if os.geteuid() == 0:
            os.chmod(tmp, 0o755)
            _, err = ctl(d, "clients", user=65534, expect=1)
            check("permission denied" in err and "root or the daemon's own user" in err,
                  f"admin refusal message: {err}")
            ctl(d, "status", user=65534, expect=0)
        else:
            print("(not root: the other-uid refusal is not exercised)")

        missing = os.path.join(tmp, "nothing-here.sock")
        _, err = ctl(d, "status", socket_path=missing, expect=3)
        check(missing in err and "systemctl start gpupoold.socket" in err,
              f"not-running message: {err}")
        ctl(d, "frobnicate", expect=2)
        ctl(d, "drop-client", "abc", expect=2)
        out, _ = ctl(d, "--version")
        check(out.startswith("gpupoolctl "), "--version")
        out, _ = ctl(d, "--help")
        check("drop-client PID" in out, "--help")

        out, _ = ctl(d, "drop-client", str(holder.pid))
        check("dropped 1 connection" in out, f"drop-client output: {out}")
        holder.stdin.write("go\n")
        holder.stdin.flush()
        after = holder.stdout.readline().strip()
        rc = holder.wait(15)
        check(rc == 0, f"the dropped client's next request did not fail as closed: {after}")
        _, err = ctl(d, "drop-client", str(holder.pid), expect=1)
        check("no client with pid" in err, "second drop-client message")
        cl = ctl_json(d, "clients")["clients"]
        check(all(c["pid"] != holder.pid for c in cl), "dropped client still listed")
        # Its holds are gone; the published name keeps the buffer.
        names = ctl_json(d, "names")["names"]
        check(len(names) == 1 and names[0]["holders"] == 1, f"after drop: {names}")

        # A client that keeps the library's default reconnects on its next request, and
        # learns that the hold it had is lost.
        h2 = start_holder(d, "reconnect", "svc-reconnect", "svc.test/second")
        try:
            out, _ = ctl(d, "drop-client", str(h2.pid))
            check("dropped 1 connection" in out, f"drop-client output: {out}")
            h2.stdin.write("go\n")
            h2.stdin.flush()
            after = h2.stdout.readline().strip()
            check(h2.wait(15) == 0, f"the reconnecting client did not see its hold lost: {after}")
        finally:
            if h2.poll() is None:
                h2.kill()
                h2.wait()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    d.stop()


# What a script gets from `buffers --json` and `names --json`: every column of the text
# tables, and the ids that join them.
BUFFER_FIELDS = {"id", "pool_id", "pool", "size", "holders", "age_s", "owner_pid", "name", "names"}
NAME_FIELDS = {"name", "kind", "uid", "version", "size", "age_s", "members", "buffers", "path"}
NAME_BUFFER_FIELDS = NAME_FIELDS | {"id", "pool", "holders", "owner_pid"}


def test_listing(tmp):
    """Every name is listed: three names on one buffer, a bundle, a file; buffers sorted by id."""
    d = Daemon(tmp)
    ns = f"uid:{os.geteuid()}/"
    fpath = os.path.join(tmp, "weights.bin")
    with open(fpath, "wb") as f:
        f.write(b"w" * 12345)
    # Published in an order that is not the sorted one.
    three = ["svc.c/third", "svc.a/first", "svc.b/second"]
    first = start_holder(d, name="three-names", published=",".join(three),
                         extras=["bundle=svc.bundle", f"file=svc.file:{fpath}"])
    second = start_holder(d, name="one-name", published="svc.0/later", size=1 << 16)
    try:
        st = ctl_json(d, "stats")
        check(st["names"] == 6, f"stats counts {st['names']} names, expected 6")

        names = ctl_json(d, "names")["names"]
        keys = [n["name"] for n in names]
        want = sorted([ns + k for k in three] + [ns + "svc.bundle", ns + "svc.file", ns + "svc.0/later"])
        check(keys == want, f"names --json lists {keys}, expected {want}")
        by = {n["name"]: n for n in names}
        for n in names:
            need = NAME_BUFFER_FIELDS if n["kind"] != "file" else NAME_FIELDS
            check(need <= set(n), f"names --json entry lacks {need - set(n)}: {n}")
        ids = {by[ns + k]["id"] for k in three}
        check(len(ids) == 1, f"the three names are not of one buffer: {ids}")
        for k in three:
            n = by[ns + k]
            check(n["kind"] == "buffer" and n["members"] == 1 and n["version"] == 1
                  and n["size"] == 1 << 20 and n["owner_pid"] == first.pid
                  and n["pool"] == "default" and n["uid"] == os.geteuid(), f"buffer name {n}")
        b = by[ns + "svc.bundle"]
        check(b["kind"] == "bundle" and b["version"] == 2 and b["members"] == 2
              and b["size"] >= 8192 + 4096 and len(b["buffers"]) >= 1, f"bundle name {b}")
        f = by[ns + "svc.file"]
        check(f["kind"] == "file" and f["size"] == 12345 and f["members"] == 0
              and os.path.realpath(f["path"]) == os.path.realpath(fpath), f"file name {f}")
        files = ctl_json(d, "names")["files"]
        check([x["name"] for x in files] == [ns + "svc.file"], f"names --json files {files}")

        out, _ = ctl(d, "names")
        rows = [ln.split()[0] for ln in out.splitlines()[1:] if ln.strip()]
        check(rows == want, f"names text lists {rows}, expected {want}")
        check(re.search(r"svc\.bundle\s+bundle\s+2\s.*2 members$", out, re.M),
              f"names text lacks the bundle's version and members:\n{out}")
        check(re.search(r"svc\.file\s+file\s.*12\.1 KiB.*" + re.escape(os.path.realpath(fpath)) + "$",
                        out, re.M) or fpath in out, f"names text lacks the file's path:\n{out}")

        bufs = ctl_json(d, "buffers")["buffers"]
        for x in bufs:
            check(BUFFER_FIELDS <= set(x), f"buffers --json entry lacks {BUFFER_FIELDS - set(x)}: {x}")
        got = [x["id"] for x in bufs]
        check(got == sorted(got), f"buffers --json not sorted by id: {got}")
        mine = [x for x in bufs if x["id"] in ids]
        check(len(mine) == 1 and mine[0]["names"] == sorted(ns + k for k in three)
              and mine[0]["name"] == ns + "svc.a/first", f"buffer with three names: {mine}")
        out, _ = ctl(d, "buffers")
        text_ids = [int(ln.split()[0]) for ln in out.splitlines()[1:] if ln.strip()]
        check(text_ids == got, f"buffers text order {text_ids}, json {got}")
        check(", ".join(sorted(ns + k for k in three)) in out,
              f"buffers text lacks the three names:\n{out}")

        if os.geteuid() == 0:
            # Trim gives back every tenant's empty slabs: an operator's request.
            os.chmod(tmp, 0o755)
            _, err = ctl(d, "trim", user=65534, expect=1)
            check("permission denied" in err and "for operators" in err, f"non-admin trim: {err}")
            _, err = ctl(d, "names", user=65534, expect=1)
            check("permission denied" in err, f"non-admin names: {err}")
        else:
            print("(not root: the non-admin trim refusal is not exercised)")
        ctl(d, "trim")
    finally:
        for h in (first, second):
            if h.poll() is None:
                h.kill()
                h.wait()
    d.stop()


def test_messages(tmp):
    """What a failed connect says: a directory in the way (whole, and never "remove it"), a
    regular file in the way, and the socket's real group (never root's); what a mistyped
    command line says; unpublish of a key without its tenant."""
    os.chmod(tmp, 0o755)
    dpath = os.path.join(tmp, "gp.sock")
    os.mkdir(dpath)
    # The socket's directory named instead of the socket (/tmp, say): never advise removing it,
    # and the message reaches its end (the advice names GPUPOOL_SOCKET last).
    for path in (dpath, "/tmp", "/tmp/"):
        _, err = ctl(None, "status", socket_path=path, expect=3)
        check("is a directory, not a socket" in err and path in err,
              f"directory at the socket path: {err}")
        check("remove" not in err, f"the message advises removing the directory {path}: {err}")
        check(err.rstrip().rstrip(".").endswith("GPUPOOL_SOCKET"), f"the message was cut short: {err!r}")
        check("is the daemon running" not in err and "not running" not in err,
              f"directory message blames the daemon: {err}")
        p = subprocess.run([HOLDER, path, "msg", "x", "4096", "closed"], capture_output=True, text=True,
                           timeout=30)
        check(p.returncode == 2 and "is a directory, not a socket" in p.stderr and "remove" not in p.stderr
              and "GPUPOOL_SOCKET" in p.stderr, f"the library's message for a directory: {p.stderr}")
    os.rmdir(dpath)
    # A regular file where the socket goes: that one may be removed, and the message says so whole.
    fpath = os.path.join(tmp, "f" * (100 - len(tmp)) + ".sock")
    open(fpath, "w").close()
    _, err = ctl(None, "status", socket_path=fpath, expect=3)
    check("is a regular file, not a socket" in err and "remove it" in err
          and err.rstrip().rstrip(".").endswith("GPUPOOL_SOCKET"), f"regular file at the socket path: {err!r}")
    os.unlink(fpath)

    # A mistyped command line: the problem and a short usage, not the whole help.
    for args, want in ((["--jsn", "status"], "did you mean '--json'"), (["statsu"], "did you mean 'status'"),
                       (["-x", "status"], "unknown option '-x'"), ([], "no command")):
        p = subprocess.run([GPUPOOLCTL, *args], capture_output=True, text=True, timeout=30)
        print(f"$ gpupoolctl {' '.join(args)} -> {p.returncode}\n{p.stdout}{p.stderr}", end="")
        check(p.returncode == 2 and want in p.stderr, f"gpupoolctl {args}: {p.stderr}")
        check("Commands:" not in p.stderr + p.stdout and len(p.stderr.splitlines()) <= 4,
              f"gpupoolctl {args} printed the whole help: {p.stderr}")
        check("--help" in p.stderr, f"gpupoolctl {args} does not point at --help: {p.stderr}")

    # unpublish of the name as its publisher wrote it (no tenant): the key meant.
    os.mkdir(os.path.join(tmp, "d"))
    d = Daemon(os.path.join(tmp, "d"))
    holder = start_holder(d)
    try:
        _, err = ctl(d, "unpublish", PUBLISHED, expect=1)
        check(f"did you mean '{PUBLISHED_KEY}'" in err, f"unpublish without the tenant: {err}")
        _, err = ctl(d, "unpublish", "no/such/name", expect=1)
        check("uid:1000/no/such/name" in err, f"unpublish of an unknown key without tenant: {err}")
        out, _ = ctl(d, "--json", "unpublish", PUBLISHED, expect=1)
        check("did you mean" in json.loads(out)["error"], f"--json unpublish: {out}")
        ctl(d, "unpublish", PUBLISHED_KEY)
    finally:
        holder.stdin.close()
        holder.wait(15)
    d.stop()

    if os.geteuid() != 0:
        print("(not root: the permission message is not exercised)")
        return
    import grp
    group = grp.getgrgid(1).gr_name if any(g.gr_gid == 1 for g in grp.getgrall()) else None
    gid = 1 if group else 0
    group = group or grp.getgrgid(0).gr_name
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(dpath)
    s.listen(1)
    os.chown(dpath, 0, gid)
    os.chmod(dpath, 0o660)
    try:
        _, err = ctl(None, "status", socket_path=dpath, user=65534, expect=3)
        if gid:
            check(f"usermod -aG {group} $USER" in err and "GROUP" not in err,
                  f"permission message does not name the group {group}: {err}")
        # A socket of root's group: joining that group would give far more than the socket.
        os.chown(dpath, 0, 0)
        _, err = ctl(None, "status", socket_path=dpath, user=65534, expect=3)
        check("permission denied" in err and "usermod" not in err and "sudo" in err,
              f"permission advice for a socket of group root: {err}")
    finally:
        s.close()


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
                    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*)?\})? '
                    r'(-?[0-9.e+-]+|\+Inf|NaN)$')


def parse_exposition(text):
    """Returns {series: value}; fails on anything the 0.0.4 text format does not allow."""
    check(text.endswith("\n"), "exposition does not end with a newline")
    types, series = {}, {}
    helped = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            check(name not in types, f"family {name} declared twice")
            check(name in helped, f"family {name} has no HELP")
            check(kind in ("counter", "gauge", "histogram"), f"type {kind}")
            types[name] = kind
            continue
        m = SAMPLE.match(line)
        check(m is not None, f"not a valid sample line: {line!r}")
        name = m.group(1)
        fam = name if name in types else re.sub(r"_(bucket|sum|count)$", "", name)
        check(fam in types, f"sample {name} without TYPE")
        if fam != name:
            check(types[fam] == "histogram", f"{name} suffix on a {types[fam]}")
        series[name + (m.group(2) or "")] = float(m.group(3))
    # Histograms: buckets cumulative, +Inf equal to _count.
    for key, v in series.items():
        if "_bucket{" in key and 'le="+Inf"' in key:
            labels = re.sub(r',?le="\+Inf"', "", key.split("{", 1)[1][:-1])
            base = key.split("_bucket{")[0]
            check(series[f"{base}_count{{{labels}}}"] == v, f"+Inf != count for {key}")
    return types, series


def scrape(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    s.sendall(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
    data = read_to_end(s)
    s.close()
    return data


def test_metrics(tmp):
    d = Daemon(tmp)
    holder = start_holder(d)
    try:
        end = time.monotonic() + 5
        while not os.path.exists(d.prom) and time.monotonic() < end:
            time.sleep(0.05)
        check(os.path.exists(d.prom), "metrics textfile did not appear within 5 s")
        check(stat.S_IMODE(os.stat(d.prom).st_mode) == 0o644, "textfile mode")
        # Wait for a rewrite that sees the holder's buffer.
        end = time.monotonic() + 5
        while time.monotonic() < end:
            with open(d.prom) as f:
                text = f.read()
            if 'gpupool_pool_used_bytes{pool="default"} 1048576' in text:
                break
            time.sleep(0.1)
        print(text)
        types, series = parse_exposition(text)
        check(series.get('gpupool_pool_capacity_bytes{pool="default"}') == 64 << 20,
              "capacity of default")
        check(series.get('gpupool_pool_capacity_bytes{pool="second"}') == 32 << 20,
              "capacity of second")
        check(series.get('gpupool_pool_used_bytes{pool="default"}') == 1 << 20, "used")
        check(series.get('gpupool_pool_buffers{pool="default"}') == 1, "buffers")
        check(series.get("gpupool_names") == 1, "names gauge")
        check(series.get("gpupool_clients", 0) >= 1, "clients gauge")
        for fam in ("gpupool_pool_reserved_bytes", "gpupool_pool_used_high_bytes",
                    "gpupool_pool_reserved_high_bytes", "gpupool_pool_backend_used_bytes",
                    "gpupool_pool_backend_reserved_bytes", "gpupool_pool_slabs", "gpupool_holds",
                    "gpupool_open_fds", "gpupool_pending_frees", "gpupool_waiting_leases",
                    "gpupool_uptime_seconds",
                    "gpupool_requests_total", "gpupool_request_duration_seconds"):
            check(fam in types, f"family {fam} missing")
        check(series.get('gpupool_requests_total{type="allocate",result="ok"}', 0) >= 1,
              "allocate counter")
        check(series.get('gpupool_requests_total{type="publish",result="ok"}', 0) >= 1,
              "publish counter")
        check(types["gpupool_request_duration_seconds"] == "histogram", "histogram type")
        check(not os.path.exists(d.prom + ".tmp"), "temporary textfile left behind")

        resp = scrape(d.msock)
        head, _, body = resp.partition("\r\n\r\n")
        check(head.startswith("HTTP/1.0 200 OK\r\n")
              and "\r\nContent-Type: text/plain; version=0.0.4" in head
              and f"\r\nContent-Length: {len(body.encode())}" in head,
              f"socket answer head: {resp[:200]!r}")
        stypes, sseries = parse_exposition(body)
        check(stypes == types, "socket and textfile expose different families")
        for key in ('gpupool_pool_capacity_bytes{pool="default"}',
                    'gpupool_pool_used_bytes{pool="default"}', "gpupool_names"):
            check(sseries[key] == series[key], f"{key} differs between socket and textfile")

        if shutil.which("curl"):
            p = subprocess.run(["curl", "-sS", "--fail", "--unix-socket", d.msock,
                                "http://localhost/metrics"], capture_output=True, timeout=30)
            check(p.returncode == 0, f"curl: {p.stderr.decode()}")
            check(b'gpupool_pool_capacity_bytes{pool="default"} 67108864' in p.stdout, "curl body")
        # An idle connection (no request) still gets its answer and is closed.
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(d.msock)
        data = read_to_end(s)
        s.close()
        check(data.startswith(head), "idle connection got no answer")
    finally:
        holder.stdin.close()
        holder.wait(15)
    d.stop()
    check(not os.path.exists(d.msock), "metrics socket left after stop")
    check(not os.path.exists(d.prom), "textfile left after stop")


def main():
    tmp = tempfile.mkdtemp(prefix="gpupool-ctl-")
    try:
        {"ctl": test_ctl, "metrics": test_metrics, "listing": test_listing,
         "messages": test_messages}[MODE](tmp)
    except BaseException:
        print(f"files kept in {tmp}", file=sys.stderr)
        raise
    finally:
        # A failed check must not leave a daemon running.
        for d in Daemon.started:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
    shutil.rmtree(tmp, ignore_errors=True)
    print("ok")


if __name__ == "__main__":
    main()
