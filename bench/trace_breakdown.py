#!/usr/bin/env python3
"""Where a single-buffer handoff spends its time, from a GPUPOOL_TRACE file.

    GPUPOOL_BENCH_ONLY=handoff GPUPOOL_TRACE=trace.txt \\
        build-gpu/bench/gpupool_bench build-gpu/daemon/gpupoold
    python3 bench/trace_breakdown.py trace.txt

gpupool_bench writes bench-T0 (producer, before gpupool_buffer_publish) and bench-T1 (consumer, its
stream synchronized after gpupool_buffer_get) into the trace; the client library adds its steps
(record_ready, read, rpc, attach, slab, events, wait) and gpupoold one line per request
(daemon-req<N>, N the Request body field number: 16 is Publish). Every line is
"PID START_US WHAT DURATIONus DETAIL" on CLOCK_MONOTONIC. For each handoff this splits T1 - T0
into the steps below and prints p10/p50/p90 over all handoffs in the file.

Tracing costs a write per line (a few microseconds each): the total is larger than the
benchmark's untraced figure; the split is what this is for.
"""

import argparse
import sys

PUBLISH = "daemon-req16"
STEPS = [
    "total (T0 -> T1)",
    "producer: before its Publish is sent (event record or stream query)",
    "producer send -> daemon starts handling it (daemon wake-up)",
    "daemon: handling Publish, answering the waiting consumer first",
    "daemon start -> consumer has read the reply (consumer wake-up)",
    "consumer: reply read -> usable pointer, stream synchronized",
]


def load(path):
    events = []
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) < 5 or not p[3].endswith("us"):
                continue
            try:
                events.append((int(p[0]), float(p[1]), p[2], float(p[3][:-2])))
            except ValueError:
                continue
    events.sort(key=lambda e: e[1])
    return events


def pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] if v else float("nan")


def breakdown(events, max_us):
    t1s = [e for e in events if e[2] == "bench-T1"]
    rows = []
    for t0 in (e for e in events if e[2] == "bench-T0"):
        t1 = next((e for e in t1s if e[1] > t0[1]), None)
        if t1 is None or t1[1] - t0[1] > max_us:
            continue
        prod, cons = t0[0], t1[0]
        rec = [e for e in events if e[0] == prod and e[2] == "record_ready" and abs(e[1] - t0[1]) < 50]
        pub = [e for e in events if e[2] == PUBLISH and t0[1] <= e[1] <= t1[1]]
        rd = [e for e in events if e[0] == cons and e[2] == "read" and t0[1] <= e[1] + e[3] <= t1[1]]
        if not (rec and pub and rd):
            continue
        rec_end, pub_start, read_end = rec[0][1] + rec[0][3], pub[0][1], rd[0][1] + rd[0][3]
        rows.append((t1[1] - t0[1], rec_end - t0[1], pub_start - rec_end, pub[0][3], read_end - pub_start,
                     t1[1] - read_end))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="+", help="GPUPOOL_TRACE files written during gpupool_bench's handoffs")
    ap.add_argument("--max-us", type=float, default=5000, help="ignore handoffs longer than this (default 5000)")
    args = ap.parse_args()
    status = 0
    for path in args.trace:
        rows = breakdown(load(path), args.max_us)
        print(f"{path}: {len(rows)} handoffs (us)")
        if not rows:
            print("  no handoff with bench-T0, bench-T1, record_ready, read and a daemon Publish line")
            status = 1
            continue
        print(f"  {'step':<70} {'p10':>7} {'p50':>7} {'p90':>7}")
        for i, name in enumerate(STEPS):
            v = [r[i] for r in rows]
            print(f"  {name:<70} {pct(v, .1):7.1f} {pct(v, .5):7.1f} {pct(v, .9):7.1f}")
    return status


if __name__ == "__main__":
    sys.exit(main())
