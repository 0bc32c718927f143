"""GPU time of one expert-pool call (native._cuda.moe_ffn_pool) against how many tokens it carries
and how many experts they share, with the kernels' split.

    python scripts/dev/moe_pool_bench.py [--type IQ3_S] [--tokens 1,2,3,4,8] [--calls 64] [--json F]

Qwen3.5-35B-A3B's shapes (256 experts, top-8, hidden 2048, expert ff 512), every expert resident
(slot = expert). Sharing regimes, per call: `distinct` (no expert named by two tokens), `half`
(each token after the first keeps 4 of token 0's experts), `same` (all tokens name token 0's 8).
--calls calls, each with its own random routing, are captured in one CUDA graph and replayed:
us per call = replay time / calls (median of --reps replays), plus the unique experts' bytes per
call over that time. A profiled replay splits the time by kernel (summed over the calls).
Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import tempfile

E, H, F, K = 256, 2048, 512, 8


def banks(q, rng) -> list:
    """gate, up, down banks [E, rows, row bytes] on the GPU: 8 MiB of random blocks, tiled."""
    import torch

    from loaders.quants import random_blocks
    pool = torch.from_numpy(random_blocks(q, max(1, (8 << 20) // q.block_bytes), rng).reshape(-1)).cuda()
    out = []
    for rows, cols in ((F, H), (F, H), (H, F)):
        rb = q.row_bytes(cols)
        n = E * rows * rb
        out.append(pool.repeat(-(-n // pool.numel()))[:n].view(E, rows, rb))
    return out


def routing(regime: str, T: int, rng):
    import numpy as np
    base = rng.permutation(E)[:K]
    rows = [base]
    for _ in range(1, T):
        if regime == "same":
            rows.append(base.copy())
            continue
        keep = base[:K // 2] if regime == "half" else np.array([], dtype=base.dtype)
        rest = rng.permutation(np.setdiff1d(np.arange(E), np.concatenate(rows)))[:K - len(keep)]
        rows.append(rng.permutation(np.concatenate([keep, rest])))
    return np.stack(rows).astype(np.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", default="IQ3_S")
    ap.add_argument("--tokens", default="1,2,3,4,8")
    ap.add_argument("--regimes", default="distinct,half,same")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    import native._cuda as ext
    from loaders.quants import quant_type
    importlib.import_module("native.ops")   # hands the IQ tables to the extension
    q = quant_type(args.type)
    rng = np.random.default_rng(0)
    bank = banks(q, rng)
    expert_bytes = sum(b[0].numel() for b in bank)
    bank_args = [v for b in bank for v in (q.type_id, b.data_ptr(), b[0].numel())]
    soe = torch.arange(E, dtype=torch.int32, device="cuda")
    rows = []
    for T in (int(v) for v in args.tokens.split(",")):
        scratch = torch.empty(ext.moe_scratch_bytes(T, K, F, H), dtype=torch.uint8, device="cuda")
        x = torch.randn(T, H, device="cuda")
        y = torch.empty(T, H, device="cuda")
        for regime in args.regimes.split(","):
            if T == 1 and regime != "distinct":
                continue
            ids = [routing(regime, T, rng) for _ in range(args.calls)]
            unique = statistics.mean(len(np.unique(r)) for r in ids)
            idd = torch.from_numpy(np.stack(ids)).cuda()
            wd = torch.softmax(torch.randn(args.calls, T, K), -1).cuda()

            def calls():
                st = torch.cuda.current_stream().cuda_stream
                for i in range(args.calls):
                    ext.moe_ffn_pool(x.data_ptr(), T, H, F, idd[i].data_ptr(), wd[i].data_ptr(), K,
                                     soe.data_ptr(), E, E, *bank_args, y.data_ptr(), 0,
                                     scratch.data_ptr(), scratch.numel(), st)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                calls()   # warm-up outside capture
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                calls()
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / args.calls)
            split: dict[str, float] = {}
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                g.replay()
                torch.cuda.synchronize()
            with tempfile.TemporaryDirectory() as tmp:
                prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
                with open(os.path.join(tmp, "trace.json")) as f:
                    events = json.load(f)["traceEvents"]
            for e in events:
                if e.get("cat") != "kernel" or e.get("ph") != "X":
                    continue
                key = next((k for k in ("group_kernel", "GateUpMap", "act_kernel", "DownMap",
                                        "sum_kernel") if k in e["name"]), "other")
                split[key] = split.get(key, 0.0) + e["dur"] / args.calls
            us = statistics.median(times)
            row = dict(tokens=T, regime=regime, unique_experts=unique, us_per_call=us,
                       us_spread=[min(times), max(times)],
                       unique_gbps=unique * expert_bytes / us / 1e3,
                       kernels_us={k: round(v, 2) for k, v in sorted(split.items())})
            rows.append(row)
            print(f"T={T} {regime:8s} unique {unique:5.1f}  {us:7.1f} us/call "
                  f"({min(times):.1f}-{max(times):.1f})  {row['unique_gbps']:6.0f} GB/s  "
                  + " ".join(f"{k} {v:.1f}" for k, v in row["kernels_us"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(type=args.type, expert_bytes=expert_bytes, calls=args.calls,
                           reps=args.reps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
