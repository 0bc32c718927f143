"""Batched decode under a VRAM cap, without the server: where a step of B sequences goes.

  python scripts/dev/decode_many_runtime.py MODEL --vram 8GiB [--batches 1,2,4] [--steps 64]

Opens the offload runtime holding max(batches) sequences, prefills each with its own random
prompt, then one row per setting (memory poller x CPU pool size x B x split): the first
decode_many step (it may capture the step's graph: timed apart) and --steps more (ms a step,
tokens a second), with the runtime's statistics of those steps (hit rate, experts fetched and
CPU-computed a step, the CPU's rate in the step). A row whose steps cross a multiple of
OffloadPolicy.graph_bucket positions captures a graph inside its timed steps: mind the
positions. With --compositions, the cost of a new batch composition: the states taken in a
different order or subset, each one's first step timed (a capture each).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def _time_parts(rt) -> dict:
    """Wrap the runtime's capture and memory steps with timers (synchronised); -> the totals."""
    spent: dict[str, float] = {}
    for obj, name in ((rt, "_capture"), (rt, "_eager"), (rt.vram, "before_capture"),
                      (rt.vram, "after_capture"), (rt.vram, "fit"), (rt.vram, "measure_outside"),
                      (rt.vram, "keep_free")):
        real = getattr(obj, name)

        def timed(*a, _real=real, _name=name, **kw):
            torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                torch.cuda.synchronize()
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t
        setattr(obj, name, timed)
    return spent


def _memory_poll(old, kind: str):
    """Stop the runtime's GPU-memory poller `old`; start the one named `kind` (see --memory-polls)."""
    import threading

    from moe_offload.offload import budget
    old.stop()
    new = budget.SmiPeak()
    if kind == "runtime":
        return new
    new.stop()
    if kind == "nvidia-smi":   # the program started every 100 ms, as the runtime once did
        new._read, new.source, new._interval = budget._smi_used, "nvidia-smi", 0.1
        new._stop = threading.Event()
        new._thread = threading.Thread(target=new._run, daemon=True)
        new._thread.start()
    return new


def main() -> None:
    from moe_offload import OffloadPolicy, open_runtime
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--vram", default="8GiB")
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--no-prefetch", action="store_true", help="no next-layer guesses")
    p.add_argument("--fractions", default="auto",
                   help="comma list of shares of misses sent over PCIe to run each batch at "
                        "(auto: the scheduler's q = p/(p+c); a number forces it)")
    p.add_argument("--threads", default="",
                   help="comma list of CPU pool sizes to run each batch at (default: the runtime's); "
                        "the CPU's rate is measured again at each")
    p.add_argument("--least", default="",
                   help="comma list of the scheduler's min_fetch (misses of a layer sent over PCIe "
                        "before the CPU gets any) to run each auto row at; default: its own")
    p.add_argument("--guess-split", default="on",
                   help="comma list: on (a layer's guessed copies count in the link's share of its "
                        "misses, OffloadPolicy.guesses_in_split), off (the share is of the misses "
                        "alone), each a pass over the rows (the graphs captured again)")
    p.add_argument("--prefetch-ks", default="",
                   help="comma list of experts guessed a token one layer ahead (OffloadPolicy."
                        "prefetch_k), each a pass over the rows (the graphs captured again); "
                        "default: the runtime's")
    p.add_argument("--memory-polls", default="runtime",
                   help="comma list of what polls the process's GPU memory during the rows, each a "
                        "pass over them: runtime (the runtime's own poller), nvidia-smi (the program "
                        "started every 100 ms), off")
    p.add_argument("--compositions", action="store_true",
                   help="also time the first step of new batch compositions (a capture each)")
    p.add_argument("--trace", action="store_true",
                   help="route by a replayed trace of realistic locality (TraceParams()) instead of "
                        "the model's router: each sequence of a step follows its own stretch of it, "
                        "so the batch shares only the popular experts (guesses off, as in bench)")
    p.add_argument("--cpu-repack", default="auto", choices=("auto", "on", "off"),
                   help="the CPU's repacked copy of the experts (RuntimeOptions.cpu_repack)")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    fractions = [None if f == "auto" else float(f) for f in args.fractions.split(",")]
    leasts = [int(x) for x in args.least.split(",") if x] or [None]
    fractions = [(f, None) for f in fractions if f is not None] + \
        [(None, m) for f in fractions if f is None for m in leasts]
    rt = open_runtime(args.model, args.vram, ctx=1024, max_sequences=max(batches),
                      policy=OffloadPolicy(prefetch=not args.no_prefetch), cpu_repack=args.cpu_repack)
    from moe_offload.offload.scheduler import measure_rates
    from native.ops import _cpu
    threads = [int(t) for t in args.threads.split(",") if t] or [_cpu.threads()]
    dev, c = rt.device, rt.config
    rng = np.random.default_rng(0)
    states = [rt.new_state(1) for _ in range(max(batches))]
    for st in states:
        rt.prefill(torch.from_numpy(rng.integers(0, c.n_vocab, (1, args.prompt))).to(dev), st)
    out = {"model": args.model, "vram": args.vram, "steps": args.steps, "rows": [],
           "regime": "model"}
    if args.trace:
        from moe_offload.instrument.trace import TraceParams, make_trace, trace_stats
        tr = make_trace(512 * rt.engine.max_tok, c.n_layer, c.n_expert, c.n_expert_used,
                        TraceParams())
        rt.replay(tr)
        out["regime"] = TraceParams().label()
        out["trace_stats"] = trace_stats(tr[:512], c.n_expert).as_dict()
        print(json.dumps({"regime": out["regime"], "trace_stats": out["trace_stats"]}), flush=True)
    spent = _time_parts(rt)

    def timed_step(sts, toks):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        logits = rt.decode_many(toks, sts)
        torch.cuda.synchronize(dev)
        return logits.argmax(-1), time.perf_counter() - t

    polls = args.memory_polls.split(",")
    current = (None, None)
    pks = [int(k) for k in args.prefetch_ks.split(",") if k] or [rt.engine.prefetch_k]
    for pk, split, poll, n_thr, b, frac in [(k, g, m, n, b, f) for k in pks
                                            for g in args.guess_split.split(",")
                                            for m in polls for n in threads for b in batches
                                            for f in fractions]:
        if (split == "on") != rt.engine.guesses_in_split or pk != rt.engine.prefetch_k:
            rt.engine.guesses_in_split = split == "on"   # both are in the captured graphs
            rt.engine.set_predictor(rt.engine.predict, pk)
            rt._drop_graphs()
        if (poll, n_thr) != current:   # a new setting: the CPU's rate measured again under it
            if poll != current[0]:
                rt.smi = _memory_poll(rt.smi, poll)
            _cpu.set_threads(n_thr)
            rt.scheduler.rates = measure_rates(rt.cache, rt.bank, c, rt.engine.link)
            current = (poll, n_thr)
        frac, least = frac
        rt.scheduler.forced = frac
        if least is not None:    # kept through the online updates of the CPU's rate
            rt.scheduler.min_fetch = lambda least=least: least
        else:
            rt.scheduler.__dict__.pop("min_fetch", None)
        rt.scheduler.apply()
        sts = states[:b]
        toks = torch.randint(0, c.n_vocab, (b,), device=dev)
        spent.clear()
        toks, first = timed_step(sts, toks)
        parts = {k: round(v * 1e3, 1) for k, v in spent.items()}
        spent.clear()
        rt.reset_stats()
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(args.steps):
            toks = rt.decode_many(toks, sts).argmax(-1)
        torch.cuda.synchronize(dev)
        dt = (time.perf_counter() - t) / args.steps
        s = rt.stats().as_dict()
        row = {"guess_split": split, "prefetch_k": rt.engine.prefetch_k,
               "poll": f"{poll} ({rt.smi.source})" if poll == "runtime" else poll, "threads": n_thr, "B": b, "fraction": "auto" if frac is None else frac,
               "min_fetch": int(rt.scheduler.fetch_fraction[1]), "q": round(s["fetch_fraction"], 3),
               "rates_GBps": {k: round(v, 1) for k, v in s["rates"].items()},
               "cpu_GBps_here": round(s["cpu_experts"] * rt.bank.layouts[0].expert_bytes
                                      / max(s["cpu_expert_s"], 1e-9) / 1e9, 1),
               "prefetch_precision": round(s["prefetch_precision"], 3), "first_step_ms": round(first * 1e3, 1), "step_ms": round(dt * 1e3, 2),
               "tok_s": round(b / dt, 1), "hit_rate": round(s["hit_rate"], 4),
               "fetched_per_step": round(s["fetched"] / args.steps, 1),
               "cpu_experts_per_step": round(s["cpu"] / args.steps, 1),
               "prefetched_per_step": round(s["prefetched"] / args.steps, 1),
               "pcie_MB_per_step": round(s["pcie_bytes"] / args.steps / 1e6, 1),
               "first_parts_ms": parts}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    # new compositions: each is a new graph key
    b = max(batches)
    if b >= 3 and args.compositions:
        for order in ([1, 0, 2, 3][:b], [0, 2][:b], [3, 1][: b] if b >= 4 else [2, 1]):
            sts = [states[i] for i in order]
            toks = torch.randint(0, c.n_vocab, (len(sts),), device=dev)
            _, first = timed_step(sts, toks)
            _, again = timed_step(sts, toks)
            row = {"order": order, "first_step_ms": round(first * 1e3, 1),
                   "next_step_ms": round(again * 1e3, 2),
                   "parts_ms": {k: round(v * 1e3, 1) for k, v in spent.items()}}
            spent.clear()
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    from moe_offload.offload import budget
    try:
        nvml = budget.Nvml().used()
    except OSError as e:
        nvml = repr(e)
    print(json.dumps({"process_gpu_bytes": {"nvml": nvml, "nvidia-smi": budget._smi_used()}}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    rt.close()


if __name__ == "__main__":
    main()
