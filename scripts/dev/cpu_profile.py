"""Where a CPU-only decode step and prefill spend their time, per op family.

    python scripts/dev/cpu_profile.py MODEL.gguf [--tokens 8] [--prompt 64] [--threads N]

Wraps native.ops.matmul / matmul_many / moe_ffn (and the model's head call) with wall-clock timers and sorts
each call into a family by the weight's name: expert FFN (routed), shared expert, router, mixer
projections (attention + delta-net in/out), head; "other" is the rest of the step (norms,
attention and delta-net cores, routing, Python). Prints ms per token for decode and prefill, and
for decode the weight bytes each family reads a token, their rate, and the host's read bandwidth
(a float32 torch.sum over 1 GiB on the same threads) as the bound.
"""
from __future__ import annotations

import argparse
import collections
import time

import torch


def family(name: str) -> str:
    if "ffn_gate_inp" in name and "ffn_up_shexp" in name:   # one matmul_many on the CPU
        return "router + shared gate|up"
    if "shexp" in name:
        return "shared expert"
    if "ffn_gate_inp" in name:
        return "router"
    if name.startswith("output") or name.startswith("token_embd"):
        return "head"
    return "mixer projections"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=8, help="decode steps timed")
    ap.add_argument("--prompt", type=int, default=64, help="prefill tokens timed")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch's own (default 1, as run/bench on the CPU: the pool owns the cores)")
    ap.add_argument("--torch-steps", action="store_true",
                    help="norms, routing and the delta-net in torch (layers.STEP_KERNELS = False)")
    args = ap.parse_args()

    from loaders import open_model
    from moe_offload.models import build_model
    from native import ops
    if args.threads:
        ops._cpu.set_threads(args.threads)
    torch.set_num_threads(args.torch_threads)
    loaded = open_model(args.model)
    model = build_model(loaded, "cpu")
    from moe_offload.models import cpu_plan as decode_loop
    decode_loop.ENABLED = False   # the per-op path: the native decode loop has no op calls to time
    if args.torch_steps:
        from moe_offload.models import layers
        layers.STEP_KERNELS = False
    spent: dict[str, float] = collections.defaultdict(float)
    read: dict[str, float] = collections.defaultdict(float)   # weight bytes
    mm, many, moe = ops.matmul, ops.matmul_many, ops.moe_ffn
    nbytes = lambda w: w.data.numel() * w.data.element_size()

    def timed_mm(x, w):
        t = time.perf_counter()
        y = mm(x, w)
        spent[family(w.name)] += time.perf_counter() - t
        read[family(w.name)] += nbytes(w)
        return y

    def timed_many(x, ws):
        t = time.perf_counter()
        y = many(x, ws)
        spent[family("+".join(w.name for w in ws))] += time.perf_counter() - t
        read[family("+".join(w.name for w in ws))] += sum(nbytes(w) for w in ws)
        return y

    def timed_moe(x, gate, up, down, ids, *a, **k):
        t = time.perf_counter()
        y = moe(x, gate, up, down, ids, *a, **k)
        spent["expert FFN"] += time.perf_counter() - t
        n_used = len(torch.unique(ids[ids >= 0]))   # each expert used is read once a call
        read["expert FFN"] += n_used * sum(nbytes(w) / w.shape[0] for w in (gate, up, down))
        return y

    ops.matmul, ops.matmul_many, ops.moe_ffn = timed_mm, timed_many, timed_moe
    from moe_offload.models import qwen35moe as arch
    cores = {"gated_delta_net": "delta-net core", "gated_attention": "attention core",
             "residual_rms_norm": "norms", "route_topk": "routing", "swiglu": "swiglu"}
    for fn, label in cores.items():
        def timed_core(*a, _f=getattr(arch, fn), _label=label, **k):
            t = time.perf_counter()
            y = _f(*a, **k)
            spent[_label] += time.perf_counter() - t
            return y
        setattr(arch, fn, timed_core)
    rng = torch.Generator().manual_seed(0)
    V = loaded.config.n_vocab
    with torch.inference_mode():
        for label, n_prompt, steps in (("prefill", args.prompt, 0), ("decode", 4, args.tokens)):
            st = model.new_state(1, n_prompt + steps + 1)
            toks = torch.randint(0, V, (1, n_prompt), generator=rng)
            spent.clear()
            t0 = time.perf_counter()
            logits = model.prefill(toks, st)
            if steps:
                spent.clear()
                read.clear()
                t0 = time.perf_counter()
                nxt = logits.argmax(-1)
                for _ in range(steps):
                    nxt = model.decode(nxt, st).argmax(-1)
            total = time.perf_counter() - t0
            n = steps or n_prompt
            spent["other"] = total - sum(spent.values())
            print(f"{label}: {n / total:.2f} tok/s ({total / n * 1e3:.1f} ms/token, threads "
                  f"{ops._cpu.threads()}, torch threads {torch.get_num_threads()}, isa "
                  f"{getattr(ops._cpu, 'isa', lambda: '?')()})")
            for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
                rate = f"  {read[k] / n / 1e6:7.1f} MB/token {read[k] / v / 1e9:6.1f} GB/s" \
                    if steps and read.get(k) else ""
                print(f"  {k:20s} {v / n * 1e3:8.2f} ms/token  {v / total:6.1%}{rate}")
            if steps:
                from freetoken_patch.cli.bench_kernels import host_read_gbps
                torch.set_num_threads(ops._cpu.threads())
                bw = host_read_gbps()
                torch.set_num_threads(args.torch_threads)
                mb = sum(read.values()) / n / 1e6
                print(f"  weights read: {mb:.0f} MB/token; host read bandwidth {bw:.1f} GB/s -> "
                      f"at most {bw * 1e3 / mb:.1f} tok/s if every byte came at that rate")


if __name__ == "__main__":
    main()
