"""A/B of the prefill GEMMs' operand type inside one offload runtime (same process, same machine):
bf16 (the former default) against f16 with per-row scaling, for the dense projections and for the
grouped expert GEMMs.

    python scripts/dev/prefill_ab.py MODEL [--vram 8GiB] [--tokens 2048] [--steps 64] [--rounds 4]

Each round, per variant: a fresh conversation of `--tokens` random tokens prefilled, then
`--steps` greedy decode steps after it (the decode kernels do not depend on the variant; timed
to show that the cache's refill after each prompt is the same). One untimed round first.
Prints each variant's median prefill and decode tok/s and every round.
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
ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--variants", default=",".join(VARIANTS))
args = ap.parse_args()

loaded = open_model(args.model)
c = loaded.config
rt = open_runtime(loaded, args.vram)
gen = torch.Generator().manual_seed(0)
names = args.variants.split(",")


def one_round(name: str) -> tuple[float, float]:
    ops.PREFILL_DTYPE, ops.PREFILL_MOE_DTYPE = VARIANTS[name]
    toks = torch.randint(0, c.n_vocab, (1, args.tokens), generator=gen).cuda()
    st = rt.new_state(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tok = rt.prefill(toks, st).argmax(-1)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(args.steps):
        tok = rt.decode(tok, st).argmax(-1)
    torch.cuda.synchronize()
    return args.tokens / (t1 - t0), args.steps / (time.perf_counter() - t1)


for name in names:
    one_round(name)
runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
for r in range(args.rounds):
    for name in names:
        runs[name].append(one_round(name))
for name in names:
    pp, tg = [r[0] for r in runs[name]], [r[1] for r in runs[name]]
    print(f"{name:12s} pp{args.tokens} median {statistics.median(pp):7.1f} tok/s "
          f"(rounds {' '.join(f'{v:.0f}' for v in pp)})  tg{args.steps} after it median "
          f"{statistics.median(tg):6.1f} tok/s (rounds {' '.join(f'{v:.1f}' for v in tg)})")
