"""Time one decode step's attention (qwen35moe's shape: 16 query heads over 2 kv heads of 256) at
long contexts, for each KV type. On a GPU the kernel (ops.cuda_attention_step) in each form: the
tensor-core group kernel (the default for f16, q8_0 and q4_0), the FFMA group kernel
(FTPATCH_ATTENTION_GROUPED=1), its half-group form (=2) and the per-head kernel (=0):
microseconds a call (median of --reps, CUDA events) and the KV bytes it reads a second. One
layer's call; a 35B-A3B token makes 10.

    python scripts/dev/attention_bench.py --ctx 4096,65536,131072 --kv f16,q8_0

--prefill T: a prompt chunk of T tokens ending at each context (attention_tiled over the cache
in tiles, one layer), with each tile's softmax update as one kernel and as the torch ops
(FTPATCH_SOFTMAX_TILE=0): milliseconds a call and the largest difference of the outputs.

    python scripts/dev/attention_bench.py --prefill 2048 --ctx 65536,131072 --kv q8_0 --reps 5

--cpu: the CPU's attention core (ops.cpu_attention, one token) over the cache as stored and over
an f32 copy of it, milliseconds a call (mean of --reps).

    python scripts/dev/attention_bench.py --cpu --ctx 32768 --kv f32,f16,q8_0,q4_0 --reps 5
"""
from __future__ import annotations

import argparse
import json
import os


def time_call(fn, reps: int) -> float:
    import torch
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", default="4096,16384,65536,131072", help="positions attended")
    ap.add_argument("--kv", default="f16,q8_0,q4_0", help="KV types")
    ap.add_argument("--heads", default="16,2,256", help="query heads, kv heads, head dim")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--cpu", action="store_true", help="the CPU's attention core, not the GPU kernel")
    ap.add_argument("--prefill", type=int, default=0, metavar="T",
                    help="time a T-token prompt chunk's tiled attention instead of a decode step")
    ap.add_argument("--tiles", default="", help="with --prefill: cache rows a tile, comma "
                    "separated (default: the prefill settings' choice)")
    a = ap.parse_args()
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    import torch

    from native import ops
    from native.kv_cache import KV_TYPES
    if a.cpu:
        return cpu_main(a, hq, hkv, d)
    if a.prefill:
        return prefill_main(a, hq, hkv, d)
    g = torch.Generator("cuda").manual_seed(0)
    qg = torch.randn(1, hq * 2 * d, generator=g, device="cuda")
    k, v = (torch.randn(1, hkv * d, generator=g, device="cuda") for _ in range(2))
    q_norm, k_norm = (torch.ones(d, device="cuda") for _ in range(2))
    for kv in a.kv.split(","):
        t = KV_TYPES[kv]
        for n in (int(x) for x in a.ctx.split(",")):
            kc, vc = (t.quantize(torch.randn(1, n, hkv, d, generator=g, device="cuda"))
                      for _ in range(2))
            pos = torch.tensor(n - 1, device="cuda")
            row = {"kv": kv, "ctx": n}
            outs = {}
            for name, env in (("mma", "3"), ("half_group", "2"), ("group", "1"), ("per_head", "0")):
                os.environ["FTPATCH_ATTENTION_GROUPED"] = env
                def call(kc=kc, vc=vc, pos=pos, n=n):
                    return ops.cuda_attention_step(qg, k, v, q_norm, k_norm, 1e-6, pos, 64, 1e7,
                                                   kc, vc, hq, n)
                us = time_call(call, a.reps)
                outs[name] = call()
                row[f"{name}_us"] = round(us, 1)
                row[f"{name}_GBps"] = round(2 * kc.numel() * kc.element_size() / us / 1e3, 1)
            os.environ.pop("FTPATCH_ATTENTION_GROUPED")
            row["max_diff"] = max(float((outs[n] - outs["per_head"]).abs().max()) for n in outs)
            print(json.dumps(row), flush=True)
            del kc, vc


def prefill_main(a, hq: int, hkv: int, d: int) -> None:
    import torch

    from moe_offload.instrument import switches
    from moe_offload.models import attention_tiled
    from native.kv_cache import KV_TYPES
    g = torch.Generator("cuda").manual_seed(0)
    T = a.prefill
    q = torch.randn(1, T, hq, d, generator=g, device="cuda")
    for kv in a.kv.split(","):
        t = KV_TYPES[kv]
        for n in (int(x) for x in a.ctx.split(",")):
            kc, vc = (t.quantize(torch.randn(1, n, hkv, d, generator=g, device="cuda"))
                      for _ in range(2))
            pos = torch.arange(n - T, n, device="cuda")
            for tile in [int(x) for x in a.tiles.split(",") if x] or [None]:
                row = {"kv": kv, "ctx": n, "chunk": T, "tile": tile or "default"}
                outs = {}
                for name, on in (("fused", True), ("torch_ops", False)):
                    switches.SOFTMAX_TILE = on
                    def call(kc=kc, vc=vc, pos=pos, n=n, tile=tile):
                        return attention_tiled(q, kc, vc, pos, n, tile=tile, first=n - T)
                    row[f"{name}_ms"] = round(time_call(call, a.reps) / 1e3, 2)
                    outs[name] = call()
                switches.SOFTMAX_TILE = True
                row["max_diff"] = float((outs["fused"] - outs["torch_ops"]).abs().max())
                print(json.dumps(row), flush=True)
            del kc, vc


def cpu_main(a, hq: int, hkv: int, d: int) -> None:
    import time

    import torch

    from native import ops
    from native.kv_cache import KV_TYPES
    g = torch.Generator().manual_seed(0)
    q, gate = (torch.randn(1, hq, d, generator=g) for _ in range(2))
    for kv in a.kv.split(","):
        t = KV_TYPES[kv]
        for n in (int(x) for x in a.ctx.split(",")):
            kc, vc = (t.quantize(torch.randn(n, hkv, d, generator=g)) for _ in range(2))
            row = {"kv": kv, "ctx": n, "threads": torch.get_num_threads()}
            for name, caches in (("as_stored", (kc, vc)), ("f32_copy", (t.dequantize(kc, d), t.dequantize(vc, d)))):
                call = lambda: ops.cpu_attention(q, gate, *caches, n, n - 1)  # noqa: E731
                call()
                t0 = time.perf_counter()
                for _ in range(a.reps):
                    call()
                row[f"{name}_ms"] = round((time.perf_counter() - t0) / a.reps * 1e3, 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
