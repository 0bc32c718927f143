"""Where a decode step's time goes under a VRAM cap: a kernel timeline of 8 graph replays.

    python scripts/dev/offload_timeline.py MODEL [--vram 8GiB] [--prefetch-k N] [--fetch-blocks N]
                                           [--trace] [--no-overlap]

Prints tok/s over 64 steps without the profiler (an A/B of the options on one machine), tok/s
of the profiled steps, then per token: GPU kernel time by kind (fetch = PCIe copies
into the cache, wait = the spin for the CPU's share, compute = everything else), and how the wall
time splits into link-only, compute-only, both, and neither (idle: launch gaps, event waits).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from freetoken_patch.cli.model_args import size_arg
from loaders import open_model
from moe_offload import OffloadPolicy, open_runtime
from moe_offload.instrument.trace import TraceParams, make_trace

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--vram", type=size_arg, default="8GiB")
ap.add_argument("--prefetch-k", type=int, default=None)
ap.add_argument("--fetch-blocks", type=int, default=None, help="grid of a PCIe copy (default: the policy's)")
ap.add_argument("--trace", action="store_true")
ap.add_argument("--no-overlap", action="store_true", help="fetch misses before any expert computes")
ap.add_argument("--depths", default=None, help="comma list of decode steps in flight to A/B "
                "(0: wait for each step's CPU work before launching the next, as decode did "
                "before steps were queued), 64 steps each, --rounds times")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--cpu-threads", type=int, default=None)
ap.add_argument("--events", default=None, help="write the profiled kernels (name, stream, start, "
                "length in us) to this JSON file, for a per-layer look offline")
args = ap.parse_args()

loaded = open_model(args.model)
c = loaded.config
policy = OffloadPolicy().with_(prefetch_k=args.prefetch_k, overlap_misses=not args.no_overlap,
                               fetch_blocks=args.fetch_blocks)
rt = open_runtime(loaded, args.vram, policy=policy, cpu_threads=args.cpu_threads)
if args.trace:
    rt.replay(make_trace(256, c.n_layer, c.n_expert, c.n_expert_used, TraceParams()))
st = rt.new_state(1)
tok = rt.prefill(torch.randint(0, c.n_vocab, (1, 16)).cuda(), st).argmax(-1)
for _ in range(48):
    tok = rt.decode(tok, st).argmax(-1)
torch.cuda.synchronize()

def run64(depth: int) -> float:
    global tok
    rt.engine.max_in_flight = max(1, depth)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(64):
        tok = rt.decode(tok, st).argmax(-1)
        if depth == 0:
            rt.engine.worker.wait_step()
    torch.cuda.synchronize()
    return 64 / (time.perf_counter() - t)


if args.depths:
    depths = [int(d) for d in args.depths.split(",")]
    got = {d: [] for d in depths}
    for _ in range(args.rounds):
        for d in depths:
            got[d].append(run64(d))
    print("steps in flight A/B (tok/s, 64 steps each): " + "; ".join(
        f"{d}: {sorted(v)[len(v) // 2]:.1f} {[round(x, 1) for x in v]}" for d, v in got.items()))
t = time.perf_counter()
for _ in range(64):
    tok = rt.decode(tok, st).argmax(-1)
torch.cuda.synchronize()
print(f"{64 / (time.perf_counter() - t):.1f} tok/s over 64 steps, not profiled")
# where the cap went, decoding: nvidia-smi's process figure against what we can name
MiB = 1 << 20
smi = rt.smi.sample() or 0
reserved = torch.cuda.memory_reserved()
kv = rt._kv_mapped()
named = reserved + rt.cache.nbytes + kv
print(f"VRAM decoding (MiB): nvidia-smi {smi / MiB:.0f} (peak {(rt.smi.peak_bytes or 0) / MiB:.0f}, "
      f"cap {args.vram / MiB:.0f}); torch reserved {reserved / MiB:.0f} (allocated "
      f"{torch.cuda.memory_allocated() / MiB:.0f}, staging {rt.engine.staging_bytes / MiB:.0f}), "
      f"expert cache {rt.cache.nbytes / MiB:.0f}, KV mapped {kv / MiB:.0f}; the rest "
      f"{(smi - named) / MiB:.0f} (budgeted for context + libraries: {rt._outside / MiB:.0f})")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

N = 8
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    t = time.perf_counter()
    for _ in range(N):
        tok = rt.decode(tok, st).argmax(-1)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
path = tempfile.mktemp(suffix=".json")
prof.export_chrome_trace(path)
ev = [e for e in json.load(open(path))["traceEvents"]
      if e.get("cat") == "kernel" and e.get("ph") == "X"]


def kind(name: str) -> str:
    n = name.lower()
    return "fetch" if "fetch_kernel" in n else "wait" if "wait_add" in n else "compute"


def union(spans):
    spans = sorted(spans)
    out, cur = [], None
    for a, b in spans:
        if cur and a <= cur[1]:
            cur[1] = max(cur[1], b)
        else:
            cur = [a, b]
            out.append(cur)
    return out


def length(spans):
    return sum(b - a for a, b in spans)


def inter(x, y):
    i = j = 0
    out = []
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


if args.events:
    t0 = min(e["ts"] for e in ev)
    json.dump([(e["name"][:60], e.get("tid"), round(e["ts"] - t0, 2), round(e["dur"], 2))
               for e in sorted(ev, key=lambda e: e["ts"])], open(args.events, "w"))
by = {k: union([(e["ts"], e["ts"] + e["dur"]) for e in ev if kind(e["name"]) == k])
      for k in ("fetch", "wait", "compute")}
span = max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)
both = length(inter(by["fetch"], by["compute"]))
busy = length(union([(e["ts"], e["ts"] + e["dur"]) for e in ev]))
s = rt.stats().as_dict()
print(f"{args.vram / 2**30:.0f} GiB, {'trace' if args.trace else 'model routing'}, "
      f"{rt.cache.slots[0]} slots a layer: {N / wall:.1f} tok/s while profiled; "
      f"kernel span {span / N / 1e3:.2f} ms a token")
print(f"  kernel time a token: fetch {sum(e['dur'] for e in ev if kind(e['name']) == 'fetch') / N / 1e3:.2f} ms, "
      f"wait {sum(e['dur'] for e in ev if kind(e['name']) == 'wait') / N / 1e3:.2f} ms, "
      f"compute {sum(e['dur'] for e in ev if kind(e['name']) == 'compute') / N / 1e3:.2f} ms "
      f"({len(ev) / N:.0f} kernels)")
print(f"  wall a token: link only {(length(by['fetch']) - both) / N / 1e3:.2f} ms, compute only "
      f"{(length(by['compute']) - both) / N / 1e3:.2f} ms, both {both / N / 1e3:.2f} ms, "
      f"no kernel running {(span - busy) / N / 1e3:.2f} ms")
top: dict[str, float] = {}
for e in ev:
    top[e["name"][:70]] = top.get(e["name"][:70], 0.0) + e["dur"]
for name, us in sorted(top.items(), key=lambda kv: -kv[1])[:12]:
    print(f"  {us / N:8.1f} us/token  {name}")
print(f"  cache: hit rate {s['hit_rate']:.1%}, fetched {s['fetched']} prefetched {s['prefetched']} cpu {s['cpu']}")
rt.close()
