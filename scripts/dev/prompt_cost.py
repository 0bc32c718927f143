"""What a short prompt costs under a VRAM cap, and the decode step after it (dev measurement on
a GPU): the time to first token of a chat turn or a server request.

    python scripts/dev/prompt_cost.py MODEL [--vram 8GiB] [--tokens 8,16,42,64,128,512] [--reps 3]
        [--short-prompt 0,64] [--profile 16] [--verify 1,2,4,8]

Each row is a new conversation after a decoded one (so the cache holds a decode working set, as
in a server): the prompt's prefill (synced), the first decode step after it, then the mean of
the next 8 steps; experts streamed by the prefill and the cache's slots a layer before and
after. Sizes (and each --short-prompt setting: OffloadPolicy.short_prompt, prompts up to that
many tokens as decode steps) are interleaved across repetitions; medians are printed.
--profile N: one prompt of N tokens under torch.profiler at each setting (wall, GPU busy, host
calls). --verify: a decode step of T tokens of one sequence as a captured graph (rt.verify),
timed over 8 steps after its capture, for each T.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from freetoken_patch.cli.model_args import size_arg
from loaders import open_model
from moe_offload import open_runtime

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--vram", type=size_arg, default="8GiB")
ap.add_argument("--tokens", default="8,16,42,64,128,512")
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--decode-first", type=int, default=48)
ap.add_argument("--short-prompt", default=None, help="comma list of policy.short_prompt to A/B")
ap.add_argument("--profile", type=int, default=0)
ap.add_argument("--verify", default="")
args = ap.parse_args()

loaded = open_model(args.model)
c = loaded.config
rt = open_runtime(loaded, args.vram)
sizes = [int(x) for x in args.tokens.split(",")]


def synced(f):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = f()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def converse() -> None:
    st = rt.new_state(1)
    tok = rt.prefill(torch.randint(0, c.n_vocab, (1, 16)).cuda(), st).argmax(-1)
    for _ in range(args.decode_first):
        tok = rt.decode(tok, st).argmax(-1)


def once(n: int) -> dict:
    converse()
    st = rt.new_state(1)
    slots0 = rt.cache.slots[0]
    streamed0 = int(rt.engine.prefill_streamed.sum())
    caps0 = rt.captures
    toks = torch.randint(0, c.n_vocab, (1, n)).cuda()
    logits, t_pre = synced(lambda: rt.prefill(toks, st))
    slots1 = rt.cache.slots[0]
    tok = logits.argmax(-1)
    tok, t_first = synced(lambda: rt.decode(tok, st).argmax(-1))
    t = time.perf_counter()
    for _ in range(8):
        tok = rt.decode(tok, st).argmax(-1)
    torch.cuda.synchronize()
    return {"prefill_ms": t_pre * 1e3, "first_step_ms": t_first * 1e3,
            "step_ms": (time.perf_counter() - t) / 8 * 1e3,
            "streamed": int(rt.engine.prefill_streamed.sum()) - streamed0,
            "slots": f"{slots0}->{slots1}->{rt.cache.slots[0]}", "captures": rt.captures - caps0}


settings = ([int(x) for x in args.short_prompt.split(",")] if args.short_prompt
            else [rt.policy.short_prompt])
base = rt.policy
once(16)   # kernels loaded, graphs of the first buckets captured
rows: dict[tuple, list] = {(sp, n): [] for sp in settings for n in sizes}
for _ in range(args.reps):
    for sp in settings:
        rt.policy = base.with_(short_prompt=sp)
        for n in sizes:
            rows[sp, n].append(once(n))
print(f"cap {args.vram / 2**30:.0f} GiB, decode-first {args.decode_first}; medians of {args.reps}")
print(f"{'short':>5} {'tokens':>6} {'prefill ms':>10} {'tok/s':>7} {'1st step':>9} {'step':>6} "
      f"{'streamed':>8}  slots (before->after prompt->after 9 steps), captures")
for (sp, n), rs in rows.items():
    med = lambda k: statistics.median(r[k] for r in rs)   # noqa: E731
    print(f"{sp:>5} {n:>6} {med('prefill_ms'):>10.1f} {n / med('prefill_ms') * 1e3:>7.0f} "
          f"{med('first_step_ms'):>9.1f} {med('step_ms'):>6.2f} {med('streamed'):>8.0f}  "
          f"{[r['slots'] for r in rs]} {[r['captures'] for r in rs]}")


def profiled(n: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    converse()
    st = rt.new_state(1)
    toks = torch.randint(0, c.n_vocab, (1, n)).cuda()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, wall = synced(lambda: rt.prefill(toks, st))
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    spans = sorted((e.time_range.start, e.time_range.end) for e in ev)
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    copy = sum(e.time_range.elapsed_us() for e in ev if "memcpy" in e.name.lower())
    print(f"short_prompt {rt.policy.short_prompt}, {n} tokens profiled: wall {wall * 1e3:.0f} ms, "
          f"GPU busy {busy / 1e3:.0f} ms (copies {copy / 1e3:.0f} ms), {len(ev)} GPU events")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14,
                                    max_name_column_width=45))


for sp in settings if args.profile else []:
    rt.policy = base.with_(short_prompt=sp)
    profiled(args.profile)
for T in [int(x) for x in args.verify.split(",") if x]:
    converse()
    st = rt.new_state(1)
    rt.prefill(torch.randint(0, c.n_vocab, (1, 16)).cuda(), st)
    caps = rt.captures
    tok = torch.randint(0, c.n_vocab, (1, T)).cuda()
    _, t_cap = synced(lambda: rt.verify(tok, st))
    times = []
    for _ in range(8):
        _, t = synced(lambda: rt.verify(tok, st))
        times.append(t * 1e3)
    print(f"verify T={T}: first call {t_cap * 1e3:.0f} ms ({rt.captures - caps} captures), then "
          f"median {statistics.median(times):.1f} ms a step ({min(times):.1f}-{max(times):.1f}), "
          f"{T / statistics.median(times) * 1e3:.0f} tok/s")
rt.close()
