"""GPU time of a decode matmul (native._cuda.matmul) against the tokens it carries, at the
35B-A3B's dense shapes, so a change to the rows engine's per-token work is measured by itself.

    python scripts/dev/matmul_tokens_bench.py [--type IQ3_S] [--tokens 1,2,3,4,8] [--json F]

Random blocks of the type; each shape is held in enough copies to pass 256 MB, and --calls calls
cycling through the copies are captured in one CUDA graph, so every call reads its weights from
DRAM, not L2: us per call = replay time / calls, median of --reps replays (min-max beside it).
Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics

# (input features H, output features O): the 35B-A3B's dense products and its output head
SHAPES = {"2048x8192": (2048, 8192), "2048x12288": (2048, 12288), "4096x2048": (4096, 2048),
          "2048x512": (2048, 512), "2048x248320": (2048, 248320)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", default="IQ3_S")
    ap.add_argument("--tokens", default="1,2,3,4,8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    import numpy as np
    import torch

    import native._cuda as ext
    from loaders.quants import quant_type, random_tensor
    importlib.import_module("native.ops")   # hands the IQ tables to the extension
    q = quant_type(args.type)
    rng = np.random.default_rng(0)
    rows = []
    for name in args.shapes.split(","):
        H, O = SHAPES[name]
        one = torch.from_numpy(random_tensor(q, (O, H), rng)).cuda()
        copies = [one] + [one.clone() for _ in range(max(0, -(-(256 << 20) // one.numel()) - 1))]
        stride = one.shape[1]
        for T in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(T, H, device="cuda")
            y = torch.empty(T, O, device="cuda")

            def calls():
                st = torch.cuda.current_stream().cuda_stream
                for i in range(args.calls):
                    w = copies[i % len(copies)]
                    ext.matmul(q.type_id, w.data_ptr(), O, H, stride, x.data_ptr(), T, y.data_ptr(), st)
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
            us = statistics.median(times)
            rows.append(dict(shape=name, tokens=T, us_per_call=us, us_spread=[min(times), max(times)],
                             gbps=one.numel() / us / 1e3))
            print(f"{name:12s} T={T}  {us:8.2f} us/call ({min(times):.2f}-{max(times):.2f})  "
                  f"{one.numel() / us / 1e3:6.0f} GB/s", flush=True)
        copies.clear()   # the next shape's copies in their place
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(type=args.type, calls=args.calls, reps=args.reps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
