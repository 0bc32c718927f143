"""Batched decode under a VRAM cap, without the server: where a step of B sequences goes.

  python scripts/dev/decode_many_runtime.py MODEL --vram 8GiB [--batches 1,2,4] [--steps 64]

Opens the offload runtime holding max(batches) sequences (once per --threads value: the CPU's
rate is measured at start-up with that pool), prefills each with its own random prompt, then one
row per setting (guesses a token x guess split x B x share of misses over PCIe): the first
decode_many step (it may capture the step's graph: timed apart, with the capture's own time) and
--steps more (ms a step, tokens a second), with the runtime's statistics of those steps (hit
rate, experts fetched, guessed and CPU-computed a step, the CPU's rate in the step). A row whose
steps cross a multiple of OffloadPolicy.graph_bucket positions captures a graph inside its timed
steps: mind the positions. With --compositions, the cost of a new batch composition: the states
taken in a different order or subset, each one's first step timed (a capture each). Rows are
printed as JSON lines. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
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
                   help="comma list of CPU pool sizes, a runtime opened for each (default: the "
                        "runtime's own)")
    p.add_argument("--guess-split", default="on",
                   help="comma list: on (a layer's guessed copies count in the link's share of its "
                        "misses, OffloadPolicy.guesses_in_split), off (the share is of the misses "
                        "alone), each a pass over the rows (the graphs captured again)")
    p.add_argument("--prefetch-ks", default="",
                   help="comma list of experts guessed a token one layer ahead (OffloadPolicy."
                        "prefetch_k), each a pass over the rows (the graphs captured again); "
                        "default: the runtime's")
    p.add_argument("--compositions", action="store_true",
                   help="also time the first step of new batch compositions (a capture each)")
    p.add_argument("--trace", action="store_true",
                   help="route by a replayed trace of realistic locality (TraceParams()) instead of "
                        "the model's router: each sequence of a step follows its own stretch of it, "
                        "so the batch shares only the popular experts (guesses off, as in bench)")
    p.add_argument("--cpu-repack", default="auto", choices=("auto", "on", "off"),
                   help="the CPU's repacked copy of the experts (RuntimeOptions.cpu_repack)")
    p.add_argument("--json", help="write the figures here too")
    return p


def run_rows(rt, args, out: dict, batches: list[int], fractions: list) -> None:
    """The rows of one runtime (one CPU pool size)."""
    import numpy as np
    import torch

    import native._cpu as cpu_ext
    dev, c = rt.device, rt.config
    rng = np.random.default_rng(0)
    states = [rt.new_state(1) for _ in range(max(batches))]
    for st in states:
        rt.prefill(torch.from_numpy(rng.integers(0, c.n_vocab, (1, args.prompt))).to(dev), st)

    def timed_step(sts, toks):
        torch.cuda.synchronize(dev)
        caps, cap_s, t = rt.captures, rt.capture_s, time.perf_counter()
        logits = rt.decode_many(toks, sts)
        torch.cuda.synchronize(dev)
        return logits.argmax(-1), time.perf_counter() - t, rt.captures - caps, rt.capture_s - cap_s

    eng = rt.engine
    pks = [int(k) for k in args.prefetch_ks.split(",") if k] or [eng.prefetch_k]
    for pk in pks:
        for split in args.guess_split.split(","):
            if (split == "on") != eng.guesses_in_split or pk != eng.prefetch_k:
                eng.settle()
                eng.guesses_in_split = split == "on"   # both are in the captured graphs
                if eng.predict is not None:
                    eng.set_predictor(eng.predict, pk)
                eng.prefetch_k = pk
                rt.graphs.drop()
            for b in batches:
                for frac in fractions:
                    rt.scheduler.forced = frac
                    rt.scheduler.apply()
                    sts = states[:b]
                    toks = torch.randint(0, c.n_vocab, (b,), device=dev)
                    toks, first, caps, cap_s = timed_step(sts, toks)
                    rt.reset_stats()
                    torch.cuda.synchronize(dev)
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        toks = rt.decode_many(toks, sts).argmax(-1)
                    torch.cuda.synchronize(dev)
                    dt = (time.perf_counter() - t) / args.steps
                    s = rt.stats().as_dict()
                    n = args.steps
                    row = {"B": b, "fraction": "auto" if frac is None else frac,
                           "threads": cpu_ext.threads(), "guess_split": split,
                           "prefetch_k": eng.prefetch_k, "guessing": rt.prefetching,
                           "min_fetch": s["min_fetch"], "q": round(s["fetch_fraction"], 3),
                           "rates_GBps": {k: round(v, 1) for k, v in s["rates"].items()},
                           "cpu_GBps_here": round(s["cpu_experts"] * rt.bank.layouts[0].expert_bytes
                                                  / max(s["cpu_expert_s"], 1e-9) / 1e9, 1),
                           "prefetch_precision": round(s["prefetch_precision"], 3),
                           "first_step_ms": round(first * 1e3, 1), "first_captures": caps,
                           "first_capture_ms": round(cap_s * 1e3, 1), "step_ms": round(dt * 1e3, 2),
                           "tok_s": round(b / dt, 1), "hit_rate": round(s["hit_rate"], 4),
                           "fetched_per_step": round(s["fetched"] / n, 1),
                           "cpu_experts_per_step": round(s["cpu"] / n, 1),
                           "prefetched_per_step": round(s["prefetched"] / n, 1),
                           "pcie_MB_per_step": round(s["pcie_bytes"] / n / 1e6, 1)}
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
    rt.scheduler.forced = None
    rt.scheduler.apply()
    b = max(batches)
    if b >= 3 and args.compositions:   # new compositions: each is a new graph key
        for order in ([1, 0, 2, 3][:b], [0, 2], [3, 1] if b >= 4 else [2, 1]):
            sts = [states[i] for i in order]
            toks = torch.randint(0, c.n_vocab, (len(sts),), device=dev)
            _, first, caps, cap_s = timed_step(sts, toks)
            _, again, _, _ = timed_step(sts, toks)
            row = {"order": order, "first_step_ms": round(first * 1e3, 1), "first_captures": caps,
                   "first_capture_ms": round(cap_s * 1e3, 1), "next_step_ms": round(again * 1e3, 2)}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    peaks = rt.vram_peaks()
    print(json.dumps({"process_gpu_peak_bytes": peaks["nvidia_smi_peak"], "cap": peaks["cap"]}))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    fractions = [None if f == "auto" else float(f) for f in args.fractions.split(",")]
    threads = [int(t) for t in args.threads.split(",") if t] or [None]
    from moe_offload import OffloadPolicy, TraceParams, make_trace, open_runtime, trace_stats
    out = {"model": args.model, "vram": args.vram, "steps": args.steps, "rows": [], "regime": "model"}
    for n_threads in threads:
        rt = open_runtime(args.model, args.vram, ctx=1024, max_sequences=max(batches),
                          policy=OffloadPolicy(prefetch=not args.no_prefetch),
                          cpu_repack=args.cpu_repack, cpu_threads=n_threads)
        if args.trace:
            c = rt.config
            tr = make_trace(512 * rt.engine.max_tok, c.n_layer, c.n_expert, c.n_expert_used,
                            TraceParams())
            rt.replay(tr)
            out["regime"] = TraceParams().label()
            out["trace_stats"] = trace_stats(tr[:512], c.n_expert).as_dict()
            print(json.dumps({"regime": out["regime"], "trace_stats": out["trace_stats"]}), flush=True)
        try:
            run_rows(rt, args, out, batches, fractions)
        finally:
            rt.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
