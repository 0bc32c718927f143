"""Dev measurement on a GPU: decode-size kernels of the rows engine against the fewest chunks a
warp streams (native._cuda.set_rows_min_chunks; fewer, longer-lived CTAs), on a model's real
blocks: the expert FFN of layer 0 (T=1, K=8, all eight in the pool and two of eight), and the
matvecs of layer 0's dense weights and the head.

    python scripts/dev/rows_sweep.py MODEL [--values 1,2,4,8,16,32] [--reps 200]
"""
import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--values", default="1,2,4,8,16,32")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    import torch
    from loaders import open_model
    from native import ops
    import native._cuda as cuda_ext
    from native.ops import QTensor
    m = open_model(args.model)
    W = m.weights
    dev = "cuda"
    bank = {k: QTensor.from_weight(W[f"blk.0.ffn_{k}_exps.weight"], dev) for k in ("gate", "up", "down")}
    E, F, H = bank["gate"].shape
    cases = {}
    x = torch.randn(1, H, device=dev)
    ids8 = torch.randperm(E, device=dev)[:8].view(1, 8).int()
    w8 = torch.full((1, 8), 0.125, device=dev)
    cases["expert ffn K=8"] = lambda: ops.moe_ffn(x, bank["gate"], bank["up"], bank["down"], ids8, w8)
    ids2 = ids8.clone()
    ids2[0, 2:] = -1
    cases["expert ffn 2 of 8"] = lambda: ops.moe_ffn(x, bank["gate"], bank["up"], bank["down"], ids2, w8)
    dense = [n for n in W if n.startswith("blk.0.") and "exps" not in n and W[n].qtype.name not in ("F32", "F16")
             and len(W[n].shape) == 2 and W[n].shape[0] > 1]
    for n in dense[:4] + ["output.weight"]:
        q = QTensor.from_weight(W[n], dev)
        xi = torch.randn(1, q.shape[-1], device=dev)
        cases[f"{n} {q.qtype.name} {list(q.shape)}"] = (lambda q=q, xi=xi: ops.matmul(xi, q))
    vals = [int(v) for v in args.values.split(",")]
    res = {c: {} for c in cases}
    N = 20   # calls a graph: replays time the GPU, not Python's launches
    for rnd in range(2):   # the second pass is the measurement (first: kernels loaded, clocks up)
        for v in vals:
            cuda_ext.set_rows_min_chunks(v)
            for c, fn in cases.items():
                fn()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(N):
                        fn()
                g.replay()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
                for _ in range(args.reps // N):
                    g.replay()
                b.record()
                b.synchronize()
                res[c][v] = a.elapsed_time(b) / (args.reps // N * N) * 1e3
                del g
    print("us per call (graph replays) by the fewest chunks a warp streams: " + ", ".join(map(str, vals)))
    for c, r in res.items():
        print(f"  {c[:60]:60s} " + " ".join(f"{r[v]:7.1f}" for v in vals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
