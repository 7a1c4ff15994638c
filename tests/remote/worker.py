"""A client process of the peer tests, connected to $GPUPOOL_SOCKET: does one thing and says
on stdout what came of it, one line, so that a test can run it as another uid or kill it.

    worker.py publish NAME NBYTES SEED       -> "published VERSION"
    worker.py get NAME TIMEOUT_S [SEED]      -> "ok VERSION NBYTES" | "error CODE MESSAGE" (exit 3)
    worker.py get_dict NAME TIMEOUT_S        -> "ok VERSION MEMBERS" | "error CODE MESSAGE" (exit 3)
    worker.py consumers N NAME TIMEOUT_S NEWER_THAN SEED
        N connections at once (one thread each) get NAME after NEWER_THAN; each compares the
        bytes with pattern(SEED) -> "ok VERSION N BUFFER_IDS" | "error ..." (exit 3)

"started" is printed (and flushed) before the request goes out.
"""

import os
import resource
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import gpupool  # noqa: E402
from cluster import pattern  # noqa: E402


def say(*words):
    print(" ".join(str(w) for w in words), flush=True)


def main(argv):
    cmd = argv[1]
    try:
        with gpupool.Client(name="remote-worker") as c:
            if cmd == "publish":
                name, nbytes, seed = argv[2], int(argv[3]), int(argv[4])
                t = c.alloc(nbytes, "uint8", device="cpu")
                t.numpy()[:] = pattern(seed, nbytes)
                say("published", c.publish(name, t))
                t.release()
            elif cmd == "get":
                name, timeout = argv[2], float(argv[3])
                say("started")
                t = c.get(name, timeout=timeout)
                if len(argv) > 4 and not np.array_equal(t.numpy().view(np.uint8).reshape(-1),
                                                        pattern(int(argv[4]), t.numpy().nbytes)):
                    say("error EDATA the bytes differ from the pattern")
                    return 4
                say("ok", t.version, t.numpy().nbytes)
                t.release()
            elif cmd == "get_dict":
                name, timeout = argv[2], float(argv[3])
                say("started")
                td = c.get_dict(name, timeout=timeout)
                say("ok", td.version, len(td.keys()))
                td.release()
            elif cmd == "consumers":
                return consumers(int(argv[2]), argv[3], float(argv[4]), int(argv[5]),
                                 int(argv[6]))
            else:
                say("error EINVAL unknown command", cmd)
                return 2
    except gpupool.GpupoolError as e:
        say("error", e.name, e.message.replace("\n", " "))
        return 3
    return 0


def consumers(n, name, timeout, newer_than, seed):
    # Each connection takes a socket and a lease, and each mapping of the copy an fd while it
    # is imported: 200 of them need more than a 1024-fd soft limit leaves to spare.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8 * n
    if soft != resource.RLIM_INFINITY and soft < want:
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    clients = [gpupool.Client(name="remote-consumer-%d" % i) for i in range(n)]
    results = [None] * n
    gate = threading.Barrier(n + 1)

    def one(i):
        gate.wait()
        try:
            t = clients[i].get(name, timeout=timeout, newer_than=newer_than)
            results[i] = (t.version, t.buffer_id, t)
        except gpupool.GpupoolError as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    gate.wait()
    say("started")
    for th in threads:
        th.join()
    errors = [r for r in results if isinstance(r, gpupool.GpupoolError)]
    if errors:
        say("error", errors[0].name, "%d of %d failed, first: %s" % (len(errors), n,
                                                                     errors[0].message))
        return 3
    versions = {r[0] for r in results}
    want = None
    for version, _, t in results:
        a = t.numpy().view(np.uint8).reshape(-1)
        if want is None:
            want = pattern(seed, a.nbytes)
        if not np.array_equal(a, want):
            say("error EDATA a consumer's bytes differ from the pattern")
            return 4
        t.release()
    for c in clients:
        c.close()
    say("ok", ",".join(map(str, sorted(versions))), n, len({r[1] for r in results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
