"""use_allocator() in a fresh process: every CUDA tensor is a gpupool buffer, so install()
shares even torch's temporaries without a copy (the child's writes are seen here), and a
second use_allocator() after CUDA memory exists is refused with a clear error.

    python alloc_main.py SOCKET          # the allocator, install(copy=False), a child's write
    python alloc_main.py SOCKET late     # use_allocator() after a CUDA allocation: refused
"""

import sys

import torch
import torch.multiprocessing as mp

import gpupool.torch as gt


def child(q, r):
    t = q.get(timeout=120)
    r.put(float(t.sum()))
    t.add_(1.0)            # in the parent's memory
    torch.cuda.synchronize()
    r.put("written")
    q.get(timeout=120)


def late(sock):
    torch.ones(1, device="cuda")   # torch's caching allocator is in use from here on
    try:
        gt.use_allocator(socket=sock)
    except gt.GpupoolError as e:
        assert "before this process's first CUDA allocation" in str(e), e
        print("LATE REFUSED OK")
        return
    raise AssertionError("use_allocator() after a CUDA allocation was not refused")


def main():
    sock = sys.argv[1]
    if sys.argv[2:] == ["late"]:
        return late(sock)
    gt.use_allocator(socket=sock)
    gt.install(socket=sock, copy=False)   # nothing may need a copy now
    x = torch.ones(1000, 1000, device="cuda")
    y = x * 2              # an ordinary torch op: its output is a gpupool buffer too
    counts = gt.allocator_counts()
    assert counts["live"] >= 2, counts
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, r))
    p.start()
    q.put(y)
    assert r.get(timeout=180) == 2e6
    assert r.get(timeout=60) == "written"
    torch.cuda.synchronize()
    assert bool((y == 3.0).all()), "the child's write did not reach the parent's tensor"
    q.put("done")
    p.join(60)
    assert p.exitcode == 0
    try:
        gt.use_allocator(socket=sock)
        raise AssertionError("a second use_allocator() was not refused")
    except gt.GpupoolError as e:
        assert "already runs" in str(e), e
    # The cache: a thousand allocations and frees make no request to gpupoold; a second
    # stream's tensors are served too; torch.cuda.empty_cache gives unused segments back.
    made = gt.allocator_counts()["daemon_allocs"]
    for _ in range(1000):
        t = torch.empty(1 << 18, device="cuda")
        del t
    assert gt.allocator_counts()["daemon_allocs"] <= made + 1, gt.allocator_counts()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        z = torch.full((1 << 18,), 5.0, device="cuda")
        assert float(z.sum()) == 5.0 * (1 << 18)
        del z
    del x, y
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    c = gt.allocator_counts()
    assert c["live"] > 0 or c["segments"] == 0, c
    print("counts", gt.allocator_counts())
    print("ALLOCATOR OK")


if __name__ == "__main__":
    main()
