"""The producer process of the GPU Python tests: torch on CUDA, as told on its command line.

Values are integers (exact in float32 on every device and framework), so consumers can check
them bit for bit with torch or CuPy. Before each fill the producer's stream spins for a while
(torch.cuda._sleep): a consumer that did not wait for the ready event would read the buffer
before the fill lands.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import gpupool  # noqa: E402

SPIN_CYCLES = 300_000_000  # a few hundred milliseconds on current GPUs


def values(n, i, device):
    return torch.arange(n, device=device, dtype=torch.float32).mul_(float(i + 1))


def main():
    cmd, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    dev = "cuda:0"
    c = gpupool.Client(name="gpu-peer")
    stream = torch.cuda.Stream(device=dev)
    keep = []
    for i in range(count):
        nm = "%s/%d" % (name, i)
        with torch.cuda.stream(stream):
            if cmd == "inplace":
                # Produce into gpupool memory, publish without a copy.
                t = c.alloc((n,), "float32", device=dev)
                x = torch.from_dlpack(t)
                x.zero_()
                torch.cuda._sleep(SPIN_CYCLES)
                x.copy_(values(n, i, dev))
                c.publish(nm, x, stream=stream)
                print("buffer", t.buffer_id, flush=True)
                keep.append(x)
            elif cmd == "copy":
                # A plain torch tensor, strided: copied device-to-device and compacted.
                big = torch.zeros((n, 2), device=dev, dtype=torch.float32)
                torch.cuda._sleep(SPIN_CYCLES)
                big[:, 1] = values(n, i, dev)
                c.publish(nm, big[:, 1])  # stream: torch's current one, i.e. `stream`
                print("copied", flush=True)
                keep.append(big)
            else:
                raise SystemExit("unknown command %r" % cmd)
    # Said while the fills are still queued behind the spin: consumers must wait on the
    # ready event. Then wait for the GPU and exit: the tensors outlive the producer.
    print("published", flush=True)
    torch.cuda.synchronize()
    keep.clear()
    c.close()


if __name__ == "__main__":
    main()
