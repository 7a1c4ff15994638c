"""GPU refit tests: trainer ranks (separate processes on cuda:0) publish FSDP dim-0 shards of a
Llama-shaped model's bf16 weights, copied from torch's allocator or in place from
gpupool.torch.empty; an engine (this process) with tensor-parallel parameters of its own
(fused qkv_proj and gate_up_proj, row-parallel o_proj and down_proj, vocab-parallel embedding
and head) at TP 1 and as each rank of TP 2 and 4 would hold them refits them in place: the
same data_ptr(), bit-equal to the expected slices, version after version. Then a
transformers Llama whose forward step is captured in a torch.cuda.CUDAGraph: after each
refit, replaying the graph gives logits bit-equal to an eager copy loaded with that version,
and no graph is captured again. Skipped without torch+CUDA (and the second without
transformers)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/tests: support
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # python: gpupool

try:
    import torch

    HAVE_TORCH_CUDA = torch.cuda.is_available()
    WHY = "" if HAVE_TORCH_CUDA else "torch sees no CUDA device"
except (ImportError, AttributeError) as e:  # AttributeError: python/tests/torch, no torch
    torch = None
    HAVE_TORCH_CUDA = False
    WHY = "torch is not installed (%s)" % e

try:
    import transformers
except ImportError:
    transformers = None

from gpupool.testing import Daemon  # noqa: E402
import gpupool  # noqa: E402
from support import child_env  # noqa: E402

TRAINER = os.path.join(HERE, "refit_trainer.py")

# A small Llama: hidden 512, 8 heads of 64, 4 KV heads, MLP 1408, 2 layers, vocab 1024.
H, NH, NKV, HD, FF, LAYERS, VOCAB = 512, 8, 4, 64, 1408, 2, 1024


def llama_shapes():
    s = {"embed": (VOCAB, H), "norm": (H,), "lm_head": (VOCAB, H)}
    for i in range(LAYERS):
        p = "l%d." % i
        s.update({p + "q": (NH * HD, H), p + "k": (NKV * HD, H), p + "v": (NKV * HD, H),
                  p + "o": (H, NH * HD), p + "gate": (FF, H), p + "up": (FF, H),
                  p + "down": (H, FF), p + "in_norm": (H,), p + "post_norm": (H,)})
    return s


def tp_engine(tp, r, device="cuda:0"):
    """The parameters rank r of a TP-`tp` engine holds, and the refit targets that fill them."""
    q, kv, ff, v = NH * HD // tp, NKV * HD // tp, FF // tp, VOCAB // tp

    def rows(n):
        return (slice(n * r, n * (r + 1)),)

    def cols(n):
        return (slice(None), slice(n * r, n * (r + 1)))

    params, targets, expect = {}, {}, {}

    def add(name, shape, pieces, dim, exp):
        t = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        params[name] = t
        targets[name] = (t, pieces, dim)
        expect[name] = exp

    add("embed", (v, H), [("embed", rows(v))], 0, lambda w: w["embed"][rows(v)])
    add("lm_head", (v, H), [("lm_head", rows(v))], 0, lambda w: w["lm_head"][rows(v)])
    add("norm", (H,), ["norm"], 0, lambda w: w["norm"])
    for i in range(LAYERS):
        p = "l%d." % i
        add(p + "qkv_proj", (q + 2 * kv, H), [(p + "q", rows(q)), (p + "k", rows(kv)), (p + "v", rows(kv))],
            0, lambda w, p=p: torch.cat([w[p + "q"][rows(q)], w[p + "k"][rows(kv)], w[p + "v"][rows(kv)]]))
        add(p + "o_proj", (H, q), [(p + "o", cols(q))], 1, lambda w, p=p: w[p + "o"][cols(q)])
        add(p + "gate_up_proj", (2 * ff, H), [(p + "gate", rows(ff)), (p + "up", rows(ff))], 0,
            lambda w, p=p: torch.cat([w[p + "gate"][rows(ff)], w[p + "up"][rows(ff)]]))
        add(p + "down_proj", (H, ff), [(p + "down", cols(ff))], 1, lambda w, p=p: w[p + "down"][cols(ff)])
        add(p + "in_norm", (H,), [p + "in_norm"], 0, lambda w, p=p: w[p + "in_norm"])
        add(p + "post_norm", (H,), [p + "post_norm"], 0, lambda w, p=p: w[p + "post_norm"])
    return params, targets, expect


def bits(t):
    return t.contiguous().view(torch.int16)


class Trainers:
    """WORLD trainer processes publishing FSDP parts of the model of `shapes`."""

    def __init__(self, socket, shapes, world, mode, name):
        self.dir = tempfile.mkdtemp(prefix="gpupool-refit-")
        spec = os.path.join(self.dir, "spec.json")
        with open(spec, "w") as f:
            json.dump({"shapes": {k: list(v) for k, v in shapes.items()}}, f)
        self.procs = [subprocess.Popen([sys.executable, TRAINER, spec, str(r), str(world), mode, name],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env=child_env(socket)) for r in range(world)]
        for p in self.procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                self.close()
                raise RuntimeError("trainer did not start: %r" % line)

    def publish(self, version):
        """Every rank publishes its part of `version`; returns how many said they completed it."""
        for p in self.procs:
            p.stdin.write("%d\n" % version)
            p.stdin.flush()
        complete = 0
        for p in self.procs:
            words = p.stdout.readline().split()
            if len(words) != 3 or words[0] != "ok" or int(words[1]) != version:
                raise RuntimeError("trainer answered %r for version %d" % (words, version))
            complete += int(words[2])
        return complete

    def close(self):
        for p in self.procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()


def version_weights(shapes, version):
    sys.path.insert(0, HERE)
    from refit_trainer import weights

    return weights(shapes, version)


@unittest.skipUnless(HAVE_TORCH_CUDA, "GPU refit tests need torch with CUDA: " + WHY)
class GpuRefit(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.environ.get("GPUPOOLD"):
            raise unittest.SkipTest("set GPUPOOLD to a gpupoold built with CUDA")
        try:
            cls.daemon = Daemon(backend="cuda", pools=(
                "name=gpu0,kind=device,device=0,capacity=4G,slab=16M,keep_dedicated=8",)).start()
        except RuntimeError as e:
            raise unittest.SkipTest("gpupoold cannot run its CUDA backend here: %s" % e)
        cls.socket = cls.daemon.socket

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def refit_tp(self, mode, name_suffix):
        shapes = llama_shapes()
        world = 3  # uneven FSDP shards: 512 / 3, 1408 / 3 ...
        name = "policy-" + name_suffix
        trainers = Trainers(self.socket, shapes, world, mode, name)
        c = gpupool.Client(self.socket, name="engine-" + name_suffix)
        try:
            self.assertEqual(trainers.publish(1), 1)
            engines = [tp_engine(tp, r) for tp in (1, 2, 4) for r in range(tp)]
            plans = [c.refit_plan(name, targets) for _, targets, _ in engines]
            ptrs = [{k: t.data_ptr() for k, t in params.items()} for params, _, _ in engines]
            stream = torch.cuda.Stream()
            for version in range(1, 5):
                if version > 1:
                    self.assertEqual(trainers.publish(version), 1)
                # Version 3 goes one cudaMemcpy2DAsync a copy, the others through the gather
                # kernel (every copy here is within GPU 0): both must write the same bits.
                one_by_one = version == 3
                if one_by_one:
                    os.environ["GPUPOOL_REFIT_GATHER"] = "0"
                try:
                    with torch.cuda.stream(stream):
                        for plan in plans:
                            self.assertEqual(plan.refit(newer_than=version - 1, timeout=30, stream=stream),
                                             version)
                            info = plan.info()
                            self.assertEqual(info["gathered"], 0 if one_by_one else info["copies"],
                                             "version %d: %r" % (version, info))
                finally:
                    if one_by_one:
                        del os.environ["GPUPOOL_REFIT_GATHER"]
                stream.synchronize()
                if version == 2:
                    maps = c.slab_maps
                w = version_weights(shapes, version)
                for (params, _, expect), before in zip(engines, ptrs):
                    for k, t in params.items():
                        self.assertEqual(t.data_ptr(), before[k], k)
                        want = expect[k](w)
                        self.assertEqual(tuple(t.shape), tuple(want.shape), k)
                        self.assertTrue(torch.equal(bits(t), bits(want)),
                                        "version %d, %s: not the expected slice" % (version, k))
            # Versions 3 and 4 lie where 1 and 2 did (the trainers' double buffers, or the
            # dedicated slabs their copies are kept in): nothing imported.
            self.assertEqual(c.slab_maps, maps)
            for plan in plans:
                info = plan.info()
                self.assertEqual(info["plans"], 1, info)
                self.assertGreaterEqual(info["refits"], 4, info)
                plan.close()
        finally:
            c.close()
            trainers.close()

    def test_fsdp_copied_into_tp_1_2_4(self):
        self.refit_tp("copy", "copy")

    def test_fsdp_in_place_into_tp_1_2_4(self):
        self.refit_tp("inplace", "inplace")

    @unittest.skipUnless(transformers is not None, "transformers is not installed")
    def test_cuda_graph_kept(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=FF,
                          num_hidden_layers=LAYERS, num_attention_heads=NH,
                          num_key_value_heads=NKV, max_position_embeddings=128,
                          tie_word_embeddings=False, attn_implementation="sdpa")
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to("cuda:0", torch.bfloat16).eval()
        eager = LlamaForCausalLM(cfg).to("cuda:0", torch.bfloat16).eval()
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        params = dict(model.named_parameters())
        self.assertEqual(set(params), set(shapes))
        trainers = Trainers(self.socket, shapes, 2, "copy", "policy-graph")
        c = gpupool.Client(self.socket, name="engine-graph")
        captures = [0]
        orig_begin = torch.cuda.CUDAGraph.capture_begin

        def counting_begin(self_, *a, **kw):
            captures[0] += 1
            return orig_begin(self_, *a, **kw)

        torch.cuda.CUDAGraph.capture_begin = counting_begin
        try:
            ids = torch.randint(0, VOCAB, (2, 16), device="cuda:0")
            stream = torch.cuda.Stream()
            with torch.no_grad():
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        model(input_ids=ids, use_cache=False)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = model(input_ids=ids, use_cache=False).logits
            self.assertEqual(captures[0], 1)
            ptrs = {k: p.data_ptr() for k, p in params.items()}
            self.assertEqual(trainers.publish(1), 1)
            plan = c.refit_plan("policy-graph", {k: (p.detach(), [k]) for k, p in params.items()})
            refit_stream = torch.cuda.Stream()
            for version in range(1, 4):
                if version > 1:
                    self.assertEqual(trainers.publish(version), 1)
                self.assertEqual(plan.refit(newer_than=version - 1, timeout=30, stream=refit_stream),
                                 version)
                torch.cuda.current_stream().wait_stream(refit_stream)
                graph.replay()
                got = out.clone()
                w = version_weights(shapes, version)
                with torch.no_grad():
                    eager.load_state_dict(w)
                    want = eager(input_ids=ids, use_cache=False).logits
                torch.cuda.synchronize()
                for k, p in params.items():
                    self.assertEqual(p.data_ptr(), ptrs[k], k)
                    self.assertTrue(torch.equal(bits(p.detach()), bits(w[k])),
                                    "version %d, %s" % (version, k))
                self.assertTrue(torch.equal(bits(got), bits(want)),
                                "version %d: graph logits differ from the eager model's (max %g)"
                                % (version, (got.float() - want.float()).abs().max().item()))
            self.assertEqual(captures[0], 1, "a graph was captured again")
            self.assertEqual(plan.info()["plans"], 1)
            plan.close()
        finally:
            torch.cuda.CUDAGraph.capture_begin = orig_begin
            c.close()
            trainers.close()

    def test_gather_any_alignment(self):
        """Copies at every alignment and size the gather kernel's paths meet (1 byte to wider
        than a block's chunk, rows of 1 byte to 200 KB, odd pitches), through the kernel and
        one cudaMemcpy2DAsync each, both bit-exact."""
        g = torch.Generator().manual_seed(7)
        src = {"a": (1,), "b": (3,), "c": (17,), "d": (131072 + 5,), "e": (300000,), "f": (37, 129),
               "h": (5, 300000), "i": (1000, 2)}
        cpu = {k: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) for k, shape in src.items()}
        c = gpupool.Client(self.socket, name="gather")
        try:
            c.publish_shard("gather", {k: (t.cuda(), (), tuple(t.shape)) for k, t in cpu.items()},
                            rank=0, world=1, version=1)
            big = torch.zeros(4 << 20, dtype=torch.uint8, device="cuda:0")
            at = [1]

            def view(shape, stride=None):
                """A target at an odd address of big (rows `stride` apart when given)."""
                n = shape[0] if len(shape) == 1 else (shape[0] - 1) * stride + shape[1]
                off = at[0]
                at[0] += n + 3
                if len(shape) == 1:
                    return big[off:off + n]
                return big[off:].as_strided(shape, (stride, 1))

            targets, want = {}, {}
            for k in "abcde":
                t = view(src[k])
                targets[k], want[k] = (t, [k]), cpu[k]
            # 2D: a column slice into rows of an odd pitch; rows wider than a block's chunk.
            targets["f"] = (view((37, 64), 201), [("f", (slice(None), slice(3, 67)))], 1)
            want["f"] = cpu["f"][:, 3:67]
            targets["h"] = (view((5, 200001), 300003), [("h", (slice(None), slice(7, 200008)))], 1)
            want["h"] = cpu["h"][:, 7:200008]
            targets["i"] = (view((1000, 1), 3), [("i", (slice(None), slice(1, 2)))], 1)
            want["i"] = cpu["i"][:, 1:2]
            plan = c.refit_plan("gather", targets)
            stream = torch.cuda.Stream()
            for one_by_one in (False, True):
                big.zero_()
                if one_by_one:
                    os.environ["GPUPOOL_REFIT_GATHER"] = "0"
                try:
                    plan.refit(newer_than=0, timeout=30, stream=stream)
                finally:
                    os.environ.pop("GPUPOOL_REFIT_GATHER", None)
                stream.synchronize()
                info = plan.info()
                self.assertEqual(info["gathered"], 0 if one_by_one else info["copies"], info)
                for k, (t, _, *rest) in targets.items():
                    self.assertTrue(torch.equal(t.cpu(), want[k]), "%s (%s)" % (
                        k, "one by one" if one_by_one else "gather kernel"))
                # Nothing outside the targets was written.
                self.assertEqual(int(big.to(torch.int64).sum().item()),
                                 sum(int(w.to(torch.int64).sum().item()) for w in want.values()))
            plan.close()
        finally:
            c.close()

    def test_casts_in_device_memory(self):
        """A version in one dtype refitted into device targets of another: float32 into bfloat16
        and float16 (a column slice, rows of an odd pitch), bfloat16 and float16 into float32,
        bit-equal to torch's own casts (special values included); across the kernel's chunks."""
        g = torch.Generator().manual_seed(11)
        base = torch.randn(300, 257, generator=g) * 100
        special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 1e-6, 6e-8,
                                65504.0, 65520.0, 70000.0, 3.0e38, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -9])
        base[0, :special.numel()] = special
        big = torch.randn(40000, generator=g)  # one row longer than a block's cast chunk
        src = {"w": base, "b": base.to(torch.bfloat16), "h": base.clamp(-60000, 60000).to(torch.float16),
               "big": big}
        c = gpupool.Client(self.socket, name="casts")
        try:
            c.publish_shard("casts", {k: (t.cuda(), (), tuple(t.shape)) for k, t in src.items()},
                            rank=0, world=1, version=1)
            wide_bf = torch.zeros(300, 300, dtype=torch.bfloat16, device="cuda:0")
            targets = {
                "w->bf16": (wide_bf[:, 5:205], [("w", (slice(None), slice(17, 217)))], 1),
                "w->f16": (torch.zeros(300, 257, dtype=torch.float16, device="cuda:0"), ["w"]),
                "b->f32": (torch.zeros(300, 257, dtype=torch.float32, device="cuda:0"), ["b"]),
                "h->f32": (torch.zeros(300, 257, dtype=torch.float32, device="cuda:0"), ["h"]),
                "big->bf16": (torch.zeros(40000, dtype=torch.bfloat16, device="cuda:0"), ["big"]),
            }
            want = {"w->bf16": base[:, 17:217].to(torch.bfloat16), "w->f16": base.to(torch.float16),
                    "b->f32": src["b"].to(torch.float32), "h->f32": src["h"].to(torch.float32),
                    "big->bf16": big.to(torch.bfloat16)}
            plan = c.refit_plan("casts", targets)
            stream = torch.cuda.Stream()
            plan.refit(newer_than=0, timeout=30, stream=stream)
            stream.synchronize()
            info = plan.info()
            self.assertEqual(info["cast_copies"], info["copies"], info)
            self.assertEqual(info["gathered"], info["copies"], info)
            for k, (t, *_) in targets.items():
                got, exp = t.cpu(), want[k]
                ib = torch.int16 if got.element_size() == 2 else torch.int32
                self.assertTrue(torch.equal(got.view(ib), exp.view(ib)),
                                "%s: %d elements differ from torch's cast" % (k, int((got.view(ib) != exp.view(ib)).sum())))
            self.assertTrue(torch.equal(wide_bf[:, :5].cpu().view(torch.int16), torch.zeros(300, 5, dtype=torch.int16)))
            # Without the kernel a device cast is refused before anything is queued.
            os.environ["GPUPOOL_REFIT_GATHER"] = "0"
            try:
                with self.assertRaises(gpupool.GpupoolError) as cm:
                    plan.refit(newer_than=0, timeout=30, stream=stream)
                self.assertIn("gather kernel", str(cm.exception))
            finally:
                os.environ.pop("GPUPOOL_REFIT_GATHER", None)
            plan.close()
        finally:
            c.close()


if __name__ == "__main__":
    unittest.main()
