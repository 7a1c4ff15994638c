"""Targets for child processes that know nothing of gpupool (they import torch only): what
they send travels through gpupool only because their parent called gpupool.torch.install()."""

import torch


def put_and_exit(q):
    x = torch.arange(5000, dtype=torch.float32)
    q.put(x * 3)
    q.put(x[::2])
    q.close()
    q.join_thread()
