"""A/B of the prefill GEMMs' operand type inside one offload runtime (same process, same machine):
bf16 (the former default) against f16 with per-row scaling, for the dense projections and for the
grouped expert GEMMs.

    python scripts/dev/prefill_ab.py MODEL [--vram 8GiB] [--tokens 2048] [--rounds 4]

Each round prefills a fresh conversation of `--tokens` random tokens once per variant (one untimed
prefill per variant first). Prints each variant's median tok/s and every round.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from freetoken_patch.cli.model_args import size_arg
from loaders import open_model
from moe_offload import open_runtime
from native import ops

VARIANTS = {"bf16": (torch.bfloat16, torch.bfloat16), "f16": (torch.float16, torch.bfloat16),
            "f16+moe-f16": (torch.float16, torch.float16)}

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--vram", type=size_arg, default="8GiB")
ap.add_argument("--tokens", type=int, default=2048)
ap.add_argument("--rounds", type=int, default=4)
ap.add_argument("--variants", default=",".join(VARIANTS))
args = ap.parse_args()

loaded = open_model(args.model)
c = loaded.config
rt = open_runtime(loaded, args.vram)
gen = torch.Generator().manual_seed(0)
names = args.variants.split(",")


def prefill(name: str) -> float:
    ops.PREFILL_DTYPE, ops.PREFILL_MOE_DTYPE = VARIANTS[name]
    toks = torch.randint(0, c.n_vocab, (1, args.tokens), generator=gen).cuda()
    st = rt.new_state(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rt.prefill(toks, st)
    torch.cuda.synchronize()
    return args.tokens / (time.perf_counter() - t0)


for name in names:
    prefill(name)
runs: dict[str, list[float]] = {n: [] for n in names}
for r in range(args.rounds):
    for name in names:
        runs[name].append(prefill(name))
for name in names:
    print(f"{name:12s} pp{args.tokens} median {statistics.median(runs[name]):8.1f} tok/s  "
          f"rounds {' '.join(f'{v:.0f}' for v in runs[name])}")
