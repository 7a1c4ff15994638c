"""gpupool.torch with CUDA tensors: torch.multiprocessing (spawn) sends them as kept shares of
gpupool device buffers, bit-exact; a gpupool storage stays one storage in both processes
(writes seen both ways, views aliased); a sender that exits before the receiver reads; a
receiver SIGKILLed while holding; 1,000 tensors through a queue; the daemon back at its
baseline after each. The same with use_allocator() in a fresh process (every CUDA
tensor is a gpupool buffer: shared without a copy), see alloc_main.py."""

import gc
import hashlib
import os
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, PYROOT)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import gpupool  # noqa: E402
import gpupool.torch as gt  # noqa: E402
from gpupool.testing import Daemon  # noqa: E402

POOLS = ("name=gpu0,kind=device,device=0,capacity=2G,slab=256M",)


def digest(t):
    t = t.detach().to("cpu").contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def echo_child(q, r):
    got = q.get(timeout=120)
    g, v = got[0], got[1]
    torch.cuda.current_stream().synchronize()
    r.put(([digest(t) for t in got], [t.device.type for t in got], type(got[3]).__name__,
           got[3].requires_grad, g.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()))
    g.fill_(7.0)
    torch.cuda.synchronize()
    r.put(got[2])          # received: gpupool memory now, sent back without a copy
    assert q.get(timeout=120) == "seen"


def put_and_exit(q):
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    q.put(x * 3)           # a temporary: its memory goes back to torch's cache at once
    q.put(x[::2])
    q.close()
    q.join_thread()


def hold_then_wait(q, r):
    got = [q.get(timeout=120) for _ in range(2)]
    torch.cuda.current_stream().synchronize()
    r.put([digest(t) for t in got])
    time.sleep(300)


def hold_messages(q, r):
    """Receives messages and reports their digests; "again": the digests of those held once
    more; "drop": lets go of them; "stop" ends."""
    held = []
    while True:
        m = q.get(timeout=120)
        if m == "stop":
            return
        if m == "drop":
            held = []
            torch.cuda.synchronize()
            r.put("dropped")
        elif m == "again":
            r.put([[digest(t) for t in h] for h in held])
        else:
            held.append(m)
            r.put([digest(t) for t in m])


def sum_many(q, r, n):
    h = hashlib.sha256()
    for _ in range(n):
        h.update(q.get(timeout=120).to("cpu").numpy().tobytes())
    r.put(h.hexdigest())


def digest_received(conn, r):
    """Receives a first message over conn and lets go of it, then a second one, and reports
    its digests and how many ready waits its opening made the receiving stream do."""
    c = gt._client()
    first = conn.recv()
    torch.cuda.current_stream().synchronize()
    del first
    w0 = c.ready_waits
    r.put("ready")   # started, connected, everything imported: the next copies still run when it comes
    got = conn.recv()
    torch.cuda.current_stream().synchronize()
    r.put(([digest(t) for t in got], c.ready_waits - w0))
    del got


BUSY_SIZES = [1 << 20] * 8 + [40 << 20]   # 4 MiB each in one copy buffer; 160 MiB alone


def busy_values():
    return [torch.full((n,), float(i + 1), device="cuda") for i, n in enumerate(BUSY_SIZES)]


def send_busy_and_exit(conn):
    """Sends a message whose copies are queued behind a second of GPU work, and exits."""
    ts = busy_values()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))
    conn.send(ts)
    conn.close()


def fork_and_send_busy(conn):
    """In a process that has not touched CUDA: a forked child sends the busy message and
    leaves as multiprocessing's forked children do (os._exit once its finalizers ran, no
    atexit handler of CUDA's runtime)."""
    p = mp.get_context("fork").Process(target=send_busy_and_exit, args=(conn,))
    p.start()
    p.join(120)
    if p.exitcode != 0:
        raise SystemExit(p.exitcode or 1)


def digest_dicts(q, r):
    while True:
        d = q.get(timeout=300)
        if d is None:
            return
        r.put({k: digest(v) for k, v in d.items()})
        del d


class CudaTensors(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            cls.daemon = Daemon(backend="cuda", pools=POOLS).start()
        except RuntimeError as e:
            raise unittest.SkipTest("gpupoold cannot run its CUDA backend here: %s" % e)
        os.environ["GPUPOOL_SOCKET"] = cls.daemon.socket
        gt.install(socket=cls.daemon.socket)

    @classmethod
    def tearDownClass(cls):
        gt.uninstall()
        cls.daemon.stop()

    def counters(self):
        gc.collect()
        torch.cuda.synchronize()
        gt.trim()  # the copy buffers this process keeps for its next messages
        with gpupool.Client(self.daemon.socket, name="counters") as c:
            s = c.stats()
        return s["buffers"], s["holds"]

    def wait_counters(self, want, timeout=30):
        deadline = time.monotonic() + timeout
        while self.counters() != want and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.counters(), want, self.daemon.log()[-3000:])

    def test_queue_spawn(self):
        base = self.counters()
        ctx = mp.get_context("spawn")
        q, r = ctx.Queue(), ctx.Queue()
        g = gt.empty(1 << 16, device="cuda")
        g.copy_(torch.arange(1 << 16, dtype=torch.float32, device="cuda"))
        plain = torch.randn(256, 512, device="cuda").t()          # torch's caching allocator
        p_ = torch.nn.Parameter(torch.randn(33, device="cuda"))
        sent = [g, g[100:200], plain, p_, torch.randint(0, 9, (77,), device="cuda", dtype=torch.int64)]
        want = [digest(t) for t in sent]
        p = ctx.Process(target=echo_child, args=(q, r))
        p.start()
        q.put(sent)
        digests, devs, ptype, grad, alias = r.get(timeout=180)
        self.assertEqual(digests, want)
        self.assertEqual(set(devs), {"cuda"})
        self.assertEqual((ptype, grad), ("Parameter", True))
        self.assertTrue(alias)
        back = r.get(timeout=60)
        self.assertEqual(digest(back), want[2])
        torch.cuda.synchronize()
        self.assertTrue(bool((g == 7.0).all()), "the child's write to a gpupool storage was not seen")
        q.put("seen")
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        del sent, g, back, p_
        self.wait_counters(base)

    def test_message_batched_and_copies_reused(self):
        """A message of many CUDA storages is one Share and one Open; a copy buffer the
        receiver still holds is never written again, one it let go of is."""
        base = self.counters()
        ctx = mp.get_context("spawn")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=hold_messages, args=(q, r))
        p.start()
        plain = [torch.full((1 << 16,), float(i), device="cuda") for i in range(16)]
        gp = [gt.zeros(1 << 10, device="cuda").add_(i) for i in range(16)]   # shared in place
        first = [digest(t) for t in plain + gp]
        q.put(plain + gp)
        self.assertEqual(r.get(timeout=180), first)
        for t in plain + gp:
            t += 1
        second = [digest(t) for t in plain + gp]
        q.put(plain + gp)                       # the first message is still held
        self.assertEqual(r.get(timeout=120), second)
        q.put("again")
        again = r.get(timeout=120)
        # The copies of the first message are intact; its gpupool storages are the sender's
        # memory, shared in place: the sender's write shows there too.
        self.assertEqual([h[:16] for h in again], [first[:16], second[:16]], "a held copy was overwritten")
        self.assertEqual([h[16:] for h in again], [second[16:], second[16:]])
        q.put("drop")
        self.assertEqual(r.get(timeout=120), "dropped")
        with gpupool.Client(self.daemon.socket, name="requests") as c:
            r0 = c.stats()["requests"]
            r1 = c.stats()["requests"]
            b1 = c.stats()["buffers"]
            r2 = c.stats()["requests"]
            for t in plain + gp:
                t += 1
            q.put(plain + gp)
            self.assertEqual(r.get(timeout=120), [digest(t) for t in plain + gp])
            r3 = c.stats()["requests"]
            b3 = c.stats()["buffers"]
        # Idle (the state of the kept copy buffers, unknown since the receiver let go), Share
        # and Open for the 32 storages, and after the Share, not waited for, the Idle about
        # the kept copy buffers this message did not use (read by the next message).
        self.assertEqual((r3 - r2) - (r1 - r0), 4, "Idle + Share + Open + Idle for 32 storages")
        self.assertEqual(b3, b1, "copy buffers were not reused")
        q.put("stop")
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        del plain, gp, t
        self.wait_counters(base)

    def test_copies_in_flight_keep_their_sources(self):
        """A message's copies run on the GPU after the send returns (the receiver's stream
        waits for them, once for all the buffers of the message): the storages they read stay
        referenced by the sender until they are done, so memory torch's allocator hands out
        again at once in another stream, and overwrites there, is not what the receiver gets."""
        base = self.counters()
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        r = ctx.Queue()
        p = ctx.Process(target=digest_received, args=(b, r))
        p.start()
        side = torch.cuda.Stream()
        sizes = BUSY_SIZES
        # A first message of the same shapes: what a process does once (loading the copy
        # kernel, importing pools and slabs, opening events) may wait for the GPU.
        a.send([torch.zeros(n, device="cuda") for n in sizes])
        self.assertEqual(r.get(timeout=120), "ready")
        with torch.cuda.stream(side):
            ts = [torch.full((n,), float(i + 1), device="cuda") for i, n in enumerate(sizes)]
        side.synchronize()
        want = [digest(t) for t in ts]
        # The sending thread's stream (the copies') busy for about a second: the send returns
        # with the copies still queued behind this, and the receiver opens them meanwhile.
        torch.cuda._sleep(int(2e9))
        a.send(ts)
        self.assertFalse(torch.cuda.current_stream().query(), "the send waited for its copies")
        del ts
        with torch.cuda.stream(side):
            junk = [torch.full((n,), -1.0, device="cuda") for n in sizes]
        side.synchronize()   # written: the side stream does not wait for the default one
        got, waits = r.get(timeout=120)
        self.assertEqual(got, want, "the receiver got memory the sender's allocator had handed out again")
        self.assertEqual(waits, 1, "one ready wait for the message's two buffers")
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        del junk
        self.wait_counters(base)

    def test_sender_exits_with_its_copies_queued(self):
        """A sender that exits right after a send whose copies still wait behind GPU work (the
        send does not wait for them): the receiver, opening the message only after the sender
        is gone, reads what was sent, because the sender's CUDA context is torn down only once
        its queued work is done (a spawned sender leaves through atexit, a forked one through
        os._exit)."""
        for target in (send_busy_and_exit, fork_and_send_busy):
            with self.subTest(sender=target.__name__):
                self._exit_with_copies_queued(target)

    def _exit_with_copies_queued(self, target):
        base = self.counters()
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        p = ctx.Process(target=target, args=(b,))
        p.start()
        b.close()
        self.assertTrue(a.poll(120), "no message from the sender")
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        got = a.recv()   # opened now: the sender has exited
        torch.cuda.current_stream().synchronize()
        self.assertEqual([digest(t) for t in got], [digest(t) for t in busy_values()])
        del got
        self.wait_counters(base)

    def test_sender_exits_first(self):
        base = self.counters()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=put_and_exit, args=(q,))
        p.start()
        p.join(120)
        self.assertEqual(p.exitcode, 0)
        a, b = q.get(timeout=60), q.get(timeout=60)
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        self.assertTrue(torch.equal(a, x * 3))
        self.assertTrue(torch.equal(b, x[::2]))
        del a, b
        self.wait_counters(base)

    def test_receiver_sigkilled_while_holding(self):
        base = self.counters()
        ctx = mp.get_context("spawn")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=hold_then_wait, args=(q, r))
        p.start()
        ts = [torch.randn(1 << 18, device="cuda"), gt.zeros(1000, device="cuda")]
        for t in ts:
            q.put(t)
        self.assertEqual(r.get(timeout=180), [digest(t) for t in ts])
        p.kill()
        p.join(60)
        del ts, t
        self.wait_counters(base)

    def test_thousand_tensors_through_a_queue(self):
        base = self.counters()
        n = 1000
        ctx = mp.get_context("spawn")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=sum_many, args=(q, r, n))
        p.start()
        h = hashlib.sha256()
        for i in range(n):
            t = torch.arange(64, dtype=torch.float32, device="cuda") + i
            h.update(t.to("cpu").numpy().tobytes())
            q.put(t)
        self.assertEqual(r.get(timeout=300), h.hexdigest())
        p.join(60)
        self.assertEqual(p.exitcode, 0)
        del t
        self.wait_counters(base)

    def test_messages_of_1000_and_10000_tensors(self):
        """One message of 1,000 and one of 10,000 bf16 tensors of torch's allocator (so
        copied), each received whole: CUDA gives gpupoold 4096 inter-process events, and one
        per buffer and per hold ran out."""
        base = self.counters()
        ctx = mp.get_context("spawn")
        q, r = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=digest_dicts, args=(q, r))
        p.start()
        for n in (1000, 10000):
            g = torch.Generator(device="cuda").manual_seed(n)
            msg = {"t%d" % i: torch.randn(1 << 15, device="cuda", generator=g).to(torch.bfloat16)
                   for i in range(n)}
            want = {k: digest(v) for k, v in msg.items()}
            q.put(msg)
            self.assertEqual(r.get(timeout=300), want, "message of %d tensors" % n)
            del msg
        q.put(None)
        p.join(120)
        self.assertEqual(p.exitcode, 0)
        self.wait_counters(base)

    def test_use_allocator(self):
        env = dict(os.environ, PYTHONPATH=PYROOT)
        out = subprocess.run([sys.executable, os.path.join(HERE, "alloc_main.py"), self.daemon.socket],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        text = out.stdout.decode(errors="replace")
        self.assertEqual(out.returncode, 0, text)
        self.assertIn("ALLOCATOR OK", text)
        out = subprocess.run([sys.executable, os.path.join(HERE, "alloc_main.py"), self.daemon.socket, "late"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
        text = out.stdout.decode(errors="replace")
        self.assertEqual(out.returncode, 0, text)
        self.assertIn("LATE REFUSED OK", text)
