#!/usr/bin/env python3
"""Read the tensors producer.py published, in place, and check them bit for bit.

With torch and a GPU the consumer works on a stream of its own: get() makes that stream wait
for the producer's ready event (the CPU does not block) and torch.from_dlpack() gives a
CUDA tensor over the producer's memory. Otherwise NumPy views gpupool host memory.
Each name is unpublished after it is checked (unless --keep), so its memory returns to the
pool once this process lets go. Run it as producer.py says (the installed package).
"""

import sys
import time

import gpupool
# The script's own directory is first on sys.path when it runs: producer.py is beside it.
from producer import demo_parser, pick_mode, tensor_values


def main():
    ap = demo_parser(__doc__, "name prefix, as given to producer.py", "how many tensors to read")
    ap.add_argument("--timeout", type=float, default=30.0,
                    help="seconds to wait for each name to be published")
    ap.add_argument("--keep", action="store_true", help="leave the names published")
    args = ap.parse_args()

    bad = 0
    with gpupool.Client(args.socket, name="consumer.py") as client:
        mode, device = pick_mode(client, args.mode)
        n = args.size
        for i in range(args.count):
            name = "%s/%d" % (args.name, i)
            t0 = time.perf_counter()
            if mode == "torch":
                import torch

                stream = torch.cuda.Stream(device=device)
                with torch.cuda.stream(stream):
                    # Not read_only: torch releases before 2.6 import only the legacy
                    # DLPack form, which cannot carry the read-only flag.
                    t = client.get(name, timeout=args.timeout, stream=stream)
                    x = torch.from_dlpack(t)  # zero copy, usable in `stream`
                    ok = bool(torch.equal(x, tensor_values(torch, n, i, device)))
                    where = "%s (stream 0x%x)" % (device, stream.cuda_stream)
                del x
            else:
                import numpy as np

                t = client.get(name, timeout=args.timeout, read_only=True)
                x = np.asarray(t)  # zero copy: a view of the producer's buffer
                ok = x.shape == (n,) and np.array_equal(x, tensor_values(np, n, i))
                where = "host memory"
                del x
            dt = time.perf_counter() - t0
            print("got %s: shape %s %s in %s, buffer %d, %s, %.2f ms"
                  % (name, t.shape, t.dtype, where, t.buffer_id,
                     "bit-exact" if ok else "MISMATCH", dt * 1e3), flush=True)
            bad += not ok
            t.release()
            if not args.keep:
                client.unpublish(name)
    print("consumer done (%s mode): %d of %d tensors matched" % (mode, args.count - bad,
                                                                 args.count))
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except gpupool.GpupoolError as e:
        sys.exit("consumer.py: %s" % e)
