"""One training step of a Llama-shaped model under gpupool.torch.use_allocator() against torch's
caching allocator: forward, backward and AdamW, each allocator in a fresh process (an allocator
is chosen before the first CUDA allocation), alternating A B A B ... so that both see the same
GPU clocks and neighbours.

    python bench/torch_train_step.py --gpupoold build-gpu/daemon/gpupoold [--rounds 3] [--steps 30]

The model is transformers' LlamaForCausalLM built from a config with random weights (nothing
downloaded): hidden 2048, 16 layers, 16 heads (4 key/value heads), intermediate 5632, vocab
32000, bf16 weights and AdamW states, a batch of 8 sequences of 1024 tokens. Each process
warms up 5 steps, then times `--steps` steps (torch.cuda.synchronize at the end of each); the
report is each process's median step, and the ratio of the medians over all rounds. The
target (issue text): use_allocator() within 3% of torch's step time.
"""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import arg_parser, percentile, pool_spec, use_alloc_library, use_library  # noqa: E402


def measure(which, device, sock, steps):
    import torch

    if which == "gpupool":
        import gpupool.torch as gt

        gt.use_allocator(socket=sock)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dev = torch.device(device)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).to(device=dev, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, cfg.vocab_size, (8, 1024), device=dev)
    times = []
    for k in range(5 + steps):
        t0 = time.perf_counter()
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
        if k >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    res = {"p50_ms": percentile(times, 50), "p90_ms": percentile(times, 90), "loss": float(out.loss),
           "peak_mib": torch.cuda.max_memory_allocated(dev) / 2**20 if which == "torch" else None}
    if which == "gpupool":
        res["counts"] = gt.allocator_counts()
    return res


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))))
        return 0
    ap = arg_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3, help="processes per allocator (alternating)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per process")
    args = ap.parse_args()
    use_library(args.library, args.gpupoold)
    use_alloc_library()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "python"))
    from gpupool.testing import Daemon

    dev_index = int(args.device.split(":")[1]) if ":" in args.device else 0
    runs = {"torch": [], "gpupool": []}
    with Daemon(binary=args.gpupoold, backend="cuda",
                pools=[pool_spec(True, dev_index, 96 << 30, 1 << 30)]) as d:
        for r in range(args.rounds):
            for which in ("torch", "gpupool"):
                env = dict(os.environ, PYTHONPATH=os.path.join(here, "..", "python"))
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", which, args.device,
                                    d.socket, str(args.steps)], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, timeout=900)
                if p.returncode != 0:
                    sys.stderr.write(p.stderr.decode(errors="replace"))
                    return 1
                res = json.loads(p.stdout.decode().strip().splitlines()[-1])
                runs[which].append(res)
                print("round %d, %-7s step p50 %.2f ms, p90 %.2f ms, loss %.4f%s"
                      % (r + 1, which, res["p50_ms"], res["p90_ms"], res["loss"],
                         ", torch's peak %.0f MiB" % res["peak_mib"] if res.get("peak_mib") else ""), flush=True)
    a = percentile([x["p50_ms"] for x in runs["torch"]], 50)
    b = percentile([x["p50_ms"] for x in runs["gpupool"]], 50)
    c = runs["gpupool"][-1].get("counts", {})
    print("\n| allocator | step p50 (median of %d processes) | against torch |" % args.rounds)
    print("| --- | --- | --- |")
    print("| torch's caching allocator | %.2f ms | 1.000 |" % a)
    print("| gpupool.torch.use_allocator() | %.2f ms | %.3f |" % (b, b / a))
    print("\nuse_allocator(), last process: %d allocations, %d segments allocated by requests to gpupoold, "
          "%d given back" % (c.get("allocs", 0), c.get("daemon_allocs", 0), c.get("daemon_releases", 0)))
    print("target (within 3%% of torch's step time): %s (%+.1f%%)" % ("met" if b <= a * 1.03 else "missed",
                                                                     (b / a - 1) * 100))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
