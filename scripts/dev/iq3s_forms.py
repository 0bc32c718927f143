"""Dev benchmark: IQ3_S decode (T tokens) in each (ISA, grid form) of the CPU tables, and of its
repacked CPU form (grid form "n4": IQ3_S_N4, native.ops.repack_for_cpu), alternating call by call
in one process, so that a shared or throttling machine slows every form alike.

  python scripts/dev/iq3s_forms.py ROWS COLS [T=1] [FORMS=avx2:loads,avx2:gather,avx2:n4,...] [THREADS=1]

One random IQ3_S weight [ROWS, COLS] (in cache for small shapes: the decoder's own rate), 200
rounds, each form once a round (native._cpu.set_isa / set_iq3s_grid between calls); prints min and
median us and the GB/s at the median (of IQ3_S's bytes, and for n4 of the bytes it reads), then checks that every form gave the first form's bits.
"""
import argparse
import sys
import time

FORMS = "avx2:loads,avx2:gather,avx2:n4,avx512:loads,avx512:gather,avx512:n4"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("rows", type=int)
    ap.add_argument("cols", type=int, help="a multiple of 256")
    ap.add_argument("tokens", type=int, nargs="?", default=1)
    ap.add_argument("forms", nargs="?", default=FORMS,
                    help="ISA:GRID list (grid: loads, gather, or n4 for the repacked form); the "
                         "ISAs this CPU lacks are left out")
    ap.add_argument("threads", type=int, nargs="?", default=1)
    args = ap.parse_args()
    import numpy as np
    import torch

    import native._cpu as cpu_ext
    from loaders.quants import quant_type, random_blocks
    from native import ops
    q = quant_type("IQ3_S")
    rows, cols, nt, threads = args.rows, args.cols, args.tokens, args.threads
    forms = [tuple(f.split(":")) for f in args.forms.split(",")]
    forms = [f for f in forms if f[0] in cpu_ext.available_isas()]
    rng = np.random.default_rng(0)
    raw = random_blocks(q, rows * cols // q.block_elems, rng).reshape(rows, -1)
    w = ops.QTensor(torch.from_numpy(raw), q, (rows, cols))
    n4 = ops.repack_for_cpu(w)
    x = torch.randn(nt, cols)
    cpu_ext.set_threads(threads)
    times = {f: [] for f in forms}
    outs = {}
    before = cpu_ext.isa(), cpu_ext.iq3s_grid()
    try:
        with ops.cpu_threads_held(torch.device("cpu")):
            for _ in range(200):
                for f in forms:
                    cpu_ext.set_isa(f[0])
                    if f[1] != "n4":
                        cpu_ext.set_iq3s_grid(f[1])
                    t = time.perf_counter()
                    outs[f] = ops.matmul(x, n4 if f[1] == "n4" else w)
                    times[f].append(time.perf_counter() - t)
    finally:
        cpu_ext.set_isa(before[0])
        cpu_ext.set_iq3s_grid(before[1])
    for f in forms:
        a = np.array(times[f]) * 1e6
        print(f"IQ3_S {rows}x{cols} T={nt} threads={threads} {f[0]:6s} {f[1]:6s} min {a.min():7.0f} us  "
              f"median {np.median(a):7.0f} us  {w.data.numel() / np.median(a) / 1e3:5.2f} GB/s"
              + (f" ({n4.data.numel() / np.median(a) / 1e3:5.2f} of its own)" if f[1] == "n4" else ""))
    for f in forms[1:]:
        assert torch.equal(outs[f], outs[forms[0]]), f"{f} differs from {forms[0]}"
    print("every form gave the same bits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
