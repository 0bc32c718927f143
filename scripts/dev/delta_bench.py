"""Dev measurement on a GPU: the delta-net step kernel (native delta_rule_steps) at a model's
shapes for 1..4 tokens of one sequence, as a verify step runs it: one launch a layer, each layer
its own state and (T > 1) its own buffer of kept states, `--layers` launches captured in one CUDA
graph; us a launch, median of `--reps` replays. `--eager N` instead launches each T N times
without a graph (for ncu: --kernel-name regex:delta_step).

    python scripts/dev/delta_bench.py [--heads 16,32] [--dims 128,128] [--layers 30] [--reps 50]
"""
import argparse
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="16,32", help="key heads, value heads (35B-A3B: 16,32)")
    ap.add_argument("--dims", default="128,128", help="key head dim, value head dim")
    ap.add_argument("--tokens", default="1,2,3,4")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--eager", type=int, default=0)
    args = ap.parse_args()
    import torch
    from native import ops
    hk, hv = (int(v) for v in args.heads.split(","))
    dk, dv = (int(v) for v in args.dims.split(","))
    dev = "cuda"
    g = torch.Generator(dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=dev) * scale

    ssm_a, dt_bias, norm_w = -torch.rand(hv, generator=g, device=dev), rand(hv), rand(dv) * 0.1 + 1
    states = [rand(hv, dk, dv, scale=0.1) for _ in range(args.layers)]
    for T in (int(v) for v in args.tokens.split(",")):
        y = rand(T, 2 * hk * dk + hv * dv)
        z, beta, alpha = rand(T, hv * dv), rand(T, hv), rand(T, hv)
        keeps = [torch.empty(max(T - 1, 1), hv, dk, dv, device=dev) for _ in range(args.layers)]

        def run():
            for s, k in zip(states, keeps):
                ops.cuda_delta_rule_steps(y, z, beta, alpha, ssm_a, dt_bias, [s], norm_w, hk, 1e-6, T,
                                          keep=k if T > 1 else None)

        if args.eager:
            for _ in range(args.eager):
                run()
            torch.cuda.synchronize()
            print(f"T={T}: {args.eager} x {args.layers} eager launches")
            continue
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        times = []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / args.layers)
        print(f"T={T}: {statistics.median(times):.2f} us a launch (min {min(times):.2f}, "
              f"{args.layers} layers, hk={hk} hv={hv} dk={dk} dv={dv})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
