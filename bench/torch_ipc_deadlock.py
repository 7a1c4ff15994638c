"""The pattern of PyTorch's test_cuda_ipc_deadlock (test/test_multiprocessing.py), timed: a
learner puts a deep copy of a CUDA LSTM's state dict into a Queue(1) whenever it is not full,
100 times, 10 ms apart; an actor takes one whenever the queue is not empty, 100 times, 10 ms
apart; both spawned. The test gives the two processes 10 s (join(10)) to finish. Here each mode
runs `--pairs` such pairs at once, each from a process of its own as a test would be (the
suite's parallel jobs load the machine the same way), and reports how long each pair's
processes took, from start to exit.

    python bench/torch_ipc_deadlock.py --gpupoold build-gpu/daemon/gpupoold [--pairs 1,6]
    python bench/torch_ipc_deadlock.py --gpupoold build/daemon/gpupoold --device cpu   # host backend

Modes: none (torch as it is), install (gpupool.torch.install(): storages copied into gpupool
memory), allocator (install() and use_allocator(): every CUDA tensor gpupool memory).
"""

import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import arg_parser, percentile, pool_spec, use_alloc_library, use_library  # noqa: E402

ITERATIONS = 100


def _setup(mode, sock, device):
    if mode == "none":
        return
    import gpupool.torch as gt

    if mode == "allocator":
        gt.use_allocator(socket=sock)
    gt.install(socket=sock, cpu=device == "cpu")


def actor(mode, sock, device, queue):
    _setup(mode, sock, device)
    for _ in range(ITERATIONS):
        if not queue.empty():
            queue.get()
        time.sleep(0.01)


def learner(mode, sock, device, queue):
    _setup(mode, sock, device)
    import torch

    net = torch.nn.LSTM(1, 1).to(device)
    for _ in range(ITERATIONS):
        if not queue.full():
            queue.put(copy.deepcopy(net.state_dict()))
        time.sleep(0.01)


def one_pair(mode, sock, device):
    """What the test does, in this process: a Queue(1), an actor and a learner spawned, both
    joined: (seconds until both exited, whether both exited 0)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue(1)
    a = ctx.Process(target=actor, args=(mode, sock, device, q))
    b = ctx.Process(target=learner, args=(mode, sock, device, q))
    t0 = time.monotonic()
    a.start()
    b.start()
    ok = True
    for p in (a, b):
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
            ok = False
        ok &= p.exitcode == 0
    return time.monotonic() - t0, ok


def run_pairs(mode, sock, device, pairs):
    """pairs processes at once, each running one_pair (as the suite runs tests in parallel)."""
    import json
    import subprocess

    ps = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--pair", mode, sock, device],
                           stdout=subprocess.PIPE) for _ in range(pairs)]
    times, ok = [], True
    for p in ps:
        out, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            ok = False
            continue
        t, good = json.loads(out.decode().strip().splitlines()[-1])
        times.append(t)
        ok &= good
    return times or [float("nan")], ok


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--pair":
        import json

        print(json.dumps(one_pair(sys.argv[2], sys.argv[3], sys.argv[4])))
        return 0
    ap = arg_parser(__doc__)
    ap.add_argument("--pairs", default="1,6", help="comma-separated numbers of pairs run at once")
    ap.add_argument("--modes", default="none,install,allocator")
    args = ap.parse_args()
    use_library(args.library, args.gpupoold)
    use_alloc_library()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "python"))
    os.environ["PYTHONPATH"] = os.path.join(here, "..", "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
    from gpupool.testing import Daemon

    dev_index = int(args.device.split(":")[1]) if ":" in args.device else 0
    print("| mode | pairs at once | each pair done after (s): median / slowest | all exited 0 | within the test's 10 s |")
    print("| --- | --- | --- | --- | --- |")
    cuda = args.device.startswith("cuda")
    with Daemon(binary=args.gpupoold, backend="cuda" if cuda else "host",
                pools=[pool_spec(cuda, dev_index, 16 << 30 if cuda else 1 << 30, 1 << 30 if cuda else 64 << 20)]) as d:
        for pairs in [int(x) for x in args.pairs.split(",")]:
            for mode in args.modes.split(","):
                if mode == "allocator" and not cuda:
                    continue
                times, ok = run_pairs(mode, d.socket, args.device, pairs)
                print("| %s | %d | %.2f / %.2f | %s | %s |" % (mode, pairs, percentile(times, 50), max(times),
                                                              "yes" if ok else "NO",
                                                              "yes" if ok and max(times) <= 10 else "NO"),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
