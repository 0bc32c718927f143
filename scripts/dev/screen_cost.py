"""Dev measurement: what screening a row of logits for NaN/Inf costs on the CPU (one torch
thread, as the CPU engine runs torch): screen_logits alone, then the stream's sampler
(ScreenedSampler) against the plain Sampler on the same logits, greedy and top-k, in turn within
each repetition; a Qwen3.5-sized vocabulary. Median (min-max) over the repetitions.

    python scripts/dev/screen_cost.py [--vocab 248320] [--calls 2000] [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--vocab", type=int, default=248320)
ap.add_argument("--calls", type=int, default=2000)
ap.add_argument("--reps", type=int, default=5)
a = ap.parse_args()

import torch  # noqa: E402  (after the arguments: --help needs no torch)

from moe_offload.gen import Sampler, SamplingParams, ScreenedSampler, screen_logits  # noqa: E402

torch.set_num_threads(1)
x = torch.randn(1, a.vocab, generator=torch.Generator().manual_seed(0))
alone = []
for _ in range(a.reps):
    t0 = time.perf_counter()
    for _ in range(a.calls):
        screen_logits(x)
    alone.append((time.perf_counter() - t0) / a.calls * 1e6)
print(f"screen_logits alone: {statistics.median(alone):.0f} us ({min(alone):.0f}-{max(alone):.0f})")
for name, params in (("greedy", SamplingParams(temperature=0)), ("top-k 40", SamplingParams(seed=1))):
    per = {"plain": [], "screened": []}
    for _ in range(a.reps):                       # the two in turn within each repetition
        for kind, cls in (("plain", Sampler), ("screened", ScreenedSampler)):
            s = cls(params, "cpu")
            s(x)
            t0 = time.perf_counter()
            for _ in range(a.calls):
                s(x)
            per[kind].append((time.perf_counter() - t0) / a.calls * 1e6)
    p, q = statistics.median(per["plain"]), statistics.median(per["screened"])
    print(f"{name}: plain {p:.0f} us ({min(per['plain']):.0f}-{max(per['plain']):.0f}), screened "
          f"{q:.0f} us ({min(per['screened']):.0f}-{max(per['screened']):.0f}): +{q - p:.0f} us a token")
