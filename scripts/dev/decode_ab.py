"""A/B of decode settings inside one offload runtime, on one machine (machines differ by up to
~10%, so only a same-process comparison separates a few percent).

    python scripts/dev/decode_ab.py MODEL [--vram 8GiB] [--trace] [--rounds 3] [--steps 64]
                                    [--variants base,pcie-only,threads8,no-smi,slots+3]

Each round runs every variant in turn: apply it, start a new conversation (a 16-token prompt,
so that every timed step stays in the first attention bucket: no graph capture is timed), 16
steps to settle (new slots fill, graphs are captured), then `--steps` timed steps without the
profiler; then undo it. Prints per variant the median tok/s (all rounds listed), MB over PCIe,
hit rate and CPU experts a token.

Variants:
  base         the runtime as built
  pcie-only    every miss over PCIe (the CPU computes none)
  splitQ/M     the plan's split fixed: a fraction Q of a layer's misses over PCIe, at least M
  threadsN     N CPU threads (the pool is rebuilt between steps)
  no-smi       nvidia-smi polling stopped (it spawns a process every 100 ms)
  slots+N      every layer's cache N slots larger (or slots-N smaller; mapped past the cap:
               the value of N slots, not a configuration that fits)
  pfN          N guesses a token one layer ahead (graphs re-captured)
  chunksN      the rows engine's warps stream at least N chunks (fewer CTAs on small
               matrices; graphs re-captured)
  record       the routed ids recorded every step, as `ftpatch bench` does in model routing
               (graphs re-captured)
  moeminN      prompts of more than N tokens take the grouped-GEMM expert path (with
               --after-prompt: what a short prompt costs the decode after it)

--after-prompt: apply the variant first, then time the first `--steps` steps after the prompt
(the cache's regrowth and refill included, as `ftpatch bench` times tg). One untimed step
before that prompt captures the variant's graphs (a capture costs ~0.1 s: timed, it would
weigh on every variant that re-captures, and on the one after it).
"""
from __future__ import annotations

import argparse
import re
import statistics
import time

import torch

from freetoken_patch.cli.model_args import size_arg
from loaders import open_model
from moe_offload.offload.budget import SmiPeak
from moe_offload import RoutingRecorder, open_runtime
from moe_offload.instrument.trace import TraceParams, make_trace
from native import ops
from native.ops import _cpu, _cuda

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--vram", type=size_arg, default="8GiB")
ap.add_argument("--trace", action="store_true")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--variants", default="base,pcie-only,threads8,no-smi")
ap.add_argument("--after-prompt", action="store_true")
ap.add_argument("--segments", action="store_true",
                help="after the warm-up, list torch's memory segments (pool, size, in use)")
args = ap.parse_args()

loaded = open_model(args.model)
c = loaded.config
rt = open_runtime(loaded, args.vram)
if args.trace:
    rt.replay(make_trace(256, c.n_layer, c.n_expert, c.n_expert_used, TraceParams()))
st = rt.new_state(1)
tok = rt.prefill(torch.randint(0, c.n_vocab, (1, 16)).cuda(), st).argmax(-1)
threads0 = _cpu.threads() if _cpu is not None else 0
pf0 = rt.engine.prefetch_k
chunks0 = _cuda.rows_min_chunks()
moemin0 = ops.PREFILL_MOE_MIN_TOKENS
slots0: list[int] = []
apply_rates = rt.scheduler.apply


def restart() -> None:
    """A new conversation: positions back to the first bucket (no capture while timing)."""
    global st, tok
    st = rt.new_state(1)
    tok = rt.prefill(torch.randint(0, c.n_vocab, (1, 16)).cuda(), st).argmax(-1)


def steps(n: int) -> float:
    global tok
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        tok = rt.decode(tok, st).argmax(-1)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t)


def recapture() -> None:
    """Drop the captured graphs: the next steps capture anew."""
    rt._drop_graphs()


def apply(v: str, on: bool) -> None:
    rt.engine.settle()
    if v == "pcie-only":
        rt.scheduler.forced = 1.0 if on else None
        rt.scheduler.apply()
    elif m := re.fullmatch(r"split([0-9.]+)/(\d+)", v):
        if on:   # fixed: the online CPU rate must not move it
            rt.scheduler.apply = lambda: rt.scheduler.fetch_fraction.copy_(
                torch.tensor([float(m[1]), float(m[2])]))
        else:
            rt.scheduler.apply = apply_rates
        rt.scheduler.apply()
    elif m := re.fullmatch(r"pf(\d+)", v):
        rt.engine.prefetch_k = int(m[1]) if on else pf0
        recapture()
    elif m := re.fullmatch(r"threads(\d+)", v):
        _cpu.set_threads(int(m[1]) if on else threads0)
    elif v == "no-smi":
        if on:
            rt.smi.stop()
        else:
            peak, rt.smi = rt.smi.peak_bytes, SmiPeak()
            rt.smi.peak_bytes = max(rt.smi.peak_bytes or 0, peak or 0)
    elif m := re.fullmatch(r"slots([+-]\d+)", v):
        rt.cache.resize([s + int(m[1]) for s in slots0] if on else slots0)
    elif m := re.fullmatch(r"chunks(\d+)", v):
        _cuda.set_rows_min_chunks(int(m[1]) if on else chunks0)
        recapture()
    elif m := re.fullmatch(r"moemin(\d+)", v):
        ops.PREFILL_MOE_MIN_TOKENS = int(m[1]) if on else moemin0
    elif v == "record":
        rt.attach_recorder(RoutingRecorder(256) if on else None)
    elif v != "base":
        raise SystemExit(f"unknown variant {v!r}")


variants = args.variants.split(",")
for v in variants:   # reject a typo before the rounds start
    apply(v, True)
    apply(v, False)
steps(48)   # graphs captured, the cache warm
slots0 = rt.cache.slots   # the decode size
if args.segments:
    pools: dict[tuple, list] = {}
    for seg in torch.cuda.memory_snapshot():
        k = (str(seg.get("segment_pool_id")), seg["segment_type"])
        row = pools.setdefault(k, [0, 0, 0, []])
        row[0] += 1
        row[1] += seg["total_size"]
        row[2] += seg["allocated_size"]
        row[3].append(seg["total_size"] >> 20)
    print("torch segments (pool, type): count, MiB reserved, MiB in use, sizes MiB")
    for k, (n, tot, used, sizes) in sorted(pools.items(), key=lambda kv: -kv[1][1]):
        print(f"  {k}: {n}, {tot / 2**20:.0f}, {used / 2**20:.0f}, {sorted(sizes)[-12:]}")
got: dict[str, list] = {v: [] for v in variants}
for r in range(args.rounds):
    for v in variants:
        if args.after_prompt:
            apply(v, True)
            restart()
            steps(1)   # a variant that re-captures does so here, not in the timed steps
            restart()
        else:
            restart()
            steps(1)   # the cache grows back to its decode size (after which slots+N applies)
            apply(v, True)
            steps(15)
        rt.reset_stats()
        tps = steps(args.steps)
        s = rt.stats().as_dict()
        got[v].append((tps, s["pcie_bytes"] / args.steps / 1e6, s["hit_rate"],
                       s["cpu"] / args.steps))
        apply(v, False)
print(f"{args.vram / 2**30:.0f} GiB, {'trace' if args.trace else 'model routing'}, "
      f"{args.rounds} rounds x {args.steps} steps, slots {min(slots0)}-{max(slots0)}, "
      f"{threads0} CPU threads")
for v, rows in got.items():
    tps = [x[0] for x in rows]
    print(f"  {v:12s} {statistics.median(tps):6.1f} tok/s {[round(x, 1) for x in tps]}  "
          f"{statistics.mean(x[1] for x in rows):6.1f} MB/token  hit "
          f"{statistics.mean(x[2] for x in rows):.1%}  cpu "
          f"{statistics.mean(x[3] for x in rows):.2f} experts/token")
rt.close()
