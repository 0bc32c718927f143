"""Where a prefill's time goes under a VRAM cap (dev measurement on a GPU).

    python scripts/dev/prefill_timeline.py MODEL [--vram 8GiB] [--tokens 2048] [--reps 3]

Prints tok/s of `--reps` unprofiled prefills of `--tokens` random tokens (each in a new
conversation, as `ftpatch bench` does; with --decode-first, each after a short decoded one),
then one profiled (the prefill alone): wall time, GPU kernel time by kind
(copies into staging by the copy engine, expert FFN, the rest), how much of the wall the GPU
was busy, and the top kernels; then the host-side calls that took the most time.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from freetoken_patch.cli.model_args import size_arg
from loaders import open_model
from moe_offload.models import qwen35moe as q
from moe_offload import open_runtime

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--vram", type=size_arg, default="8GiB")
ap.add_argument("--tokens", type=int, default=2048)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--delta-chunk", default=None,
                help="comma list of delta-net chunk sizes to A/B (rounds interleaved)")
ap.add_argument("--decode-first", type=int, default=0,
                help="before each prefill, a conversation of this many decode steps (the cache "
                "then holds a decode working set, scattered over the experts, not the warm start)")
args = ap.parse_args()

loaded = open_model(args.model)
c = loaded.config
rt = open_runtime(loaded, args.vram)


def converse() -> None:
    """--decode-first: a short conversation, so that the cache holds a decode working set."""
    if args.decode_first:
        st = rt.new_state(1)
        tok = rt.prefill(torch.randint(0, c.n_vocab, (1, 16)).cuda(), st).argmax(-1)
        for _ in range(args.decode_first):
            tok = rt.decode(tok, st).argmax(-1)


def once() -> float:
    converse()
    st = rt.new_state(1)
    toks = torch.randint(0, c.n_vocab, (1, args.tokens)).cuda()
    torch.cuda.synchronize()
    t = time.perf_counter()
    rt.prefill(toks, st)
    torch.cuda.synchronize()
    return time.perf_counter() - t


once()   # kernels loaded, the cache sized for prefill
chunks = [int(x) for x in args.delta_chunk.split(",")] if args.delta_chunk else [q.DELTA_CHUNK]
got: dict[int, list] = {ch: [] for ch in chunks}
for _ in range(args.reps):
    for ch in chunks:
        q.DELTA_CHUNK = ch
        got[ch].append(args.tokens / once())
q.DELTA_CHUNK = chunks[0]
for ch, v in got.items():
    print(f"pp{args.tokens} at {args.vram / 2**30:.0f} GiB, {rt.cache.slots[0]} slots a layer, "
          f"delta-net chunk {ch}: {sorted(v)[len(v) // 2]:.0f} tok/s {[round(x) for x in v]}")
converse()
toks = torch.randint(0, c.n_vocab, (1, args.tokens)).cuda()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t = time.perf_counter()
    rt.prefill(toks, rt.new_state(1))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
ev = [e for e in prof.events() if e.device_type.name == "CUDA"]


def kind(name: str) -> str:
    n = name.lower()
    if "memcpy" in n:
        return "copy"
    return "expert ffn" if "moe" in n or "rows_kernel" in n or "gemm" in n else "other"


spans = sorted((e.time_range.start, e.time_range.end) for e in ev if kind(e.name) != "copy")
busy, cur = 0.0, None
for a, b in spans:
    if cur and a <= cur[1]:
        cur[1] = max(cur[1], b)
    else:
        if cur:
            busy += cur[1] - cur[0]
        cur = [a, b]
busy += (cur[1] - cur[0]) if cur else 0.0
by: dict[str, float] = {}
for e in ev:
    by[kind(e.name)] = by.get(kind(e.name), 0.0) + e.time_range.elapsed_us()
print(f"profiled: wall {wall * 1e3:.0f} ms; kernels busy {busy / 1e3:.0f} ms; "
      + ", ".join(f"{k} {v / 1e3:.0f} ms" for k, v in sorted(by.items())))
top: dict[str, list] = {}
for e in ev:
    t = top.setdefault(e.name[:80], [0.0, 0])
    t[0] += e.time_range.elapsed_us()
    t[1] += 1
for name, (us, n) in sorted(top.items(), key=lambda kv: -kv[1][0])[:12]:
    print(f"  {us / 1e3:8.1f} ms {n:6d}x  {name}")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
rt.close()
