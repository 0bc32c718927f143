"""Dev benchmark: CPU expert FFN (native.ops.moe_ffn) and one matmul at T = 1, per thread count.
usage: cpu_expert_bench.py [TYPE=IQ3_S] [REPS=30]

moe_ffn: E = 16 experts, H = 2048, F = 512, K in {1, 2, 8}, a new random top-K per call;
GB/s = the K experts' gate + up + down bytes / median wall time. matmul: 2048x8192, copies
rotated past 3x 64 MiB (bench_kernels' Ring). The 16-expert banks (~22 MB at IQ3_S) fit in a
32 MiB L3, so these numbers are the kernel's compute rate more than DRAM's."""
import sys

import numpy as np
import torch

from freetoken_patch.cli.bench_kernels import HOST_CACHE, Ring, _pool, cpu_matmul, time_cpu_moe
from loaders.quants import quant_type
from native import ops

E, H, F = 16, 2048, 512
q = quant_type(sys.argv[1] if len(sys.argv) > 1 else "IQ3_S")
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
rng = np.random.default_rng(0)
pool = _pool(q, rng)
banks = [ops.QTensor(Ring(q, E * rows, cols, 0, "cpu", pool).view(0), q, (E, rows, cols))
         for rows, cols in ((F, H), (F, H), (H, F))]
expert_bytes = sum(b.nbytes // E for b in banks)
mm = Ring(q, 8192, 2048, 3 * HOST_CACHE, "cpu", pool)
x = torch.randn(1, H)

for threads in (1, 2):
    ops._cpu.set_threads(threads)
    for k in (1, 2, 8):
        t = time_cpu_moe(banks, x, E, k, reps, warmup=2)
        print(f"{q.name} moe_ffn threads={threads} K={k}: {t * 1e6:8.0f} us "
              f"{k * expert_bytes / t / 1e9:6.2f} GB/s")
    t = cpu_matmul(mm, 1, reps)
    print(f"{q.name} matmul 2048x8192 threads={threads}: {t * 1e6:8.0f} us {mm.bytes / t / 1e9:6.2f} GB/s")
