"""A receiving process for the gpupool.torch tests that must start outside multiprocessing (in
another PID namespace, as another uid): reads one pickled message (ForkingPickler bytes) from
stdin, unpickles it (which connects to $GPUPOOL_SOCKET and installs gpupool.torch here), and
prints one line per tensor: its sum of bytes as a hex digest, dtype and shape.

    python torch_peer.py [hold SECONDS]
"""

import hashlib
import os
import pickle
import sys
import time


def main():
    data = sys.stdin.buffer.read()
    obj = pickle.loads(data)
    import torch  # imported by the unpickling above

    for t in obj:
        b = t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        print("%s %s %s %d" % (hashlib.sha256(b).hexdigest(), t.dtype, tuple(t.shape), os.getpid()),
              flush=True)
    if len(sys.argv) > 2 and sys.argv[1] == "hold":
        time.sleep(float(sys.argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
