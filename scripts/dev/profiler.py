"""Where the runtime's time and memory go: one profiler, a subcommand a question.

    python scripts/dev/profiler.py step MODEL [--vram 8GiB] [--trace] [--steps 16] [--kinds b1,v2,v3,b2,b4]
    python scripts/dev/profiler.py timeline MODEL [--vram 8GiB] [--trace] [--prefetch-k N] [--no-overlap]
    python scripts/dev/profiler.py prefill MODEL [--vram 8GiB] [--tokens 2048] [--reps 3] [--decode-first N]
    python scripts/dev/profiler.py spec MODEL [--vram 8GiB] [--draft 3] [--trace] [--policy-log OUT.json]
    python scripts/dev/profiler.py memory MODEL [--vram 8GiB] [--steps 600] [--segments]
    python scripts/dev/profiler.py cpu MODEL [--tokens 8] [--prompt 64] [--threads N]

All but `cpu` need a CUDA GPU: they open the offload runtime (moe_offload.open_runtime) under the
cap, read what it reports (stats, captures, vram_peaks) and take the GPU's kernels from
torch.profiler. `cpu` runs the model on the CPU's per-op path (instrument.switches.CPU_PLAN off)
and times native.ops' entry points, which every CPU op goes through. `--help` on a subcommand
says what it prints.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

TRACE_HELP = "route by a replayed trace of realistic locality (TraceParams()) instead of the router"

# kernel families of a decode step: (family, substrings of the kernel's name), first match wins
FAMILIES = (
    ("fetch", ("fetch_kernel",)),
    ("cpu wait", ("wait_add",)),
    ("routed experts", ("GateUpMap", "DownMap", "act_kernel", "group_kernel", "sum_kernel")),
    ("delta-net core", ("conv_silu", "delta_step")),
    ("attention core", ("attention_part", "attention_merge")),
    ("dense projections", ("rows_kernel",)),
    ("norms", ("residual_norm",)),
    ("routing", ("route_", "plan", "prefetch")),
    ("copies", ("copy", "Memcpy", "memcpy", "cat", "elementwise_kernel")),
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)

    def cmd(name: str, fn, doc: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=doc.split("\n")[0], description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        s.set_defaults(run=fn)
        s.add_argument("model", help="a GGUF file (e.g. ftpatch synth --preset 35b-a3b --type IQ3_S)")
        if name != "cpu":
            s.add_argument("--vram", default="8GiB", help="the VRAM cap (default 8GiB)")
        return s

    s = cmd("step", step, STEP_DOC)
    s.add_argument("--trace", action="store_true", help=TRACE_HELP)
    s.add_argument("--steps", type=int, default=16, help="replays timed, then as many profiled")
    s.add_argument("--kinds", default="b1,v2,v3,b2,b4",
                   help="bN: decode_many of N sequences (b1: decode), vT: a verify step of T "
                        "tokens, dK: the MTP head's draft of K tokens (opens the head)")
    s.add_argument("--json", help="write the rows here too")

    s = cmd("timeline", timeline, TIMELINE_DOC)
    s.add_argument("--trace", action="store_true", help=TRACE_HELP)
    s.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    s.add_argument("--prefetch-k", type=int, help="experts guessed a token (default: the policy's)")
    s.add_argument("--fetch-blocks", type=int, help="grid of a PCIe copy (default: the policy's)")
    s.add_argument("--no-overlap", action="store_true", help="fetch misses before any expert computes")
    s.add_argument("--cpu-threads", type=int, help="the CPU pool (default: the runtime's)")
    s.add_argument("--events", help="write the profiled kernels (name, stream, start us, length us) "
                                    "to this JSON file, for a per-layer look offline")

    s = cmd("prefill", prefill, PREFILL_DOC)
    s.add_argument("--tokens", type=int, default=2048)
    s.add_argument("--reps", type=int, default=3, help="unprofiled prompts timed first")
    s.add_argument("--decode-first", type=int, default=0,
                   help="before each prompt, a conversation of this many decode steps (the cache "
                        "then holds a decode working set, not the warm start)")
    s.add_argument("--short-prompt", type=int,
                   help="OffloadPolicy.short_prompt for the run (0: every prompt takes the prefill "
                        "path; default: the policy's)")

    s = cmd("spec", spec, SPEC_DOC)
    s.add_argument("--draft", default="3", help="drafts a step, 0..3, or auto")
    s.add_argument("--trace", action="store_true", help=TRACE_HELP + " (by position, as bench)")
    s.add_argument("--gen", type=int, default=64, help="tokens a generation")
    s.add_argument("--min-gap", type=float, default=5.0, help="us without GPU work that count as a gap")
    s.add_argument("--top", type=int, default=40, help="host calls listed")
    s.add_argument("--json", help="write the figures here too")
    s.add_argument("--policy-log", metavar="OUT.json",
                   help="instead of profiling: --reps generations with --draft auto, every "
                        "observation of the adaptive policy written here")
    s.add_argument("--reps", type=int, default=3, help="generations with --policy-log")

    s = cmd("memory", memory, MEMORY_DOC)
    s.add_argument("--steps", type=int, default=600, help="decode steps (a capture every 256 positions)")
    s.add_argument("--segments", action="store_true",
                   help="list torch's memory segments at the end (pool, size, in use)")

    s = cmd("cpu", cpu, CPU_DOC)
    s.add_argument("--tokens", type=int, default=8, help="decode steps timed")
    s.add_argument("--prompt", type=int, default=64, help="prefill tokens timed")
    s.add_argument("--threads", type=int, default=0, help="the CPU kernels' pool (default: every core)")
    s.add_argument("--torch-threads", type=int, default=1,
                   help="torch's own (default 1, as run and bench on the CPU: the pool owns the cores)")
    s.add_argument("--torch-steps", action="store_true",
                   help="norms, routing and the mixers' cores in torch (instrument.switches."
                        "STEP_KERNELS off; their time then counts as other)")
    return p


# ---- shared -----------------------------------------------------------------------------------------

def open_rt(args, trace_rows: int = 256, by_position: bool = False, **options):
    """The runtime under args.vram (with --trace, a routing trace of about `trace_rows` rows
    replayed: a multiple of a step's most tokens, so that a step's tokens follow their own
    stretches) -> (runtime, label of the routing regime)."""
    from moe_offload import TraceParams, make_trace, open_runtime
    rt = open_runtime(args.model, args.vram, **options)
    if not getattr(args, "trace", False):
        return rt, "model routing"
    c, m = rt.config, rt.engine.max_tok
    rt.replay(make_trace(-(-trace_rows // m) * m, c.n_layer, c.n_expert, c.n_expert_used,
                         TraceParams()), by_position=by_position)
    return rt, TraceParams().label()


def trace_events(prof) -> list[dict]:
    """A torch.profiler run's chrome-trace events (name, cat, ph, ts and dur in us, tid)."""
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return events


def is_kernel(e: dict, copies: bool = False) -> bool:
    cats = ("kernel", "gpu_memcpy", "gpu_memset") if copies else ("kernel",)
    return e.get("ph") == "X" and e.get("cat") in cats


def merged(spans) -> list[list[float]]:
    """The union of [start, end) spans, as disjoint sorted spans."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def length(spans) -> float:
    return sum(b - a for a, b in spans)


def overlap(x, y) -> float:
    """Length of the intersection of two disjoint sorted span lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        total += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def family(name: str) -> str:
    return next((fam for fam, keys in FAMILIES if any(k in name for k in keys)), "other")


def synced(dev):
    import torch
    torch.cuda.synchronize(dev)
    return time.perf_counter()


# ---- step ---------------------------------------------------------------------------------------------

STEP_DOC = """GPU kernel time of each step kind, by family.

Opens the runtime holding 4 sequences (with the MTP head for dK kinds), prefills each, then per
kind times --steps graph replays without the profiler and --steps with it, and prints a step's
wall ms, the GPU's busy time (all kernels, and without fetch copies and the CPU wait), kernels a
step, kernel us by family (routed experts, fetch copies, CPU wait, delta-net core, attention core,
dense projections, norms, routing, copies; families overlap in time) and the top kernels. What a
further token of a step costs, and where, is the difference between rows. Verify steps rewind
after each replay, drafts go back to the same MTP position, so every replay sees the same
positions."""


def step(args) -> None:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moe_offload import OffloadPolicy
    kinds = args.kinds.split(",")
    drafts = any(k.startswith("d") for k in kinds)
    rt, regime = open_rt(args, trace_rows=512 * 8, ctx=1024, max_sequences=4, mtp=drafts,
                         policy=OffloadPolicy(prefetch=not args.trace))
    dev, c = rt.device, rt.config
    rng = np.random.default_rng(0)
    states = [rt.new_state(1) for _ in range(4)]
    for st in states:
        rt.prefill(torch.from_numpy(rng.integers(0, c.n_vocab, (1, 24))).to(dev), st)
    rt.keep_steps(states[0], max([int(k[1:]) for k in kinds if k[0] == "v"] + [3]) - 1)

    def step_fn(kind: str):
        n = int(kind[1:])
        st = states[0]
        if kind[0] == "d":   # the MTP KV made by keep_steps
            h = torch.randn(1, 1, c.n_embd, device=dev)
            toks = torch.randint(0, c.n_vocab, (1, 1), device=dev)
            p0 = st.mtp_past

            def draft():
                st.mtp_past = p0
                rt.draft(h, toks, st, n)
            return draft
        if kind[0] == "b":
            if not 1 <= n <= len(states):
                raise SystemExit(f"--kinds {kind}: 1..{len(states)} sequences")
            toks = torch.randint(0, c.n_vocab, (n,), device=dev)
            if n == 1:
                return lambda: rt.decode(toks, st)
            return lambda: rt.decode_many(toks, states[:n])
        if kind[0] != "v":
            raise SystemExit(f"--kinds {kind}: bN, vT or dK")
        toks = torch.randint(0, c.n_vocab, (1, n), device=dev)

        def verify():
            rt.verify(toks, st)
            st.rewind(n - 1)   # keep the first position: the next replay runs one further on
        return verify

    out = {"model": args.model, "vram": args.vram, "regime": regime, "rows": []}
    print(f"{args.vram}, {regime}, {rt.cache.slots[0]} slots a layer")
    n = args.steps
    for kind in kinds:
        fn = step_fn(kind)
        for _ in range(3):   # the graph captured and warm
            fn()
        rt.reset_stats()
        t = synced(dev)
        for _ in range(n):
            fn()
        wall = (synced(dev) - t) / n
        s = rt.stats().as_dict()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize(dev)
        ev = [e for e in trace_events(prof) if is_kernel(e)]
        fams: dict[str, float] = {}
        names: dict[str, list] = {}
        for e in ev:
            fams[family(e["name"])] = fams.get(family(e["name"]), 0.0) + e["dur"] / n
            r = names.setdefault(e["name"][:90], [0.0, 0.0])
            r[0] += e["dur"] / n
            r[1] += 1 / n
        busy = length(merged((e["ts"], e["ts"] + e["dur"]) for e in ev)) / n
        compute = length(merged((e["ts"], e["ts"] + e["dur"]) for e in ev
                                if family(e["name"]) not in ("fetch", "cpu wait"))) / n
        row = {"kind": kind, "wall_ms": round(wall * 1e3, 3), "gpu_busy_ms": round(busy / 1e3, 3),
               "compute_busy_ms": round(compute / 1e3, 3), "kernels_per_step": round(len(ev) / n, 1),
               "families_us": {k: round(v, 1) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])},
               "hit_rate": round(s["hit_rate"], 4), "fetched_per_step": round(s["fetched"] / n, 1),
               "cpu_per_step": round(s["cpu"] / n, 1),
               "pcie_MB_per_step": round(s["pcie_bytes"] / n / 1e6, 1),
               "top": [(k, round(v[0], 1), round(v[1], 1)) for k, v in
                       sorted(names.items(), key=lambda kv: -kv[1][0])[:14]]}
        out["rows"].append(row)
        print(f"== {kind}: wall {row['wall_ms']} ms, GPU busy {row['gpu_busy_ms']} ms "
              f"(compute {row['compute_busy_ms']}), {row['kernels_per_step']} kernels, hit "
              f"{row['hit_rate']}, fetched {row['fetched_per_step']}, cpu {row['cpu_per_step']}, "
              f"{row['pcie_MB_per_step']} MB")
        print("   " + ", ".join(f"{k} {v:.0f}" for k, v in row["families_us"].items()))
        for name, us, cnt in row["top"]:
            print(f"   {us:8.1f} us {cnt:6.1f}x  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    rt.close()


# ---- timeline -----------------------------------------------------------------------------------------

TIMELINE_DOC = """Where a decode step's time goes under the cap: the link against compute.

One sequence: a 16-token prompt, 48 steps to settle, 64 unprofiled steps (tok/s), then --steps
profiled steps. Prints a token's kernel time by kind (fetch = PCIe copies into the cache, wait =
the spin for the CPU's share, compute = the rest) and how its wall time splits into link only,
compute only, both at once, and no kernel running (launch gaps, event waits), then the top
kernels and the cache's counts."""


def timeline(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moe_offload import OffloadPolicy
    policy = OffloadPolicy().with_(prefetch_k=args.prefetch_k, fetch_blocks=args.fetch_blocks,
                                   overlap_misses=not args.no_overlap)
    rt, regime = open_rt(args, policy=policy, cpu_threads=args.cpu_threads)
    dev, c = rt.device, rt.config
    st = rt.new_state(1)
    tok = rt.prefill(torch.randint(0, c.n_vocab, (1, 16), device=dev), st).argmax(-1)

    def steps(n: int) -> float:
        nonlocal tok
        t = synced(dev)
        for _ in range(n):
            tok = rt.decode(tok, st).argmax(-1)
        return n / (synced(dev) - t)

    steps(48)
    print(f"{steps(64):.1f} tok/s over 64 steps, not profiled")
    rt.reset_stats()
    N = args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rate = steps(N)
    ev = [e for e in trace_events(prof) if is_kernel(e)]

    def kind(name: str) -> str:
        return "fetch" if "fetch_kernel" in name else "wait" if "wait_add" in name else "compute"

    if args.events:
        t0 = min(e["ts"] for e in ev)
        with open(args.events, "w") as f:
            json.dump([(e["name"][:60], e.get("tid"), round(e["ts"] - t0, 2), round(e["dur"], 2))
                       for e in sorted(ev, key=lambda e: e["ts"])], f)
    by = {k: merged((e["ts"], e["ts"] + e["dur"]) for e in ev if kind(e["name"]) == k)
          for k in ("fetch", "wait", "compute")}
    total = {k: sum(e["dur"] for e in ev if kind(e["name"]) == k) / N / 1e3 for k in by}
    span = max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)
    both = overlap(by["fetch"], by["compute"])
    busy = length(merged((e["ts"], e["ts"] + e["dur"]) for e in ev))
    s = rt.stats().as_dict()
    print(f"{args.vram}, {regime}, {rt.cache.slots[0]} slots a layer: {rate:.1f} tok/s while "
          f"profiled; kernel span {span / N / 1e3:.2f} ms a token")
    print(f"  kernel time a token: fetch {total['fetch']:.2f} ms, wait {total['wait']:.2f} ms, "
          f"compute {total['compute']:.2f} ms ({len(ev) / N:.0f} kernels)")
    print(f"  wall a token: link only {(length(by['fetch']) - both) / N / 1e3:.2f} ms, compute only "
          f"{(length(by['compute']) - both) / N / 1e3:.2f} ms, both {both / N / 1e3:.2f} ms, "
          f"no kernel running {(span - busy) / N / 1e3:.2f} ms")
    top: dict[str, float] = {}
    for e in ev:
        top[e["name"][:70]] = top.get(e["name"][:70], 0.0) + e["dur"]
    for name, us in sorted(top.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {us / N:8.1f} us/token  {name}")
    print(f"  cache: hit rate {s['hit_rate']:.1%}, fetched {s['fetched']}, guessed {s['prefetched']}, "
          f"cpu {s['cpu']} ({N} steps)")
    rt.close()


# ---- prefill ------------------------------------------------------------------------------------------

PREFILL_DOC = """Where a prompt's time goes under the cap.

Times --reps unprofiled prompts of --tokens random tokens (each in a new conversation, as `ftpatch
bench` does; with --decode-first, each after a decoded one), then profiles one: wall time, GPU
kernel time by kind (copies into staging by the copy engine, expert FFN, the rest), how much of
the wall the GPU was busy, the top kernels, and the host-side calls that took the most time."""


def prefill(args) -> None:
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile
    rt, _ = open_rt(args)
    if args.short_prompt is not None:
        rt.policy = rt.policy.with_(short_prompt=args.short_prompt)
    dev, c = rt.device, rt.config

    def converse() -> None:
        if args.decode_first:
            st = rt.new_state(1)
            tok = rt.prefill(torch.randint(0, c.n_vocab, (1, 16), device=dev), st).argmax(-1)
            for _ in range(args.decode_first):
                tok = rt.decode(tok, st).argmax(-1)

    def once() -> float:
        converse()
        st = rt.new_state(1)
        toks = torch.randint(0, c.n_vocab, (1, args.tokens), device=dev)
        t = synced(dev)
        rt.prefill(toks, st)
        return synced(dev) - t

    once()   # kernels loaded, the cache sized for prefill
    rates = [args.tokens / once() for _ in range(args.reps)]
    print(f"pp{args.tokens} at {args.vram}, {rt.cache.slots[0]} slots a layer, short_prompt "
          f"{rt.policy.short_prompt}: median {statistics.median(rates):.0f} tok/s "
          f"{[round(x) for x in rates]}")
    converse()
    toks = torch.randint(0, c.n_vocab, (1, args.tokens), device=dev)
    st = rt.new_state(1)
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        rt.prefill(toks, st)
        wall = synced(dev) - t
    ev = [e for e in trace_events(prof) if is_kernel(e, copies=True)]

    def kind(e: dict) -> str:
        if e["cat"] != "kernel" or "memcpy" in e["name"].lower():
            return "copy"
        n = e["name"].lower()
        return "expert ffn" if "moe" in n or "rows_kernel" in n or "gemm" in n else "other"

    busy = length(merged((e["ts"], e["ts"] + e["dur"]) for e in ev if kind(e) != "copy"))
    by: dict[str, float] = {}
    for e in ev:
        by[kind(e)] = by.get(kind(e), 0.0) + e["dur"]
    print(f"profiled: wall {wall * 1e3:.0f} ms; kernels busy {busy / 1e3:.0f} ms; "
          + ", ".join(f"{k} {v / 1e3:.0f} ms" for k, v in sorted(by.items())))
    top: dict[str, list] = {}
    for e in ev:
        r = top.setdefault(e["name"][:80], [0.0, 0])
        r[0] += e["dur"]
        r[1] += 1
    for name, (us, n) in sorted(top.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  {us / 1e3:8.1f} ms {n:6d}x  {name}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                    max_name_column_width=50))
    rt.close()


# ---- spec ---------------------------------------------------------------------------------------------

SPEC_DOC = """Where a speculative step leaves the GPU idle, or what the adaptive policy saw.

Opens the runtime with the file's MTP head (as `bench --draft`; an MTP file: ftpatch synth
--preset 35b-a3b --type IQ3_S --mtp-agree 0.8), runs two untimed greedy generations of --gen
tokens after random 16-token prompts, then profiles one more (torch.profiler: the CPU with the
Python tracer, the GPU). The GPU's busy time is the union of its kernels and copies; a gap is a
stretch of more than --min-gap us without any. For the gaps, the host's Python functions that
overlap them are summed by name (a caller and its callees both count). Prints the steps, the
busy and idle time a step, and the top names.

--policy-log OUT.json: no profiler; --reps generations with --draft auto, and each step's k,
drafts kept, the seconds the policy was told (null: not a sample), its acceptance estimate, its
cost estimates by k (ms) and the runtime's graph captures so far go to OUT.json; the plain
steps, the first few and those beside a capture are printed."""


def spec(args) -> None:
    import numpy as np
    import torch

    from moe_offload import DraftPolicy, SamplingParams, SpeculativeDecoder, generate
    rt, regime = open_rt(args, trace_rows=160, by_position=True, ctx=4096, mtp=True)
    dev, c = rt.device, rt.config
    params = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eog=True)
    rng = np.random.default_rng(0)
    log: list[dict] = []

    class Logged(DraftPolicy):
        def observe(self, k, accepted, seconds):
            super().observe(k, accepted, seconds)
            log.append({"k": k, "accepted": accepted,
                        "ms": None if seconds is None else round(seconds * 1e3, 3),
                        "a": round(self.a, 3),
                        "cost_ms": {j: round(v * 1e3, 3) for j, v in sorted(self.cost.items())},
                        "captures": rt.captures, "capture_s": round(rt.capture_s, 3)})

    if args.policy_log:
        dec = SpeculativeDecoder(rt, policy=Logged(None))
    else:
        dec = SpeculativeDecoder(rt, draft=args.draft)

    def run():
        st = rt.new_state(1, 4096)
        torch.cuda.synchronize(dev)
        done = None
        for done in generate(rt, st, rng.integers(0, c.n_vocab, 16).tolist(), params, draft=dec):
            pass
        torch.cuda.synchronize(dev)
        rt.release(st)
        return done

    print(f"{args.vram}, {regime}, {rt.cache.slots[0]} slots a layer")
    if args.policy_log:
        for r in range(args.reps):
            done = run()
            print(f"generation {r}: {done.timings.decode_tps:.1f} tok/s, {dec.stats.summary()}")
        with open(args.policy_log, "w") as f:
            json.dump({"stats": dec.stats.as_dict(), "steps": log}, f)
        last = 0
        for i, e in enumerate(log):
            if e["k"] == 0 or i < 8 or e["captures"] != last:
                print(i, e)
            last = e["captures"]
        rt.close()
        return
    profile_gaps(args, rt, dec, run)
    rt.close()


def profile_gaps(args, rt, dec, run) -> None:
    import bisect
    import collections

    from torch.profiler import ProfilerActivity, profile
    run()
    run()
    dec.reset_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        run()
    steps = dec.stats.steps
    ev = trace_events(prof)
    gpu = merged((e["ts"], e["ts"] + e["dur"]) for e in ev if is_kernel(e, copies=True))
    gaps = [(a[1], b[0]) for a, b in zip(gpu, gpu[1:]) if b[0] - a[1] > args.min_gap]
    busy, idle = length(gpu), sum(b - a for a, b in gaps)
    span = gpu[-1][1] - gpu[0][0]
    print(f"{steps} steps, {dec.stats.tokens} tokens: span {span / 1e3:.2f} ms, GPU busy "
          f"{busy / 1e3:.2f} ms, idle gaps > {args.min_gap} us {idle / 1e3:.2f} ms ({len(gaps)} "
          f"gaps); a step: busy {busy / steps / 1e3:.3f} ms, idle {idle / steps / 1e3:.3f} ms")
    sizes = sorted(b - a for a, b in gaps)
    if sizes:
        print(f"gap us: median {sizes[len(sizes) // 2]:.0f}, p90 {sizes[int(len(sizes) * 0.9)]:.0f}, "
              f"max {sizes[-1]:.0f}")
    by: collections.Counter = collections.Counter()
    starts = [a for a, _ in gaps]
    for e in ev:
        if e.get("ph") != "X" or e.get("cat") not in ("python_function", "cpu_op"):
            continue
        s, t = e["ts"], e["ts"] + e["dur"]
        i = max(0, bisect.bisect_right(starts, s) - 1)
        ov = 0.0
        while i < len(gaps) and gaps[i][0] < t:
            ov += max(0.0, min(gaps[i][1], t) - max(gaps[i][0], s))
            i += 1
        if ov > 0:
            by[e["name"][:110]] += ov
    print("host calls overlapping the gaps (us a step, inclusive of callees):")
    for name, us in by.most_common(args.top):
        print(f"  {us / steps:8.1f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": steps, "busy_ms": busy / 1e3, "idle_ms": idle / 1e3, "gaps_us": sizes,
                       "host_us_per_step": {k: v / steps for k, v in by.most_common(200)}}, f)


# ---- memory -------------------------------------------------------------------------------------------

MEMORY_DOC = """Where the cap goes while decoding, and what each decode-graph capture takes.

One sequence decodes --steps steps (a graph is captured every OffloadPolicy.graph_bucket
positions). For each step that captured (the runtime's `captures` moved), torch's reserved and
allocated memory before and after it and its reserved peak, the expert cache's size and the
process's GPU memory (NVML / nvidia-smi, the runtime's poller). Then, decoding: the process's
figure against what can be named (torch reserved, the expert cache, the KV mapped) and the rest,
beside what the runtime budgeted for the CUDA context and libraries."""


def memory(args) -> None:
    import torch
    MiB = 1 << 20
    rt, _ = open_rt(args)
    dev, c = rt.device, rt.config
    st = rt.new_state(1)
    tok = rt.prefill(torch.randint(0, c.n_vocab, (1, 16), device=dev), st).argmax(-1)
    for _ in range(args.steps):
        caps = rt.captures
        torch.cuda.synchronize(dev)
        reserved, alloc = torch.cuda.memory_reserved(dev), torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        pos = st.n_past
        tok = rt.decode(tok, st).argmax(-1)
        if rt.captures != caps:
            torch.cuda.synchronize(dev)
            print(f"capture at position {pos}: reserved {reserved / MiB:.0f} -> "
                  f"{torch.cuda.memory_reserved(dev) / MiB:.0f} MiB (peak "
                  f"{torch.cuda.max_memory_reserved(dev) / MiB:.0f}), allocated {alloc / MiB:.0f} -> "
                  f"{torch.cuda.memory_allocated(dev) / MiB:.0f}; cache {rt.stats().cache_bytes / MiB:.0f} "
                  f"MiB, process {(rt.smi.sample() or 0) / MiB:.0f} MiB")
    torch.cuda.synchronize(dev)
    peaks, s = rt.vram_peaks(), rt.stats()
    smi, reserved = rt.smi.sample() or 0, torch.cuda.memory_reserved(dev)
    named = reserved + s.cache_bytes + s.kv_bytes
    print(f"after {args.steps} steps (MiB): process {smi / MiB:.0f} (peak "
          f"{(peaks['nvidia_smi_peak'] or 0) / MiB:.0f}, cap {peaks['cap'] / MiB:.0f}); torch "
          f"reserved {reserved / MiB:.0f} (allocated {torch.cuda.memory_allocated(dev) / MiB:.0f}, "
          f"prefill staging {rt.engine.staging_bytes / MiB:.0f} when held), expert cache "
          f"{s.cache_bytes / MiB:.0f} (slots {min(s.cache_slots)}-{max(s.cache_slots)}), KV "
          f"mapped {s.kv_bytes / MiB:.0f}; the rest {(smi - named) / MiB:.0f} (budgeted for the "
          f"context and libraries: {peaks['outside_budget'] / MiB:.0f})")
    if args.segments:
        pools: dict[tuple, list] = {}
        for seg in torch.cuda.memory_snapshot():
            row = pools.setdefault((str(seg.get("segment_pool_id")), seg["segment_type"]), [0, 0, 0, []])
            row[0] += 1
            row[1] += seg["total_size"]
            row[2] += seg["allocated_size"]
            row[3].append(seg["total_size"] >> 20)
        print("torch segments (pool, type): count, MiB reserved, MiB in use, largest sizes MiB")
        for k, (n, tot, used, sizes) in sorted(pools.items(), key=lambda kv: -kv[1][1]):
            print(f"  {k}: {n}, {tot / MiB:.0f}, {used / MiB:.0f}, {sorted(sizes)[-12:]}")
    rt.close()


# ---- cpu ----------------------------------------------------------------------------------------------

CPU_DOC = """Where a CPU decode token and a prompt spend their time, by op family.

The model on the CPU's per-op path (instrument.switches.CPU_PLAN off: the one-call forward has
no op calls to time). native.ops' entry points are wrapped with wall-clock timers for the run
(and restored): matmuls sorted by the weight's name (mixer projections, router, shared expert,
head), the routed experts' moe_ffn, the delta-net and attention cores, norms, routing, swiglu;
"other" is the rest (RoPE, casts, Python). Prints ms a token for decode and prefill and, for
decode, the weight bytes each family reads a token, its rate, and the host's read bandwidth (a
float32 torch.sum over 1 GiB on the pool's threads) as the bound."""


def weight_family(name: str) -> str:
    if "ffn_gate_inp" in name and "ffn_up_shexp" in name:   # one matmul_many on the CPU
        return "router + shared gate|up"
    if "shexp" in name:
        return "shared expert"
    if "ffn_gate_inp" in name:
        return "router"
    if name.startswith(("output", "token_embd")):
        return "head"
    return "mixer projections"


def cpu(args) -> None:
    import collections

    import torch

    import native._cpu as cpu_ext
    from freetoken_patch.cli.bench_kernels import host_read_gbps
    from loaders import open_model
    from moe_offload import build_model
    from moe_offload.instrument import switches
    from native import ops
    if args.threads:
        cpu_ext.set_threads(args.threads)
    torch.set_num_threads(args.torch_threads)
    loaded = open_model(args.model)
    model = build_model(loaded, "cpu")
    spent: dict[str, float] = collections.defaultdict(float)
    read: dict[str, float] = collections.defaultdict(float)   # weight bytes
    nbytes = lambda w: w.data.numel() * w.data.element_size()   # noqa: E731

    def timed(fn, label, weights=None):
        def call(*a, **k):
            t = time.perf_counter()
            y = fn(*a, **k)
            name = label(*a, **k) if callable(label) else label
            spent[name] += time.perf_counter() - t
            if weights is not None:
                read[name] += weights(*a, **k)
            return y
        return call

    def expert_bytes(x, gate, up, down, ids, *rest):   # each expert used is read once a call
        return len(torch.unique(ids[ids >= 0])) * sum(nbytes(w) / w.shape[0] for w in (gate, up, down))

    wrapped = {
        "matmul": timed(ops.matmul, lambda x, w: weight_family(w.name), lambda x, w: nbytes(w)),
        "matmul_many": timed(ops.matmul_many, lambda x, ws: weight_family("+".join(w.name for w in ws)),
                             lambda x, ws: sum(nbytes(w) for w in ws)),
        "moe_ffn": timed(ops.moe_ffn, "expert FFN", expert_bytes),
        "cpu_conv_silu": timed(ops.cpu_conv_silu, "delta-net core"),
        "cpu_delta_rule": timed(ops.cpu_delta_rule, "delta-net core"),
        "cpu_gated_attention": timed(ops.cpu_gated_attention, "attention core"),
        "step_residual_rms_norm": timed(ops.step_residual_rms_norm, "norms"),
        "step_route_topk": timed(ops.step_route_topk, "routing"),
        "step_swiglu": timed(ops.step_swiglu, "swiglu"),
    }
    saved = {name: getattr(ops, name) for name in wrapped}
    saved_switches = switches.CPU_PLAN, switches.STEP_KERNELS
    switches.CPU_PLAN = False
    switches.STEP_KERNELS = not args.torch_steps
    for name, fn in wrapped.items():
        setattr(ops, name, fn)
    gen = torch.Generator().manual_seed(0)
    V = loaded.config.n_vocab
    try:
        with torch.inference_mode():
            for label, n_prompt, steps in (("prefill", args.prompt, 0), ("decode", 4, args.tokens)):
                st = model.new_state(1, n_prompt + steps + 1)
                toks = torch.randint(0, V, (1, n_prompt), generator=gen)
                spent.clear()
                t0 = time.perf_counter()
                logits = model.prefill(toks, st)
                if steps:
                    spent.clear()
                    read.clear()
                    t0 = time.perf_counter()
                    nxt = logits.argmax(-1)
                    for _ in range(steps):
                        nxt = model.decode(nxt, st).argmax(-1)
                total = time.perf_counter() - t0
                n = steps or n_prompt
                spent["other"] = total - sum(spent.values())
                print(f"{label}: {n / total:.2f} tok/s ({total / n * 1e3:.1f} ms/token, threads "
                      f"{cpu_ext.threads()}, torch threads {torch.get_num_threads()}, isa {cpu_ext.isa()})")
                for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
                    rate = (f"  {read[k] / n / 1e6:7.1f} MB/token {read[k] / v / 1e9:6.1f} GB/s"
                            if steps and read.get(k) else "")
                    print(f"  {k:24s} {v / n * 1e3:8.2f} ms/token  {v / total:6.1%}{rate}")
    finally:
        for name, fn in saved.items():
            setattr(ops, name, fn)
        switches.CPU_PLAN, switches.STEP_KERNELS = saved_switches
    if not (args.tokens and read):
        return
    torch.set_num_threads(cpu_ext.threads())
    bw = host_read_gbps()
    mb = sum(read.values()) / args.tokens / 1e6
    print(f"  weights read: {mb:.0f} MB/token; host read bandwidth {bw:.1f} GB/s -> at most "
          f"{bw * 1e3 / mb:.1f} tok/s if every byte came at that rate")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
