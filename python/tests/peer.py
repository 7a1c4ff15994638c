"""The other process in the Python tests: produces or holds tensors through gpupool as told
on its command line, and reports on stdout, one line per step, so a test can follow it.

Connects to $GPUPOOL_SOCKET. Also imported by the tests for sample_array().
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

# Every dtype NumPy has that gpupool carries; bfloat16 is handled through raw bits.
NUMPY_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "bool", "complex64", "complex128")


def sample_array(dtype, shape=(3, 4, 5)):
    """Deterministic values covering the type's range edges (negative, large, fractional)."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.int64)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        a = (i * 7 % 3) == 1
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        lo, hi = int(info.min), int(info.max)
        vals = [hi if k % 5 == 0 else lo if k % 5 == 1 else min(max(k * 37 - 11, lo), hi)
                for k in range(n)]
        a = np.array(vals, dtype=dt)
    elif dt.kind == "f":
        a = ((i - n / 2) * 1.25 / 3.0).astype(dt)
        a[0] = np.finfo(dt).max
        a[1] = -np.finfo(dt).tiny
    else:
        a = ((i - n / 2) / 3.0 + 1j * (i * 0.5 - 1)).astype(dt)
    return a.reshape(shape)


def bf16_bits(n=12):
    """bfloat16 bit patterns: 1.0, -2.0, 0.5, inf, -0.0, then a ramp."""
    fixed = [0x3F80, 0xC000, 0x3F00, 0x7F80, 0x8000]
    return np.array((fixed + list(range(0x4000, 0x4000 + n)))[:n], dtype=np.uint16)


# A small state dict: every kind of member a bundle carries (bfloat16 as raw bits).
DICT_SPEC = (("embed", (16, 8), "float32"), ("layer.0.w", (8, 8), "bfloat16"),
             ("layer.0.b", (8,), "float16"), ("step", (), "int64"), ("mask", (3, 5), "bool"),
             ("ids", (7,), "uint16"), ("rot", (2, 2), "complex64"), ("empty", (0, 3), "int32"))


def dict_values(seed):
    """name -> NumPy array for DICT_SPEC, different for every seed (bfloat16 as uint16)."""
    out = {}
    for name, shape, dt in DICT_SPEC:
        if dt == "bfloat16":
            a = (bf16_bits(int(np.prod(shape))) + seed).astype(np.uint16).reshape(shape)
        elif dt == "bool":
            a = sample_array(dt, shape) ^ bool(seed % 2)
        else:
            a = (sample_array(dt, shape) + np.array(seed).astype(dt)).astype(dt)
        out[name] = a
    return out


def produce_dict(c, name, seed):
    """alloc_dict + write + publish_dict; returns (version, the TensorDict)."""
    td = c.alloc_dict({n: (shape, dt) for n, shape, dt in DICT_SPEC})
    views = td.numpy(raw=True)
    for k, a in dict_values(seed).items():
        views[k][...] = a
    return c.publish_dict(name, td), td


def dict_matches(td, seed):
    got = td.numpy(raw=True)
    want = dict_values(seed)
    return list(got) == list(want) and all(
        got[k].shape == want[k].shape and got[k].tobytes() == want[k].tobytes() for k in want)


def main():
    import gpupool

    cmd, args = sys.argv[1], sys.argv[2:]
    c = gpupool.Client(name="peer-" + cmd)

    if cmd == "dtypes":
        prefix = args[0]
        for name in NUMPY_DTYPES:
            c.publish("%s/%s" % (prefix, name), sample_array(name))
        # A 0-d and an empty tensor travel too.
        c.publish(prefix + "/scalar", np.array(3.5, dtype=np.float64))
        c.publish(prefix + "/empty", np.zeros((0, 4), dtype=np.int32))
        t = c.alloc((3, 4), "bfloat16")
        t.numpy(raw=True)[...] = bf16_bits(12).reshape(3, 4)
        c.publish(prefix + "/bfloat16", t)
        print("published", flush=True)

    elif cmd == "strided":
        prefix = args[0]
        base = np.arange(6 * 8, dtype=np.int32).reshape(6, 8)
        c.publish(prefix + "/slice", base[::2, 1::3])          # not contiguous: copied
        c.publish(prefix + "/reversed", base[::-1, ::-1])      # negative strides: copied
        c.publish(prefix + "/fortran", np.asfortranarray(base.astype(np.float64)))
        # A view of gpupool memory is published in place, with its layout and offset.
        t = c.alloc((6, 8), "int32")
        v = t.numpy()
        v[...] = base * 10
        c.publish(prefix + "/inplace", v[1:5, ::2])
        print("buffer", t.buffer_id, flush=True)

    elif cmd == "write-after-publish":
        name = args[0]
        t = c.alloc((1024,), "float32")
        view = t.numpy()
        view[...] = 1.0
        c.publish(name, t)
        print("buffer", t.buffer_id, flush=True)
        sys.stdin.readline()
        view[...] = 2.0
        print("written", flush=True)
        sys.stdin.read()

    elif cmd == "get-and-hold":
        name, n = args[0], int(args[1])
        kept = []
        for _ in range(n):
            t = c.get(name, timeout=10)
            kept.append((t, np.from_dlpack(t)))
        print("held", len(kept), flush=True)
        time.sleep(3600)

    elif cmd == "publish-later":
        name, delay = args[0], float(args[1])
        time.sleep(delay)
        c.publish(name, np.arange(10, dtype=np.int32))
        print("published", flush=True)

    elif cmd == "dict-produce":
        name, seed = args[0], int(args[1])
        version, td = produce_dict(c, name, seed)
        print("version", version, flush=True)
        print("buffers", td.buffers, flush=True)

    elif cmd == "dict-publish-later":
        name, delay, seed = args[0], float(args[1]), int(args[2])
        time.sleep(delay)
        version, td = produce_dict(c, name, seed)
        print("version", version, flush=True)

    elif cmd == "dict-check":
        name, newer, seed = args[0], int(args[1]), int(args[2])
        with c.get_dict(name, newer_than=newer, timeout=30) as td:
            print("version", td.version, flush=True)
            print("match", "yes" if dict_matches(td, seed) else "no", flush=True)

    elif cmd == "dict-get-and-hold":
        name = args[0]
        td = c.get_dict(name, timeout=10)
        views = td.numpy(raw=True)
        print("held", td.version, len(views), flush=True)
        time.sleep(3600)

    else:
        raise SystemExit("unknown command %r" % cmd)
    c.close()


if __name__ == "__main__":
    main()
