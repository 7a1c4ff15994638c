"""gpupool.torch on the host backend: CPU tensors through torch.multiprocessing with
install(cpu=True), every path a PyTorch program sends tensors by, bit-exact, against a real
gpupoold; the daemon's buffers, holds and fds back where they started after each.

Run by tests/python/torch_tests.sh (ctest python_torch), which provides torch in a venv.
"""

import gc
import hashlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(os.path.dirname(HERE))
if PYROOT not in sys.path:
    sys.path.insert(0, PYROOT)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from multiprocessing.reduction import ForkingPickler  # noqa: E402

import gpupool  # noqa: E402
import gpupool.torch as gt  # noqa: E402
from gpupool.testing import Daemon  # noqa: E402

PEER = os.path.join(HERE, "torch_peer.py")
POOLS = ["name=main,kind=host,capacity=512M,slab=16M"]


def digest(t):
    t = t.detach().contiguous().reshape(-1)
    b = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(b).hexdigest()


def sample():
    """Tensors of every kind a message carries: a gpupool storage and a view of it, a
    non-contiguous view of ordinary memory, a Parameter, and a few dtypes."""
    g = gt.empty(64, dtype=torch.float32)
    g.copy_(torch.arange(64, dtype=torch.float32))
    y = torch.arange(24, dtype=torch.float64).reshape(4, 6).t()[1:]
    p = torch.nn.Parameter(torch.randn(3, 5))
    z = torch.randint(-2**40, 2**40, (33,), dtype=torch.int64)
    w = torch.randn(17).to(torch.bfloat16)
    m = torch.rand(9) > 0.5
    return [g, g[10:20], y, p, z, w, m]


# --- what the children run (module level: spawn and forkserver import them by name) ------
def echo_child(q, r):
    got = q.get(timeout=60)
    g, v = got[0], got[1]
    r.put(([digest(t) for t in got], [type(t).__name__ for t in got], [t.requires_grad for t in got],
           g.untyped_storage().data_ptr() == v.untyped_storage().data_ptr(),
           v.data_ptr() - g.data_ptr(), [tuple(t.stride()) for t in got]))
    g[0] = 1234.0          # the parent's storage: it sees this write
    r.put(got[2])          # a received storage goes back without a copy (gpupool memory now)
    assert q.get(timeout=60) == "seen"


def whole_child(q, r):
    got = q.get(timeout=60)
    r.put({k: (digest(t), tuple(t.shape), tuple(t.stride()), type(t).__name__, t.requires_grad,
               t.untyped_storage().nbytes()) for k, t in got.items()})
    got["g"][0, 3] = -7.0  # made straight from the shared memory: the sender sees the write
    assert q.get(timeout=60) == "seen"


def square(t):
    return t * t


def exit_after_put(q, n):
    keep = gt.zeros(8)
    keep += 3
    ts = [torch.full((n,), float(i)) for i in range(4)] + [keep, keep[2:5]]
    for t in ts:
        q.put(t)
    q.close()
    q.join_thread()        # flushed into the pipe; then the process exits with its client


def receive_and_wait(q, r):
    got = [q.get(timeout=60) for _ in range(3)]
    r.put([digest(t) for t in got])
    time.sleep(120)


def digest_dicts(q, r):
    while True:
        d = q.get(timeout=300)
        if d is None:
            return
        r.put({k: digest(v) for k, v in d.items()})
        del d


def sum_many(q, r, n):
    acc = 0.0
    h = hashlib.sha256()
    for _ in range(n):
        t = q.get(timeout=60)
        h.update(t.numpy().tobytes())
        acc += float(t.sum())
    r.put((h.hexdigest(), acc))


def hold_messages(q, r):
    """Receives messages and reports their digests; on "drop" lets go of every one held (and
    says so), on "again" reports the digests of those held once more; "stop" ends."""
    held = []
    while True:
        m = q.get(timeout=60)
        if m == "stop":
            return
        if m == "drop":
            held = []
            r.put("dropped")
        elif m == "again":
            r.put([[digest(t) for t in h] for h in held])
        else:
            held.append(m)
            r.put([digest(t) for t in m])


def keep_one(q, r):
    """Receives a message, keeps its first tensor alone, reports its digest; "stop" ends."""
    m = q.get(timeout=60)
    first = m[0]
    del m
    r.put(digest(first))
    assert q.get(timeout=60) == "stop"
    r.put(digest(first))


def _boom():
    raise ValueError("this object cannot be unpickled")


class Boom:
    def __reduce__(self):
        return (_boom, ())


def spawn_arg_child(t, expect, p):
    sys.exit(0 if digest(t) == expect and isinstance(t, torch.nn.Parameter) == p else 3)


class TorchTestCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.environ.get("GPUPOOLD"):
            raise unittest.SkipTest("set GPUPOOLD and GPUPOOL_LIBRARY (ctest does)")
        cls.daemon = Daemon(pools=POOLS).start()
        os.environ["GPUPOOL_SOCKET"] = cls.daemon.socket
        gt.install(cpu=True, socket=cls.daemon.socket)

    @classmethod
    def tearDownClass(cls):
        gt.uninstall()
        d = getattr(cls, "daemon", None)
        if d is not None:
            d.stop()
            if d.died is not None:
                raise AssertionError("gpupoold died: %s\n%s" % (d.died, d.log()))

    def counters(self):
        import gc
        gc.collect()
        gt.trim()  # the copy buffers this process keeps for its next messages
        with gpupool.Client(self.daemon.socket, name="counters") as c:
            # An empty slab the pool keeps for reuse holds its memfd: give it back first, so
            # what is counted is what a leak would leave. This process's client unmaps it
            # when a reply tells it to and says so in its next request: two requests.
            c.trim()
            if gt.installed():
                gt._client().stats()
                gt._client().stats()
            s = c.stats()
        return s["buffers"], s["holds"], s["open_fds"]

    def wait_counters(self, want, timeout=20.0):
        deadline = time.monotonic() + timeout
        while True:
            got = self.counters()
            if got == want or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.assertEqual(got, want, "daemon (buffers, holds, fds) not back at the baseline\n"
                         + self.daemon.log()[-3000:])

    def baseline(self):
        return self.counters()


class SharingPaths(TorchTestCase):
    def run_echo(self, method):
        ctx = mp.get_context(method)
        q, r = ctx.Queue(), ctx.Queue()
        sent = sample()
        want = [digest(t) for t in sent]
        p = ctx.Process(target=echo_child, args=(q, r))
        p.start()
        q.put(sent)
        digests, types, grads, alias, gap, strides = r.get(timeout=120)
        self.assertEqual(digests, want, method)
        self.assertEqual(types[3], "Parameter")
        self.assertEqual(grads, [t.requires_grad for t in sent])
        self.assertTrue(alias, "two views of one storage arrived as two storages")
        self.assertEqual(gap, 40)
        self.assertEqual(strides, [tuple(t.stride()) for t in sent])
        back = r.get(timeout=60)
        self.assertEqual(digest(back), want[2])
        deadline = time.monotonic() + 10
        while sent[0][0].item() != 1234.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(sent[0][0].item(), 1234.0, "the child's write to a gpupool storage was not seen")
        q.put("seen")
        p.join(60)
        self.assertEqual(p.exitcode, 0)

    def test_tensors_that_cover_their_storage(self):
        """A tensor that is the only one of its message on its storage and covers it is made
        straight from the shared memory at the receiver: same values, shape, strides (a
        size-1 dimension's odd stride too), class and requires_grad, a storage of the same
        size, and the memory itself (a write is seen)."""
        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        g = gt.empty(2, 8, dtype=torch.float32)
        g.copy_(torch.arange(16, dtype=torch.float32).view(2, 8))
        sent = {"g": g, "scalar": torch.tensor(2.5), "bf16": torch.randn(3, 5).to(torch.bfloat16),
                "odd": torch.arange(6.0).view(6, 1).as_strided((6, 1), (1, 7)),
                "u8": torch.arange(200, dtype=torch.uint8), "p": torch.nn.Parameter(torch.randn(4)),
                "i64": torch.randint(-2**40, 2**40, (3, 2), dtype=torch.int64)}
        want = {k: (digest(t), tuple(t.shape), tuple(t.stride()), type(t).__name__, t.requires_grad,
                    t.untyped_storage().nbytes()) for k, t in sent.items()}
        p = ctx.Process(target=whole_child, args=(q, r))
        p.start()
        q.put(sent)
        got = r.get(timeout=120)
        for k in sent:
            self.assertEqual(got[k], want[k], k)
        deadline = time.monotonic() + 10
        while g[0, 3].item() != -7.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(g[0, 3].item(), -7.0, "the receiver's write to a gpupool storage was not seen")
        q.put("seen")
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        del g, sent
        self.wait_counters(base)

    def test_queue_fork_spawn_forkserver(self):
        base = self.baseline()
        for method in ("fork", "spawn", "forkserver"):
            with self.subTest(method=method):
                self.run_echo(method)
        self.wait_counters(base)

    def test_pipe_simplequeue_pool(self):
        base = self.baseline()
        ctx = mp.get_context("fork")
        a, b = ctx.Pipe()
        x = torch.randn(5, 7).t()
        a.send(x)
        y = b.recv()
        self.assertTrue(torch.equal(x, y))
        sq = ctx.SimpleQueue()
        sq.put((x, x[1]))
        u, v = sq.get()
        self.assertTrue(torch.equal(u, x) and torch.equal(v, x[1]))
        self.assertEqual(u.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())
        del a, b, y, u, v, sq
        with ctx.Pool(2) as pool:
            ins = [torch.randn(100) for _ in range(8)]
            outs = pool.map(square, ins)
        for i, o in zip(ins, outs):
            self.assertTrue(torch.equal(i * i, o))
        del ins, outs, i, o
        self.wait_counters(base)

    def test_spawn_arguments(self):
        base = self.baseline()
        ctx = mp.get_context("spawn")
        for t in (torch.randn(4, 4).t(), torch.nn.Parameter(torch.ones(3)), gt.zeros(7, dtype=torch.int16)):
            p = ctx.Process(target=spawn_arg_child,
                            args=(t, digest(t), isinstance(t, torch.nn.Parameter)))
            p.start()
            p.join(120)
            self.assertEqual(p.exitcode, 0, "spawned child got a different tensor")
        del t
        self.wait_counters(base)

    def test_sender_exits_before_receiver_reads(self):
        base = self.baseline()
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=exit_after_put, args=(q, 1000))
        p.start()
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        got = [q.get(timeout=30) for _ in range(6)]
        for i in range(4):
            self.assertTrue(torch.equal(got[i], torch.full((1000,), float(i))))
        self.assertTrue(torch.equal(got[4], torch.full((8,), 3.0)))
        self.assertTrue(torch.equal(got[5], torch.full((3,), 3.0)))
        del got
        self.wait_counters(base)

    def test_spawned_sender_that_never_received(self):
        # The child's module does not import gpupool: the Process object carries install().
        import plain_child

        base = self.baseline()
        for method in ("spawn", "forkserver"):
            ctx = mp.get_context(method)
            q = ctx.Queue()
            p = ctx.Process(target=plain_child.put_and_exit, args=(q,))
            p.start()
            p.join(120)
            self.assertEqual(p.exitcode, 0)
            a, b = q.get(timeout=30), q.get(timeout=30)
            x = torch.arange(5000, dtype=torch.float32)
            self.assertTrue(torch.equal(a, x * 3) and torch.equal(b, x[::2]))
            self.assertEqual(self.counters()[:2], (2, 2), "the child's tensors did not come as gpupool buffers")
            del a, b
            self.wait_counters(base)

    def test_receiver_sigkilled_while_holding(self):
        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=receive_and_wait, args=(q, r))
        p.start()
        ts = [torch.randn(1000), gt.zeros(10), torch.arange(6.).reshape(2, 3).t()]
        for t in ts:
            q.put(t)
        self.assertEqual(r.get(timeout=60), [digest(t) for t in ts])
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        del ts
        self.wait_counters(base)

    def test_ten_thousand_tensors_through_a_queue(self):
        base = self.baseline()
        n = 10000
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=sum_many, args=(q, r, n))
        p.start()
        h = hashlib.sha256()
        acc = 0.0
        for i in range(n):
            t = torch.arange(16, dtype=torch.float32) + i
            h.update(t.numpy().tobytes())
            acc += float(t.sum())
            q.put(t)
        self.assertEqual(r.get(timeout=300), (h.hexdigest(), acc))
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        self.wait_counters(base)


def _peer_env(socket, pythonpath, library):
    env = dict(os.environ)
    env.update(GPUPOOL_SOCKET=socket, PYTHONPATH=pythonpath, GPUPOOL_LIBRARY=library)
    return env


class Isolation(TorchTestCase):
    def peer_lines(self, prefix, payload, env, script=PEER):
        out = subprocess.run(prefix + [sys.executable, script], input=payload, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr.decode(errors="replace"))
        return [line.split() for line in out.stdout.decode().splitlines()]

    def test_pid_namespace(self):
        if os.getuid() != 0 or shutil.which("unshare") is None:
            self.skipTest("needs root and unshare(1) for a PID namespace")
        probe = subprocess.run(["unshare", "--pid", "--fork", "true"], stderr=subprocess.PIPE)
        if probe.returncode != 0:
            self.skipTest("this machine refuses a new PID namespace (%s)" % probe.stderr.decode().strip())
        base = self.baseline()
        ts = [torch.randn(300), gt.zeros(5) + 2]
        payload = bytes(ForkingPickler.dumps(ts))
        lines = self.peer_lines(["unshare", "--pid", "--fork"], payload,
                                _peer_env(self.daemon.socket, PYROOT, os.environ["GPUPOOL_LIBRARY"]))
        self.assertEqual([ln[0] for ln in lines], [digest(t) for t in ts])
        self.assertEqual(lines[0][-1], "1", "the receiver was not pid 1 of a namespace of its own")
        del ts, payload
        self.wait_counters(base)

    def test_another_uid(self):
        if os.getuid() != 0 or shutil.which("setpriv") is None:
            self.skipTest("needs root and setpriv(1) to run the receiver as another uid")
        uid = 65534
        probe = subprocess.run(["setpriv", "--reuid=%d" % uid, "--regid=%d" % uid, "--clear-groups",
                                sys.executable, "-c", "import torch"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
        if probe.returncode != 0:
            self.skipTest("uid %d cannot run %s with torch (%s): put the venv where every uid "
                          "can read it (GPUPOOL_TORCH_VENV)" % (uid, sys.executable,
                                                                 probe.stderr.decode()[-200:]))
        work = tempfile.mkdtemp(prefix="gpupool-torch-uid-")
        self.addCleanup(shutil.rmtree, work, True)
        os.chmod(work, 0o755)
        # What the receiver runs, where it can reach it.
        shutil.copytree(os.path.join(PYROOT, "gpupool"), os.path.join(work, "gpupool"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        lib = os.path.join(work, "libgpupool-client.so")
        shutil.copy(os.environ["GPUPOOL_LIBRARY"], lib)
        script = os.path.join(work, "torch_peer.py")
        shutil.copy(PEER, script)
        for root, dirs, files in os.walk(work):
            for n in dirs + files:
                os.chmod(os.path.join(root, n), 0o755)
        conf = os.path.join(work, "gpupoold.conf")
        with open(conf, "w") as f:
            f.write("[daemon]\nsocket_mode = 0666\n[group xfer]\nuids = 0, %d\n"
                    "[pool xfer]\nkind = host\ncapacity = 64M\nslab_size = 4M\nshare = xfer\n" % uid)
        d = Daemon(args=["--config", conf]).start()
        self.addCleanup(d.stop)
        os.chmod(d.dir, 0o711)
        try:
            gt.install(cpu=True, pool="xfer", socket=d.socket)
            ts = [torch.randn(77), torch.arange(10, dtype=torch.int32)[::3]]
            payload = bytes(ForkingPickler.dumps(ts))
            lines = self.peer_lines(["setpriv", "--reuid=%d" % uid, "--regid=%d" % uid, "--clear-groups"],
                                    payload, _peer_env(d.socket, work, lib), script)
            self.assertEqual([ln[0] for ln in lines], [digest(t) for t in ts])
        finally:
            gt.install(cpu=True, socket=self.daemon.socket)


class Batching(TorchTestCase):
    """A message of many storages is one Share and one Open; copy buffers are reused only once
    nobody holds them."""

    def requests(self, c):
        return c.stats()["requests"]

    def test_one_share_and_one_open_per_message(self):
        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=hold_messages, args=(q, r))
        p.start()
        gp = [gt.zeros(100).add_(i) for i in range(20)]          # shared in place
        plain = [torch.full((100,), float(i)) for i in range(20)]  # copied
        with gpupool.Client(self.daemon.socket, name="requests") as c:
            for version in (1, 2, 3, 4, 5):
                for t in gp + plain:
                    t += 1
                msg = gp + plain
                r0 = self.requests(c)
                r1 = self.requests(c)
                b1 = c.stats()["buffers"]
                r2 = self.requests(c)
                q.put(msg)
                self.assertEqual(r.get(timeout=60), [digest(t) for t in msg])
                r3 = self.requests(c)
                b3 = c.stats()["buffers"]
                if version > 2:
                    # A Share from the sender (with, at most, an Idle before it), an Open from
                    # the receiver: 2 or 3 for 40 storages.
                    self.assertLessEqual((r3 - r2) - (r1 - r0), 3, "requests for one message of 40 storages")
                    # The copies went into the buffers of the message before: no new allocation.
                    self.assertEqual(b3, b1, "copy buffers were not reused")
                q.put("drop")
                self.assertEqual(r.get(timeout=60), "dropped")
        q.put("stop")
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        del gp, plain, msg, t
        self.wait_counters(base)

    def test_second_message_reuses_every_copy_buffer(self):
        """A state dict sent again once its receiver let go of it: every storage, small ones
        too, is copied into the buffer of the message before (asked about in the one Idle
        request the large storages need), not into a new allocation."""
        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=hold_messages, args=(q, r))
        p.start()
        # One storage above the size under which a copy buffer of unknown state is not waited
        # for (64 MiB, _torch_state._SMALL), and small ones: a state dict's embedding and its
        # layers' norms.
        big = torch.full(((65 << 20) // 4,), 1.0)
        small = [torch.full((1000 + i,), float(i)) for i in range(20)]
        msg = [big] + small
        try:
            with gpupool.Client(self.daemon.socket, name="reuse") as c:
                for version in (1, 2, 3):
                    big[version] = float(version)
                    for t in small:
                        t += 1
                    r0 = self.requests(c)
                    r1 = self.requests(c)
                    b1 = c.stats()["buffers"]
                    r2 = self.requests(c)
                    q.put(msg)
                    self.assertEqual(r.get(timeout=60), [digest(t) for t in msg])
                    r3 = self.requests(c)
                    b3 = c.stats()["buffers"]
                    if version > 1:
                        self.assertEqual(b3 - b1, 0, "new copy buffers for message %d of 21 storages (the "
                                         "first message's lay idle)" % version)
                        # An Idle and a Share from the sender, an Open from the receiver.
                        self.assertLessEqual((r3 - r2) - (r1 - r0), 3, "requests for message %d" % version)
                    q.put("drop")
                    self.assertEqual(r.get(timeout=60), "dropped")
        finally:
            q.put("stop")
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        del big, small, msg, t
        self.wait_counters(base)

    def test_messages_of_1000_and_10000_storages(self):
        """One message of 1,000 and one of 10,000 storages, each one Share and one Open per
        max_share_batch, received whole."""
        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=digest_dicts, args=(q, r))
        p.start()
        for n in (1000, 10000):
            g = torch.Generator().manual_seed(n)
            msg = {"t%d" % i: torch.randn(256, generator=g).to(torch.bfloat16) for i in range(n)}
            want = {k: digest(v) for k, v in msg.items()}
            q.put(msg)
            self.assertEqual(r.get(timeout=300), want, "message of %d storages" % n)
            del msg
        q.put(None)
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        self.wait_counters(base)

    def test_messages_of_10000_storages_reuse_their_buffers(self):
        """Messages of 10,000 copied storages one after another: the third finds the first's
        buffers kept and asks which are idle, more than one daemon's Idle request can name
        (max_share_batch), so it asks in several."""
        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=digest_dicts, args=(q, r))
        p.start()
        n = 10000
        for v in range(4):
            g = torch.Generator().manual_seed(v)
            msg = {"t%d" % i: torch.randn(256, generator=g).to(torch.bfloat16) for i in range(n)}
            want = {k: digest(t) for k, t in msg.items()}
            q.put(msg)
            self.assertEqual(r.get(timeout=300), want, "message %d" % v)
            del msg
        q.put(None)
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        self.wait_counters(base)

    def test_reuse_never_overwrites_a_held_buffer(self):
        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=hold_messages, args=(q, r))
        p.start()
        x = torch.full((4096,), 1.0)
        y = torch.arange(300, dtype=torch.int64)
        first = [digest(x), digest(y)]
        q.put([x, y])
        self.assertEqual(r.get(timeout=60), first)
        held = [first]
        for v in (2, 3, 4):
            x.fill_(float(v))
            y += 7
            held.append([digest(x), digest(y)])
            q.put([x, y])                  # the receiver still holds every message before
            self.assertEqual(r.get(timeout=60), held[-1])
        q.put("again")
        self.assertEqual(r.get(timeout=60), held, "a held message was overwritten")
        q.put("drop")
        self.assertEqual(r.get(timeout=60), "dropped")
        with gpupool.Client(self.daemon.socket, name="buffers") as c:
            before = c.stats()["buffers"]
            x.fill_(3.0)
            q.put([x, y])                  # nobody holds the buffers now: written again
            self.assertEqual(r.get(timeout=60), [digest(x), digest(y)])
            self.assertEqual(c.stats()["buffers"], before, "copy buffers were not reused")
        q.put("stop")
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        self.wait_counters(base)

    def test_letting_go_of_a_message_is_one_release(self):
        """The 146 storages of a received message, each a buffer of its own (gpupool memory,
        shared in place), freed together by the receiver: their holds go back in one Release
        request, not one each."""
        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=hold_messages, args=(q, r))
        p.start()
        msg = [gt.zeros(64 + i).add_(float(i)) for i in range(146)]
        with gpupool.Client(self.daemon.socket, name="requests") as c:
            q.put(msg)
            self.assertEqual(r.get(timeout=60), [digest(t) for t in msg])
            holds = c.stats()["holds"]
            r0 = self.requests(c)
            r1 = self.requests(c)
            q.put("drop")
            self.assertEqual(r.get(timeout=60), "dropped")
            r2 = self.requests(c)
            self.assertEqual((r2 - r1) - (r1 - r0), 1, "Release requests for a message of 146 storages")
            self.assertEqual(c.stats()["holds"], holds - 146, "the receiver's holds did not all go")
        q.put("stop")
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        del msg
        self.wait_counters(base)

    def test_a_message_partly_kept_lets_go_of_the_rest(self):
        """The receiver keeps one tensor of a message: the holds of the others still go (soon,
        together), the kept one stays readable."""
        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=keep_one, args=(q, r))
        p.start()
        msg = [gt.zeros(64 + i).add_(float(i)) for i in range(20)]
        with gpupool.Client(self.daemon.socket, name="holds") as c:
            before = c.stats()["holds"]
            q.put(msg)
            self.assertEqual(r.get(timeout=60), digest(msg[0]))
            deadline = time.monotonic() + 20
            while c.stats()["holds"] != before + 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            # The sender's own 20 buffers (held before) and the receiver's one hold left.
            self.assertEqual(c.stats()["holds"], before + 1)
        q.put("stop")
        self.assertEqual(r.get(timeout=60), digest(msg[0]))
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        del msg
        self.wait_counters(base)

    def test_copies_of_a_message_go_in_one_buffer(self):
        """The 146 copied storages of a message go into one copy buffer (a pack), shared once
        and opened as one hold; packs are at most _PACK_MAX bytes (made small here: several),
        and every tensor arrives bit-exact at its place; the next message reuses the packs."""
        import gpupool._torch_send as send

        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=hold_messages, args=(q, r))
        p.start()
        msg = [torch.full((64 + i,), float(i)) for i in range(146)]
        try:
            with gpupool.Client(self.daemon.socket, name="packs") as c:
                for pack_max, packs in ((256 << 20, 1), (16 << 10, None)):
                    send._PACK_MAX = pack_max
                    b0, h0 = c.stats()["buffers"], c.stats()["holds"]
                    q.put(msg)
                    self.assertEqual(r.get(timeout=60), [digest(t) for t in msg])
                    made = c.stats()["buffers"] - b0
                    want = packs if packs else -(-sum(t.numel() * 4 + 255 for t in msg) // pack_max)
                    if packs:
                        self.assertEqual(made, 1, "copy buffers made for a message of 146 small storages")
                    else:
                        self.assertGreaterEqual(made, want - 1, "packs of %d bytes" % pack_max)
                        self.assertLess(made, 146)
                    # The receiver's holds: one per pack.
                    self.assertEqual(c.stats()["holds"] - h0, made * 2, "holds of the sender and receiver")
                    q.put("drop")
                    self.assertEqual(r.get(timeout=60), "dropped")
                    # Later messages go into the packs of those before once they are known idle
                    # (a small pack of unknown state is not waited for: the second message may
                    # take new ones while its Share asks about the first's).
                    for v in range(3):
                        for t in msg:
                            t += 1
                        b1 = c.stats()["buffers"]
                        q.put(msg)
                        self.assertEqual(r.get(timeout=60), [digest(t) for t in msg])
                        if v > 0:
                            self.assertEqual(c.stats()["buffers"], b1, "packs were not reused")
                        q.put("drop")
                        self.assertEqual(r.get(timeout=60), "dropped")
        finally:
            send._PACK_MAX = 256 << 20
            q.put("stop")
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        del msg
        self.wait_counters(base)

    def test_partial_unpickle_leaks_nothing(self):
        base = self.baseline()
        msg = [torch.randn(50), gt.zeros(9), Boom(), torch.randn(70)]
        data = ForkingPickler.dumps(msg)
        with self.assertRaises(ValueError):
            pickle.loads(data)
        del msg, data
        self.wait_counters(base)

    def test_receiver_of_a_message_sigkilled(self):
        base = self.baseline()
        ctx = mp.get_context("fork")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=hold_messages, args=(q, r))
        p.start()
        msg = [torch.randn(1000) for _ in range(30)] + [gt.zeros(10)]
        q.put(msg)
        self.assertEqual(r.get(timeout=60), [digest(t) for t in msg])
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        del msg
        self.wait_counters(base)


class BothPaths(TorchTestCase):
    """gpupool.torch with its C extension (gpupool._fast) and on its pure-Python path
    (GPUPOOL_PURE_PYTHON=1): the one this process runs is the one asked for, and a message
    sent by either is received the same by the other."""

    def test_the_path_asked_for(self):
        from gpupool import _torch_recv, _torch_send

        pure = os.environ.get("GPUPOOL_PURE_PYTHON") == "1"
        reducer = ForkingPickler._extra_reducers[torch.Tensor]
        if pure:
            self.assertIsNone(_torch_recv._fast)
            self.assertEqual(type(_torch_recv._rebuild_batched).__name__, "function")
            self.assertIs(reducer, _torch_send._reduce_tensor)
        elif os.environ.get("GPUPOOL_FAST_MODULE"):
            self.assertIsNotNone(_torch_recv._fast, "GPUPOOL_FAST_MODULE is set but not loaded")
            self.assertEqual(type(_torch_recv._rebuild_batched).__name__, "builtin_function_or_method")
            self.assertIs(reducer, _torch_recv._fast.reduce_tensor)
        else:
            self.skipTest("no extension asked for: neither GPUPOOL_FAST_MODULE nor GPUPOOL_PURE_PYTHON=1")
        # Pickled by one name either way: the peer may run the other path.
        self.assertEqual(pickle.loads(pickle.dumps(_torch_recv._rebuild_batched)),
                         _torch_recv._rebuild_batched)
        self.assertIn(b"gpupool._torch_recv", pickle.dumps(_torch_recv._rebuild_batched))

    def test_an_error_while_reducing_is_the_error_raised(self):
        """What fails while a tensor is reduced reaches the sender as it was raised, on either
        path (the extension calls nothing more once a step has raised)."""
        from gpupool import _torch_send

        def add(self, *args):
            raise RuntimeError("the message's bookkeeping failed on purpose")

        saved = _torch_send._Batch.add
        _torch_send._Batch.add = add
        try:
            with self.assertRaises(RuntimeError) as cm:
                ForkingPickler.dumps({"t": torch.arange(8, dtype=torch.float32)})
        finally:
            _torch_send._Batch.add = saved
        self.assertIn("failed on purpose", str(cm.exception))
        self.assertNotIsInstance(cm.exception, SystemError)

        # A message's later tensors go through the extension's own add (the first asks
        # whether gpupool serves the message, in Python): a step of it that raises.
        class Failing(torch.Tensor):
            def untyped_storage(self):
                raise RuntimeError("a storage that fails on purpose")

        bad = torch.arange(4, dtype=torch.float32).as_subclass(Failing)
        with self.assertRaises(RuntimeError) as cm:
            ForkingPickler.dumps({"a": torch.arange(8, dtype=torch.float32), "b": bad})
        self.assertIn("fails on purpose", str(cm.exception))
        self.assertNotIsInstance(cm.exception, SystemError)
        # And the next message goes as usual.
        got = pickle.loads(bytes(ForkingPickler.dumps({"t": torch.arange(8, dtype=torch.float32)})))
        self.assertTrue(torch.equal(got["t"], torch.arange(8, dtype=torch.float32)))

    def test_an_extension_that_does_not_load_is_said_once(self):
        env = dict(os.environ, GPUPOOL_FAST_MODULE=os.path.join(tempfile.gettempdir(), "no", "_fast.abi3.so"))
        env.pop("GPUPOOL_PURE_PYTHON", None)
        code = ("import gpupool.torch, gpupool._native as n\n"
                "from gpupool import _torch_recv, _torch_send\n"
                "assert _torch_recv._fast is None and _torch_send._fast is None\n"
                "assert n.load() is None and n.load() is None\n"
                "print('pure')\n")
        out = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, timeout=120)
        err = out.stderr.decode(errors="replace")
        self.assertEqual(out.returncode, 0, err)
        self.assertEqual(out.stdout.decode().split(), ["pure"])
        said = [ln for ln in err.splitlines() if "cannot be loaded" in ln]
        self.assertEqual(len(said), 1, err)
        self.assertIn("GPUPOOL_FAST_MODULE=", said[0])
        self.assertIn("python3-dev", said[0])

    def test_a_message_to_the_other_path(self):
        fast = os.environ.get("GPUPOOL_FAST_MODULE")
        if not fast:
            self.skipTest("needs the extension (GPUPOOL_FAST_MODULE) for the other path")
        base = self.baseline()
        ts = [torch.randn(300), gt.zeros(5) + 2, torch.arange(12.).reshape(3, 4).t(),
              torch.nn.Parameter(torch.randn(4)), torch.randn(6).to(torch.bfloat16)]
        ts.append(ts[2][1:])  # a view of a storage another tensor of the message has
        payload = bytes(ForkingPickler.dumps(ts))
        env = _peer_env(self.daemon.socket, PYROOT, os.environ["GPUPOOL_LIBRARY"])
        if os.environ.get("GPUPOOL_PURE_PYTHON") == "1":
            env.pop("GPUPOOL_PURE_PYTHON")   # this process is pure Python; the peer is not
        else:
            env["GPUPOOL_PURE_PYTHON"] = "1"
        out = subprocess.run([sys.executable, PEER], input=payload, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr.decode(errors="replace"))
        lines = [ln.split() for ln in out.stdout.decode().splitlines()]
        self.assertEqual([ln[0] for ln in lines], [digest(t) for t in ts])
        self.assertEqual([" ".join(ln[1:-1]) for ln in lines],
                         ["%s %s" % (t.dtype, tuple(t.shape)) for t in ts])
        del ts, payload
        self.wait_counters(base)

    def test_received_views_let_go_of_their_holds(self):
        """Every tensor a message is made of keeps its hold until torch frees it, then lets
        go of it: counted as live DLPack exports while the message lives, none after."""
        from gpupool import _dlpack

        base = self.baseline()
        live0 = _dlpack.live_exports()
        sent = {"w%d" % i: torch.randn(i + 1, 3) for i in range(20)}
        sent["v"] = sent["w3"][1:]   # a view: its storage is one of the message's
        got = pickle.loads(ForkingPickler.dumps(sent))
        self.assertEqual(_dlpack.live_exports(), live0 + 20)
        for k in sent:
            self.assertTrue(torch.equal(got[k], sent[k]), k)
        self.assertEqual(got["v"].untyped_storage().data_ptr(), got["w3"].untyped_storage().data_ptr())
        del got
        self.assertEqual(_dlpack.live_exports(), live0)
        del sent
        self.wait_counters(base)


    def test_torch_shim_and_dlpack_make_the_same_tensors(self):
        """Where torch has its C shim (torch_from_blob), the extension makes a received
        message's tensors through it; they are the tensors the DLPack path makes (type, shape,
        strides, offset, values, a storage shared by views of one storage, no autograd base),
        and they keep their holds until torch frees them."""
        from gpupool import _dlpack, _native, _torch_recv

        if _torch_recv._fast is None:
            self.skipTest("needs the extension (GPUPOOL_FAST_MODULE)")
        if not _torch_recv._TORCH_SHIM:
            self.skipTest("torch %s has no torch_from_blob in its C shim" % torch.__version__)
        base = self.baseline()
        live0 = _dlpack.live_exports()
        src = torch.arange(64, dtype=torch.float32).reshape(8, 8)
        sent = {"t": src.t(), "row": src[3], "bf": torch.randn(5, 7).to(torch.bfloat16),
                "half": torch.randn(3, 2, 4).to(torch.float16), "i8": torch.arange(-9, 9, dtype=torch.int8),
                "i64": torch.arange(10) * 3, "u8": torch.arange(200, dtype=torch.uint8)[50:],
                "f64": torch.randn(4, 4, dtype=torch.float64)[:, 1], "p": torch.nn.Parameter(torch.randn(3))}
        by_shim = pickle.loads(ForkingPickler.dumps(sent))
        self.assertEqual(_dlpack.live_exports(), live0 + 8)  # one per storage received
        _native.fast.setup_torch(0, 0, None, ())
        try:
            by_dlpack = pickle.loads(ForkingPickler.dumps(sent))
        finally:
            self.assertTrue(_torch_recv._setup_torch_shim())
        for k, t in sent.items():
            for got in (by_shim[k], by_dlpack[k]):
                self.assertIs(type(got), type(t), k)
                self.assertEqual((got.dtype, got.shape, got.stride(), got.storage_offset()),
                                 (t.dtype, t.shape, t.stride(), t.storage_offset()), k)
                self.assertTrue(torch.equal(got.detach(), t.detach()), k)
                self.assertIsNone(got._base, k)
        self.assertEqual(by_shim["t"].untyped_storage().data_ptr(), by_shim["row"].untyped_storage().data_ptr())
        del by_shim, by_dlpack, got, t
        self.assertEqual(_dlpack.live_exports(), live0)
        del sent
        self.wait_counters(base)

    def test_storages_of_in_c_and_in_python_agree(self):
        """A received message's storages, made by the extension (gpupool._fast.storages_of)
        and by the pure-Python _storages_of: each a view of its hold's memory at its place,
        the one tensor a sender noted made whole, the same storage for memory received again
        while it lives and a new one once it is gone, the process's records of both (received
        memory and what to share it by) with each record's weak reference let go of exactly
        once (replaced or pruned), and on a failure, even after some views were made, every
        hold left to the caller and nothing recorded."""
        from gpupool import _lib, _torch_recv
        from gpupool._torch_state import _S, _client

        paths = [False] + ([True] if _torch_recv._FAST_STORAGES else [])
        base = self.baseline()
        c = _client()
        U = torch.UntypedStorage
        free = U._free_weak_ref
        freed = []

        def counted(ref):
            freed.append(ref)
            return free(ref)

        for fast in paths:
            with self.subTest(fast=fast):
                saved = _torch_recv._FAST_STORAGES
                _torch_recv._FAST_STORAGES = fast
                U._free_weak_ref = counted
                if fast:
                    _torch_recv._fast.setup_recv((U._expired, U._new_with_weak_ptr, counted, _torch_recv._from_dlpack),
                                                 _lib.MEM_DEVICE, _lib.MEM_HOST_NUMA)
                try:
                    del freed[:]
                    self._storages_of_case(c, _torch_recv._storages_of, _S, freed)
                finally:
                    del U._free_weak_ref  # torch's own again (its base class's)
                    _torch_recv._FAST_STORAGES = saved
                    self.assertTrue(_torch_recv._setup_storages() or not fast)
        self.assertIs(U._free_weak_ref, free)
        self.wait_counters(base)

    def test_a_message_whose_storages_cannot_be_made_lets_go_of_its_holds(self):
        """The receiver opened a message's buffers, then could not make its storages: the
        holds it opened go at once (the daemon's counts back where they were before the
        send), and the error is the one raised."""
        from gpupool import _torch_recv

        sent = {"a": gt.zeros(10), "b": gt.zeros(20), "c": gt.zeros(30)}
        base = self.baseline()
        payload = bytes(ForkingPickler.dumps(sent))

        def fails(holds, offs, sizes, whole=None):
            raise RuntimeError("no storage on purpose")

        saved = _torch_recv._storages_of
        _torch_recv._storages_of = fails
        err = None
        try:
            pickle.loads(payload)
        except RuntimeError as e:
            err = e
        finally:
            _torch_recv._storages_of = saved
        self.assertIn("on purpose", str(err))
        # Let go of by the receiver itself, not by the collector: the error's traceback still
        # references the frame that held them.
        self.assertIsNotNone(err.__traceback__)
        self.wait_counters(base)
        del err, payload
        got = pickle.loads(bytes(ForkingPickler.dumps(sent)))  # and the next goes as usual
        self.assertTrue(all(torch.equal(got[k], sent[k]) for k in sent))
        del got
        self.wait_counters(base)

    def _storages_of_case(self, c, storages_of, S, freed):
        a, b = c._alloc_holds("main", [4096, 8192], None)
        try:
            whole = [None, ((2, 32), (512,), (1,)), None]
            holds, offs, sizes = [a, a, b], [0, 1024, 0], [1024, 2048, 8192]
            sts, made = storages_of(holds, offs, sizes, whole)
            self.assertEqual(holds, [None] * 3)
            for st, h, off, n in zip(sts, [a, a, b], offs, sizes):
                self.assertEqual((st.data_ptr(), st.nbytes()), (h.ptr + off, n))
                self.assertEqual(S.owned[h.ptr + off][1], off)
                self.assertIs(S.owned[h.ptr + off][0](), h)
                self.assertIsInstance(S.received[(h.buffer_id, off, n)], int)
            self.assertEqual(list(made), [1])
            self.assertEqual((made[1].dtype, made[1].shape, made[1].stride()), (torch.float32, (512,), (1,)))
            self.assertEqual(made[1].untyped_storage()._cdata, sts[1]._cdata)
            sts[2][5] = 7
            # The same memory again while its storages live: those storages.
            again = [b, a]
            sts2, made2 = storages_of(again, [0, 0], [8192, 1024], None)
            self.assertEqual(again, [None, None])
            self.assertEqual([s._cdata for s in sts2], [sts[2]._cdata, sts[0]._cdata])
            self.assertEqual(made2, {})
            # Once they are gone, a new storage, which the entry names from then on (the weak
            # reference it had let go of).
            key = (b.buffer_id, 0, 8192)
            old = S.received[key]
            self.assertEqual(freed, [])
            del sts, made, sts2, made2, st
            gc.collect()
            sts3, _ = storages_of([b], [0], [8192], None)
            self.assertEqual(sts3[0][5], 7)
            self.assertEqual(freed, [old])
            sts4, _ = storages_of([b], [0], [8192], None)
            self.assertEqual(sts4[0]._cdata, sts3[0]._cdata)
            self.assertFalse(torch.UntypedStorage._expired(S.received[key]))
            self.assertEqual(freed, [old])
            # A failure: nothing taken, nothing recorded; here in the second of two groups
            # (bytes, then a tensor made whole), after the first one's views were made.
            from gpupool import _dlpack

            live = _dlpack.live_exports()
            bad = [a, b]
            with self.assertRaises((ValueError, IndexError, TypeError)):
                storages_of(bad, [16, 64], [32, 32], [None, ("not", "a whole tensor")])
            self.assertEqual(bad, [a, b])
            self.assertNotIn((a.buffer_id, 16, 32), S.received)
            self.assertNotIn((b.buffer_id, 64, 32), S.received)
            gc.collect()
            self.assertEqual(_dlpack.live_exports(), live)  # the first group's views are gone
            # Records whose storages are gone, pruned: each weak reference let go of once.
            mine = {k: S.received[k] for k in [(a.buffer_id, 0, 1024), (a.buffer_id, 1024, 2048), key]}
            del sts3, sts4
            gc.collect()
            prune = S.received_prune
            S.received_prune = 0
            try:
                kept, _ = storages_of([a], [4000], [96], None)
            finally:
                S.received_prune = max(prune, 1024)
            for k, ref in mine.items():
                self.assertNotIn(k, S.received)
                self.assertEqual(freed.count(ref), 1 + (ref == old), k)
            self.assertIn((a.buffer_id, 4000, 96), S.received)
            del kept
        finally:
            a.release()
            b.release()


class InProcess(TorchTestCase):
    """Sending and receiving in one process (ForkingPickler.dumps, pickle.loads): what no
    child process is needed to see."""

    def test_a_message_finds_its_buffers_and_names_each_once(self):
        """_find_many: a storage this process shares by a hold of its own is found by its
        pointer, use_allocator()'s blocks through the allocator library's one lookup (a
        stand-in here: the host has no CUDA), one handle per segment, what neither knows left
        to copy; _share_groups: each buffer named once per (device, owner) group, in the order
        its storages come, every storage pointing at its buffer's token."""
        import ctypes
        import weakref

        from gpupool import _lib, _torch_send
        from gpupool._torch_state import _S, _client

        class Segments:
            """libgpupool-torch-alloc's lookup_many over (base, size, handle) segments."""

            def __init__(self, segs):
                self.segs, self.calls = segs, 0

            def gpupool_torch_alloc_lookup_many(self, p, n, m, b, o):
                self.calls += 1
                P, N = (ctypes.c_uint64 * m).from_address(p), (ctypes.c_uint64 * m).from_address(n)
                B, O = (ctypes.c_uint64 * m).from_address(b), (ctypes.c_uint64 * m).from_address(o)
                for k in range(m):
                    for base, size, h in self.segs:
                        if base <= P[k] and P[k] + N[k] <= base + size:
                            B[k], O[k] = h, P[k] - base
                            break

        class Msg:
            storages = ()

        def message(ptrs, sizes, devs):
            m = Msg()
            m.storages, m.ptrs, m.sizes, m.devs = [None] * len(ptrs), ptrs, sizes, devs
            return m

        c = _client()
        lib = Segments([(1 << 40, 1 << 20, 0xA000), (2 << 40, 1 << 20, 0xB000)])
        saved = _S.alloc_lib
        _S.alloc_lib = lib
        try:
            # Every storage a block: the lookup's answer taken as it is.
            ptrs = [(1 << 40) + 256, (2 << 40), (1 << 40) + 4096, (1 << 40) + 256]
            bufs, offs, keys, owner = _torch_send._find_many(message(ptrs, [64] * 4, [0] * 4), c)
            self.assertEqual(lib.calls, 1)
            self.assertEqual([ctypes.cast(b, ctypes.c_void_p).value for b in bufs], [0xA000, 0xB000, 0xA000, 0xA000])
            self.assertIs(bufs[0], bufs[2])  # one handle object per segment
            self.assertEqual((offs, keys, owner), ([256, 0, 4096, 256], [0xA000, 0xB000, 0xA000, 0xA000], [1] * 4))
            groups, tix = _torch_send._share_groups([0] * 4, owner, keys, bufs)
            self.assertEqual([(d, o, len(u)) for d, o, u in groups], [(0, 1, 2)])
            self.assertEqual(tix, [0, 1, 0, 0])
            # A host storage this process holds, a block, one nobody knows (copied), a CUDA
            # storage outside every segment.
            h = c._alloc_holds("main", [4096], None)[0]
            _S.owned[h.ptr + 512] = (weakref.ref(h), 512)
            try:
                ptrs = [h.ptr + 512, (2 << 40) + 64, 12345, (3 << 40)]
                bufs, offs, keys, owner = _torch_send._find_many(message(ptrs, [64] * 4, [-1, 0, -1, 0]), c)
                self.assertEqual(lib.calls, 2)
                self.assertEqual((bufs[0], offs[0], keys[0], owner[0]), (h.buf, 512, id(h), 0))
                self.assertEqual((ctypes.cast(bufs[1], ctypes.c_void_p).value, offs[1], keys[1], owner[1]),
                                 (0xB000, 64, 0xB000, 1))
                self.assertEqual((bufs[2], bufs[3], owner[2], owner[3]), (None, None, 0, 0))
                # Two groups: this process's host buffers, then the allocator's on device 0.
                bufs[2], keys[2] = bufs[0], keys[0]  # as if copied into the same buffer
                bufs[3], keys[3] = h.buf, id(h) + 1   # and another
                groups, tix = _torch_send._share_groups([-1, 0, -1, -1], owner, keys, bufs)
                self.assertEqual([(d, o, len(u)) for d, o, u in groups], [(-1, 0, 2), (0, 1, 1)])
                self.assertEqual(tix, [0, 2, 0, 1])
            finally:
                del _S.owned[h.ptr + 512]
                h.release()
        finally:
            _S.alloc_lib = saved

    def test_no_collection_while_a_message_is_pickled(self):
        """The sender's collector waits while a message is pickled and shared (a message of
        thousands of storages would otherwise start full collections over every object of the
        process), and runs again after it, also when the message fails."""
        import gc
        from gpupool import _torch_send

        starts = []

        def watch(phase, info):
            if phase == "start":
                starts.append(getattr(_torch_send._tls, "batch", None) is not None)

        class Fails:
            def __reduce__(self):
                raise RuntimeError("cannot be pickled, on purpose")

        msg = {"t%d" % i: torch.randn(16) for i in range(50)}
        gc.callbacks.append(watch)
        threshold = gc.get_threshold()
        gc.set_threshold(1)  # a collection at nearly every allocation, unless paused
        try:
            payload = ForkingPickler.dumps(msg)
            with self.assertRaises(RuntimeError):
                ForkingPickler.dumps([torch.randn(4), Fails()])
            self.assertTrue(gc.isenabled())
            gc.collect()
        finally:
            gc.set_threshold(*threshold)
            gc.callbacks.remove(watch)
        self.assertTrue(starts, "no collection at all: the test saw nothing")
        self.assertEqual(starts.count(True), 0, "collections started while a message was pickled")
        got = pickle.loads(payload)
        self.assertTrue(all(torch.equal(got[k], msg[k]) for k in msg))

    def test_no_collection_while_exports_are_registered(self):
        """The receiver registers a message's DLPack exports under a plain lock that each
        export's deleter takes too: a garbage collection starting there could free an
        earlier export (a received tensor in a reference cycle) and deadlock. Whatever the
        point where the collector runs, it never runs with that lock held."""
        import gc
        from gpupool import _dlpack

        base = self.baseline()
        held = []

        def watch(phase, info):
            if phase == "start":
                held.append(_dlpack._live_lock.locked())

        gc.callbacks.append(watch)
        try:
            for k in range(1, 120):
                payload = ForkingPickler.dumps([torch.randn(8), torch.randn(8, 2), torch.randn(3)[1:]])
                gc.set_threshold(gc.get_count()[0] + k)
                try:
                    got = pickle.loads(payload)
                finally:
                    gc.set_threshold(700)
                self.assertEqual(len(got), 3)
                del got
                gc.collect()
        finally:
            gc.callbacks.remove(watch)
        self.assertTrue(held, "no collection ran at all: the test did not test anything")
        self.assertNotIn(True, held, "a garbage collection ran with _dlpack's export lock held")
        self.wait_counters(base)

    def test_no_collection_while_a_message_is_made(self):
        """A message of thousands of storages is received (holds opened, storages and tensors
        made, unpickled) without the garbage collector running: each collection there would
        scan every object of the process. It runs afterwards when due."""
        import gc

        base = self.baseline()
        inside = []

        def watch(phase, info):
            if phase == "start":
                f = sys._getframe(1)
                while f is not None and f.f_code.co_name != "_open_message":
                    f = f.f_back
                inside.append(f is not None)

        sent = {"t%d" % i: torch.full((4,), float(i)) for i in range(3000)}
        payload = ForkingPickler.dumps(sent)
        gc.callbacks.append(watch)
        try:
            got = pickle.loads(payload)
            junk = [[] for _ in range(5000)]  # what the program does next: collections run
            del junk
        finally:
            gc.callbacks.remove(watch)
        self.assertTrue(gc.isenabled())
        self.assertTrue(inside, "no collection ran at all: the test did not test anything")
        self.assertNotIn(True, inside, "%d of %d collections ran while the message was made"
                         % (inside.count(True), len(inside)))
        for k in ("t0", "t1234", "t2999"):
            self.assertTrue(torch.equal(got[k], sent[k]), k)
        del got, sent, payload
        self.wait_counters(base)

    def test_threads_sending_at_once(self):
        """Several threads of one process send and receive messages with copies at once (the
        feeder threads of several Queues): bit-exact, aliasing kept, no request naming a copy
        buffer another thread let go of, and everything back at the baseline."""
        import threading

        base = self.baseline()
        errors = []

        def work(seed):
            try:
                g = torch.Generator().manual_seed(seed)
                for it in range(60):
                    a = torch.randn(64, 32, generator=g)
                    msg = {"a": a, "b": torch.randn(64, 32, generator=g), "v": a[3],
                           "s": torch.tensor(float(it)), "p": torch.nn.Parameter(torch.randn(100, generator=g))}
                    got = pickle.loads(ForkingPickler.dumps(msg))
                    for k in msg:
                        if not torch.equal(got[k].detach(), msg[k].detach()):
                            raise AssertionError("%s differs" % k)
                    if got["v"].untyped_storage().data_ptr() != got["a"].untyped_storage().data_ptr():
                        raise AssertionError("two views of one storage arrived as two storages")
            except BaseException as e:
                errors.append(repr(e))

        ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        self.assertEqual(errors, [])
        self.wait_counters(base)


class Options(TorchTestCase):
    def tearDown(self):
        gt.install(cpu=True, socket=self.daemon.socket)

    def test_copy_false_refuses_ordinary_memory(self):
        gt.install(cpu=True, copy=False, socket=self.daemon.socket)
        g = gt.zeros(4)
        self.assertIsInstance(pickle.loads(ForkingPickler.dumps(g)), torch.Tensor)
        with self.assertRaises(gpupool.GpupoolError) as cm:
            ForkingPickler.dumps(torch.zeros(4))
        self.assertIn("copy=False", str(cm.exception))
        self.assertIn("gpupool.torch.empty", str(cm.exception))

    def test_cpu_false_leaves_cpu_tensors_to_torch(self):
        gt.install(cpu=False, socket=self.daemon.socket)
        before = self.counters()
        data = ForkingPickler.dumps(torch.ones(1000))
        self.assertEqual(self.counters(), before)  # no gpupool buffer was made
        self.assertTrue(torch.equal(pickle.loads(data), torch.ones(1000)))

    def test_cpu_false_still_shares_gpupool_cpu_storages(self):
        gt.install(cpu=False, socket=self.daemon.socket)
        g = gt.zeros(8)
        ptr = g.untyped_storage().data_ptr()
        y = pickle.loads(ForkingPickler.dumps(g))
        # torch's own sharing would have moved g into a shared-memory file of its own.
        self.assertEqual(g.untyped_storage().data_ptr(), ptr)
        self.assertEqual(y.untyped_storage().data_ptr(), ptr)

    def test_unreachable_daemon(self):
        missing = os.path.join(tempfile.mkdtemp(prefix="gpupool-none-"), "none.sock")
        with self.assertRaises(ConnectionError) as cm:
            gt.install(cpu=True, socket=missing)
        self.assertIn("fallback=True", str(cm.exception))
        with self.assertLogs("gpupool.torch", level="WARNING") as logs:
            gt.install(cpu=True, socket=missing, fallback=True)
        self.assertIn("torch's own sharing", "\n".join(logs.output))
        t = torch.randn(10)
        self.assertTrue(torch.equal(pickle.loads(ForkingPickler.dumps(t)), t))

    def test_memory_received_again_is_one_storage(self):
        """The same memory received twice while the first storage lives is that storage; once
        it is gone, the next receipt makes a new one, which a third receipt finds in turn
        (its entry now names the new storage)."""
        g = gt.zeros(64, dtype=torch.int32)
        a = pickle.loads(ForkingPickler.dumps(g))
        b = pickle.loads(ForkingPickler.dumps(g))
        self.assertEqual(a.untyped_storage()._cdata, b.untyped_storage()._cdata)
        del a, b
        gc.collect()
        c = pickle.loads(ForkingPickler.dumps(g))
        d = pickle.loads(ForkingPickler.dumps(g))
        self.assertEqual(c.untyped_storage()._cdata, d.untyped_storage()._cdata)
        c.add_(5)
        self.assertTrue(torch.equal(d, torch.full((64,), 5, dtype=torch.int32)))
        del c, d
        gc.collect()
        e = pickle.loads(ForkingPickler.dumps(g))
        self.assertTrue(torch.equal(e, g))

    def test_gpupool_storage_is_shared_in_place(self):
        g = gt.zeros(16, dtype=torch.int32)
        g2 = pickle.loads(ForkingPickler.dumps(g))   # this process: the same memory again
        self.assertEqual(g2.untyped_storage().data_ptr(), g.untyped_storage().data_ptr())
        e = gt.empty_like(torch.empty(2, 3, dtype=torch.float16))
        self.assertEqual((e.shape, e.dtype), (torch.Size([2, 3]), torch.float16))


if __name__ == "__main__":
    unittest.main()
