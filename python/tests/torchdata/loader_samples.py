"""Datasets of the torch_data tests, in a module of their own so that spawned workers can
import them."""

import os
import signal
import time

import numpy as np
import torch


class Samples(torch.utils.data.Dataset):
    """Deterministic samples of every kind default_collate handles: tensors of several
    types, a NumPy array, ints, floats, bools, strings, a tuple and a nested dict."""

    def __init__(self, n=37, delay_every=0, kill_at=-1, fail_at=-1):
        self.n = n
        self.delay_every = delay_every
        self.kill_at = kill_at
        self.fail_at = fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if i == self.fail_at:
            raise ValueError("sample %d is broken" % i)
        if self.delay_every and i % self.delay_every == 0:
            time.sleep(0.05)  # this worker falls behind: batches arrive out of order
        g = torch.Generator().manual_seed(i)
        return {
            "image": torch.randn(3, 5, 7, generator=g),
            "mask": torch.rand(5, 7, generator=g) > 0.5,
            "tokens": torch.randint(0, 1 << 30, (11,), generator=g, dtype=torch.int64),
            "half": torch.randn(4, generator=g).to(torch.bfloat16),
            "np": np.arange(6, dtype=np.float32).reshape(2, 3) * i,
            "label": i,
            "weight": i * 0.5,
            "flag": bool(i % 2),
            "name": "sample-%d" % i,
            "pair": (torch.full((2,), i, dtype=torch.int16), i * 3),
        }


class Big(torch.utils.data.Dataset):
    """Samples of 256 KiB, so that a batch's buffer is counted clearly."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((64, 1024), float(i))


def custom_collate(batch):
    """A collate function of the user's own: a tensor made here (copied into the batch's
    buffer) and a list of strings."""
    return torch.cat([b["image"].reshape(-1) for b in batch]), [b["name"] for b in batch]


def record_worker(worker_id):
    os.environ["TORCH_DATA_TEST_WORKER"] = str(worker_id)


class WorkerIds(torch.utils.data.Dataset):
    """Each sample says which worker made it (set by record_worker) and that worker's pid."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i, int(os.environ.get("TORCH_DATA_TEST_WORKER", "-1")),
                             os.getpid()])


class Collecting(torch.utils.data.Dataset):
    """Each sample runs the cyclic garbage collector first, as any worker's code may."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import gc

        gc.collect()
        return torch.tensor([i])
