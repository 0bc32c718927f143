"""`ftpatch bench`: prefill and decode throughput under a VRAM cap, with the method beside the
number (docs/BENCHMARKS.md, "Method"): warm-up, then the median of N repetitions and their spread,
TTFT, VRAM peaks by the allocator and by nvidia-smi, load time, expert-cache statistics, and the
routing regime (the model's own routing, or a replayed trace with stated locality) on every line.

`ftpatch bench kernels` runs the per-type kernel benchmark instead (bench_kernels.py);
`ftpatch bench serve` loads an OpenAI-compatible server on this machine (bench_serve.py).
Several caps in one call (`--vram 4GiB,6GiB,8GiB`) and llama.cpp's `llama-bench` beside ours
(`--compare-llama-bench BIN`): bench_compare.py. `ftpatch bench report RESULTS.json...` turns
results into an HTML page, PNG charts and the README's table: bench_report.py.
"""
from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import numpy as np
import torch

from ..errors import CLIError
from .bench_spec import parse_drafts
from .inputs import check, check_fraction, check_positive
from .model_args import (add_kv_type_arg, add_placement_args, kv_type_for, placement_options,
                         size_arg)

from moe_offload import OffloadPolicy, settings_dict

POLICY = OffloadPolicy()   # the defaults --help states and a run starts from

EPILOG = """\
examples:
  ftpatch bench 35b.gguf --vram 8GiB                      # pp512, pp2048, tg128, 3 reps
  ftpatch bench 35b.gguf --vram 8GiB --trace --json       # realistic-locality routing trace
  ftpatch bench 35b.gguf --vram 4GiB,6GiB,8GiB --out caps.json   # several caps, one call
  ftpatch bench 35b.gguf --vram 4GiB,8GiB --compare-llama-bench ~/llama.cpp/build/bin/llama-bench
  ftpatch bench report caps.json -o report.html --png charts/   # charts of results (JSON)
  ftpatch bench 35b.gguf --device cpu --threads 16 -p 512 # CPU only: pp512, tg128
  ftpatch bench 35b.gguf --vram 8GiB --link-gbps 11.8 --threads 8   # a laptop's PCIe 4.0 x8 link
  ftpatch bench mtp.gguf --vram 8GiB --draft auto         # speculative decoding with the MTP head
  ftpatch bench mtp.gguf --vram 8GiB --draft 1,3 --draft-guess-layers 0   # ... no guesses while drafting
  ftpatch bench kernels                                   # per-type kernel throughput (GB/s)
  ftpatch bench serve --concurrency 1,2,4                 # load a server: TTFT, tok/s (--help)

method: each size runs once untimed, then --reps times; the median is reported with min and
max. pp N = N prompt tokens / prefill wall time (random token ids, one chunk per --chunk).
tg N = N decode steps / their wall time after a 16-token prompt (TTFT excluded, reported apart).
"""


def add_parser(sub) -> None:
    s = sub.add_parser("bench", help="benchmark prefill/decode under a VRAM cap (or: bench kernels)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                       description="Measure prefill (pp) and decode (tg) throughput of a model "
                                   "under a hard VRAM cap, with cache and routing statistics.")
    s.add_argument("model", help="GGUF model; or the word 'kernels' (kernel benchmark), "
                                  "'report' followed by result files (charts and tables) or "
                                  "'serve' (load a server; its own flags: bench serve --help)")
    s.add_argument("--vram", default="8GiB", type=size_list_arg,
                   help="VRAM cap, or several separated by commas (default 8GiB)")
    s.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the CPU-only path (every weight in host RAM, --threads cores; no "
                        "cap, no GPU needed); default cuda, under --vram")
    s.add_argument("--compare-llama-bench", metavar="BIN",
                   help="at each cap also run this llama-bench on the same file, with the "
                        "--n-cpu-moe that fits the cap, the same sizes and threads")
    s.add_argument("--llama-bench-args", default="", metavar="ARGS",
                   help="more arguments for llama-bench, as one string (e.g. '-fa 1')")
    s.add_argument("-p", "--prompt-sizes", default="512,2048", help="prefill sizes (default 512,2048)")
    s.add_argument("-n", "--gen", type=int, default=128, help="decode tokens (default 128)")
    s.add_argument("--reps", type=int, default=3, help="timed repetitions (default 3)")
    s.add_argument("--draft", type=parse_drafts, default=[], metavar="N|auto[,...]",
                   help="also decode speculatively with the model's MTP head, N drafts a step "
                        "(1..3) or auto, beside plain decoding: tok/s, acceptance, tokens a "
                        "step; several (1,2,auto) run one after another on the loaded model "
                        "(default: off)")
    s.add_argument("--phase-times", action="store_true",
                   help="with --draft: one more speculative run, synchronised between the "
                        "phases of each step (draft, verify of T tokens, accept, rewind), for "
                        "where a step's time goes (the timed runs stay unsynchronised)")
    s.add_argument("--mtp-experts", choices=("gpu", "host"), default="gpu",
                   help="with --draft: the MTP layer's routed experts resident in VRAM (inside "
                        "the cap; default) or in pinned host RAM, read over PCIe")
    s.add_argument("--draft-guess-layers", type=int, default=None, metavar="N",
                   help="with --draft: while the MTP head drafts, guess the verify step's experts "
                        "in its first N layers from the known tokens' embeddings and copy them "
                        f"(default {POLICY.draft_guess_layers}; 0: off; off anyway with --trace "
                        "or --no-prefetch)")
    s.add_argument("--ctx", type=int, default=4096, help="context to budget for (default 4096)")
    s.add_argument("--chunk", type=int, default=POLICY.prefill_chunk,
                   help=f"prefill chunk (default {POLICY.prefill_chunk})")
    s.add_argument("--trace", action="store_true",
                   help="replay a routing trace with realistic locality instead of the model's own")
    s.add_argument("--trace-repeat", type=float, default=None, help="trace: repeat probability")
    s.add_argument("--trace-skew", type=float, default=None, help="trace: Zipf popularity exponent")
    s.add_argument("--fetch-fraction", type=float, default=None,
                   help="force the share of misses fetched over PCIe (0: CPU only, 1: PCIe only)")
    s.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs")
    s.add_argument("--no-prefetch", action="store_true",
                   help="do not guess the next layer's experts (decode); off anyway with --trace")
    s.add_argument("--prefetch-k", type=int, default=None,
                   help=f"experts guessed per token for the next layer, even on a slow link "
                        f"(default: {POLICY.prefetch_share:g} of the top-k, {POLICY.guesses(8)} of 8, "
                        f"while the link takes >= {POLICY.prefetch_min_fetch_share:g} of the misses)")
    s.add_argument("--no-elastic", action="store_true",
                   help="keep the expert cache at its prefill size while decoding and the KV "
                        "allocated for the whole --ctx (by default the cache grows into the prefill "
                        "workspace and into the KV not yet used)")
    s.add_argument("--no-overlap", action="store_true",
                   help="fetch a layer's missing experts before computing any of its experts (by "
                        "default the resident ones compute while the misses cross PCIe)")
    add_placement_args(s)
    add_kv_type_arg(s)
    s.add_argument("--profile", help="warm-start the cache from a routing profile (JSON)")
    s.add_argument("--save-profile", help="write the routing profile seen during the run")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--out", help="also write the JSON result to this file")
    try:
        from . import bench_kernels
        kg = s.add_argument_group("kernel benchmark options (with 'kernels')")
        bench_kernels.add_arguments(kg)
    except ImportError:
        pass
    from . import bench_report
    bench_report.add_arguments(s.add_argument_group("report options (with 'report')"))
    from . import bench_serve
    bench_serve.attach(s)   # `bench serve ...` is parsed and run by bench_serve


def size_list_arg(text: str) -> list[int]:
    """argparse type for --vram: one size or several separated by commas."""
    return [size_arg(part) for part in text.split(",") if part.strip()] or [size_arg(text)]


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "reps": len(xs),
            "all": [round(x, 2) for x in xs]}


def _sync() -> None:
    torch.cuda.synchronize()


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    console = Console(highlight=False, stderr=args.json)
    if args.model == "kernels":
        from . import bench_kernels
        return bench_kernels.run(args, console)
    from . import bench_compare, bench_report
    if args.model == "report":
        return bench_report.run(args, console)
    bench_report.refuse_inputs(args)
    for flag, value in (("-n", args.gen), ("--reps", args.reps), ("--ctx", args.ctx),
                        ("--chunk", args.chunk)):
        check_positive(flag, value)
    for flag, value in (("--fetch-fraction", args.fetch_fraction),
                        ("--trace-repeat", args.trace_repeat)):
        check_fraction(flag, value)
    if args.trace_skew is not None:
        check("--trace-skew", args.trace_skew, math.isfinite(args.trace_skew) and
              args.trace_skew >= 0, "give a number >= 0")
    try:
        sizes = [int(x) for x in args.prompt_sizes.split(",") if x.strip()]
    except ValueError:
        sizes = []
    check("-p", repr(args.prompt_sizes), bool(sizes) and min(sizes) >= 1,
          "give sizes like 512,2048")
    if args.device == "cpu":
        from . import bench_cpu
        if args.compare_llama_bench or len(args.vram) > 1:
            raise CLIError("--device cpu measures one configuration: no --vram list or "
                           "--compare-llama-bench (run llama-bench -ngl 0 beside it)")
        offload_only = [flag for flag, given in (
            ("--trace", args.trace or args.trace_repeat is not None or args.trace_skew is not None),
            ("--fetch-fraction", args.fetch_fraction is not None), ("--no-graphs", args.no_graphs),
            ("--no-prefetch", args.no_prefetch), ("--prefetch-k", args.prefetch_k is not None),
            ("--no-elastic", args.no_elastic), ("--no-overlap", args.no_overlap),
            ("--host-head", args.host_head), ("--gpu-embedding", args.gpu_embedding),
            ("--link-gbps", args.link_gbps is not None), ("--profile", args.profile),
            ("--draft-guess-layers", args.draft_guess_layers is not None),
            ("--save-profile", args.save_profile), ("--mtp-experts", args.mtp_experts != "gpu"))
            if given]
        if offload_only:
            raise CLIError(f"{', '.join(offload_only)}: the offload runtime's (under --vram, on a "
                           "GPU); --device cpu keeps every weight in host RAM: drop them")
        return bench_compare.run_cli(args, sizes, console, bench_cpu.run_one)
    return bench_compare.run_cli(args, sizes, console, _run_one)


def _kv_report(rt, c, kv: str, n_ctx: int, asked: str) -> dict:
    """The KV type, its bytes, and the expert cache it left (what a long context costs)."""
    from moe_offload import kv_bytes_per_token
    per = kv_bytes_per_token(c, kv)
    return {"type": kv, "asked": asked, "bytes_per_token": per, "bytes_at_ctx": per * n_ctx,
            "expert_cache_bytes": rt.cache.nbytes, "expert_cache_slots": rt.cache.slots[0]}


def _kv_line(kv: dict) -> str:
    how = " (auto)" if kv["asked"] == "auto" else ""
    return (f"KV {kv['type']}{how}: {kv['bytes_per_token']:,} bytes a token, "
            f"{kv['bytes_at_ctx'] / 2**30:.2f} GiB at --ctx; expert cache "
            f"{kv['expert_cache_bytes'] / 2**30:.2f} GiB")


def _decode_after(rt, logits, st, gen: int, room: int) -> dict | None:
    """Decode speed with the prompt just measured in the cache: warm-up steps (the attended
    length's graph is captured, and the expert cache, which the prompt's streaming left as it
    was, refills with what decoding routes to), then `gen` timed; None when the context has no
    room for them."""
    warm = 32
    if room - warm < 1:
        return None
    n = min(gen, room - warm)
    nxt, _ = _decode_steps(rt, logits.argmax(-1), st, warm)
    _, seconds = _decode_steps(rt, nxt, st, n)
    return {"tokens": n, "tok_s": round(n / seconds, 2)}


def _decode_steps(rt, nxt, st, n: int):
    """n greedy decode steps from token nxt, timed to the device's end -> (last token, seconds)."""
    t = time.perf_counter()
    for _ in range(n):
        nxt = rt.decode(nxt, st).argmax(-1)
    _sync()
    return nxt, time.perf_counter() - t


def draft_guess_stats(rt) -> dict:
    """What the guesses made while drafting did since the last reset_stats: experts copied into
    layer 0 and how many of them its plans used (layer 0 only: deeper layers' counts mix in the
    per-layer guesses, which never reach layer 0)."""
    layer0 = rt.stats().per_layer[0]
    n, hits = layer0["prefetched"], layer0["prefetch_hits"]
    return {"layers": rt.policy.draft_guess_layers if rt.prefetching else 0,
            "layer0_guessed": n, "layer0_hits": hits,
            "layer0_precision": round(hits / n, 4) if n else None}


def _run_one(args: argparse.Namespace, sizes: list[int], console) -> dict:
    """One cap (args.vram, bytes): prefill and decode measured, as one JSON object."""
    from loaders import open_model
    from moe_offload import RoutingRecorder, open_runtime
    from moe_offload import TraceParams, make_trace, routing_stats, trace_stats
    if args.prefetch_k is not None and args.prefetch_k < 1:
        raise CLIError(f"--prefetch-k {args.prefetch_k}: guess at least 1 expert a token, or "
                       "turn guessing off with --no-prefetch")
    if args.draft_guess_layers is not None and args.draft_guess_layers < 0:
        raise CLIError(f"--draft-guess-layers {args.draft_guess_layers}: give 0 (off) or more "
                       "first layers to guess while drafting")
    if not torch.cuda.is_available():
        raise CLIError("ftpatch bench measures under a VRAM cap on a CUDA GPU, and none is visible "
                       f"here; for the CPU alone: ftpatch bench {args.model} --device cpu")
    vram = args.vram
    t0 = time.perf_counter()
    loaded = open_model(args.model)
    c = loaded.config
    if max(sizes + [16 + args.gen]) > args.ctx:
        raise CLIError(f"a {max(sizes)}-token prompt needs --ctx {max(sizes)} or more")
    policy = POLICY.with_(fetch_fraction=args.fetch_fraction, prefetch=not args.no_prefetch,
                          prefetch_k=args.prefetch_k, prefill_chunk=args.chunk,
                          draft_guess_layers=args.draft_guess_layers,
                          elastic=not args.no_elastic, overlap_misses=not args.no_overlap)
    asked = getattr(args, "kv_type", "auto")
    kv = kv_type_for(args, loaded, args.ctx, vram=vram)   # this cap's (--vram may list several)
    args.kv_type = asked      # the next cap resolves auto for itself
    with console.status("loading (experts to pinned host RAM, dense weights to the GPU)..."):
        args.draft = [d for d in args.draft if d != 0]   # 0 is the plain run beside anyway
        rt = open_runtime(loaded, vram, policy=policy, ctx=args.ctx, profile=args.profile,
                          use_graphs=not args.no_graphs, mtp_experts=args.mtp_experts,
                          kv_type=kv, **placement_options(args))
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    dev = rt.device
    result: dict = {
        "machine": {"gpu": torch.cuda.get_device_name(dev), "host": platform.node(),
                    "cpu_threads": args.threads or torch.get_num_threads(),
                    "link_gbps_emulated": args.link_gbps},
        "model": {"path": args.model, "name": loaded.metadata.get("general.name"),
                  "synthetic": "ftpatch.synth.preset" in loaded.metadata},
        "vram_cap": vram, "ctx": args.ctx, "load_s": round(load_s, 2),
        "load_breakdown_s": {k: round(v, 2) for k, v in rt.report.seconds.items()},
        "budget": rt.report.budget, "elastic": rt.report.elastic, "policy": policy.as_dict(),
        "settings": {k: v for k, v in settings_dict(policy).items() if k != "offload"},
        "slots_per_layer": {"prefill": rt.report.slots_per_layer[0],
                            "decode": rt.report.decode_slots_per_layer[0]},
        "pinned": rt.report.pinned, "host_weights": rt.report.host_weights,
        "cpu_repacked_bytes": rt.report.cpu_repacked_bytes,
        "kv": _kv_report(rt, c, kv, args.ctx, asked),
    }
    console.print(_kv_line(result["kv"]))
    trace_params = None
    if args.trace:
        tp = TraceParams(**{k: v for k, v in (("repeat", args.trace_repeat),
                                              ("skew", args.trace_skew)) if v is not None})
        trace = make_trace(args.gen + 32, c.n_layer, c.n_expert, c.n_expert_used, tp)
        rt.replay(trace)
        result["regime"] = tp.label()
        result["trace_stats"] = trace_stats(trace, c.n_expert).as_dict()
        trace_params = tp
    else:
        result["regime"] = "model routing (synthetic weights: near-uniform)" \
            if result["model"]["synthetic"] else "model routing"

    # -- prefill -------------------------------------------------------------------------------
    for n in sizes:
        rt.reset_stats()
        times = []
        for r in range(args.reps + 1):
            st = rt.new_state(1, args.ctx)
            toks = torch.from_numpy(rng.integers(0, c.n_vocab, (1, n))).to(dev)
            _sync()
            t = time.perf_counter()
            logits = rt.prefill(toks, st)
            _sync()
            if r:  # the first run warms up
                times.append(n / (time.perf_counter() - t))
            if r < args.reps:
                del st, logits
        result[f"pp{n}"] = _spread(times)
        result[f"pp{n}"]["streamed_experts_per_run"] = rt.stats().prefill_streamed // (args.reps + 1)
        after = _decode_after(rt, logits, st, args.gen, args.ctx - n - 1)
        if after is not None:
            result[f"pp{n}"]["tg_after"] = after
        del st, logits
        console.print(f"pp{n}: {statistics.median(times):.0f} tok/s (min {min(times):.0f}, "
                      f"max {max(times):.0f}, {args.reps} reps)"
                      + (f"; then tg{after['tokens']} at {n:,}: {after['tok_s']:.1f} tok/s"
                         if after else ""))

    # -- decode ---------------------------------------------------------------------------------
    tg, ttft = [], []
    recorder = rt.attach_recorder(RoutingRecorder(args.gen)) if trace_params is None else None
    for r in range(args.reps + 1):
        st = rt.new_state(1, args.ctx)
        toks = torch.from_numpy(rng.integers(0, c.n_vocab, (1, 16))).to(dev)
        _sync()
        t = time.perf_counter()
        logits = rt.prefill(toks, st)
        nxt = logits.argmax(-1)
        _sync()
        ttft.append(time.perf_counter() - t)
        if r == args.reps:
            rt.reset_stats()   # statistics of the last repetition: args.gen steps
        nxt, seconds = _decode_steps(rt, nxt, st, args.gen)
        if r:
            tg.append(args.gen / seconds)
    result[f"tg{args.gen}"] = _spread(tg)
    result["ttft_s"] = _spread(ttft[1:])
    stats = rt.stats().as_dict()
    per_tok = max(1, args.gen)
    result["cache"] = {
        "hit_rate": round(stats["hit_rate"], 4), "slots_per_layer": stats["cache_slots"][0],
        "kv_MB": round(stats["kv_bytes"] / 1e6, 1),   # elastic KV mapped (0: allocated whole)
        "experts_per_layer": c.n_expert,
        "pcie_MB_per_token": round(stats["pcie_bytes"] / per_tok / 1e6, 2),
        "fetched_per_token": round(stats["fetched"] / per_tok, 2),
        "cpu_experts_per_token": round(stats["cpu"] / per_tok, 2),
        "cpu_ms_per_token": round(stats["cpu_expert_s"] / per_tok * 1e3, 3),
        "fetch_fraction": round(stats["fetch_fraction"], 3), "min_fetch": stats["min_fetch"],
        "rates": stats["rates"],
        "prefetch": rt.prefetching,
        "guessing_changes": rt.guessing_changes,   # starts and stops after start-up
        "prefetched_per_token": round(stats["prefetched"] / per_tok, 2),
        "prefetch_precision": round(stats["prefetch_precision"], 4),
        "prefetch_recall": round(stats["prefetch_recall"], 4),
    }
    if trace_params is None:
        result["routing_stats"] = routing_stats(recorder.numpy(), c.n_expert).as_dict()
    if args.draft:
        from .bench_spec import speculative_tg, summary
        rt.attach_recorder(None)
        if trace_params is not None:
            # the trace by position: a verify step's tokens route as the decode steps at their
            # positions would, so plain and speculative runs see the same routing
            rt.replay(trace, by_position=True)
        runs = []
        for draft in args.draft:
            rt.reset_stats()
            runs.append(speculative_tg(
                rt, draft, gen=args.gen, reps=args.reps, n_vocab=c.n_vocab,
                new_state=lambda: rt.new_state(1, args.ctx), sync=_sync,
                phases=args.phase_times))
            runs[-1]["draft_guesses"] = draft_guess_stats(rt)
            console.print(summary(runs[-1]))
        result["speculative"] = runs[0] if len(runs) == 1 else runs
        result["mtp_experts"] = args.mtp_experts
    result["vram"] = rt.vram_peaks()
    result["prefill_memory"] = rt.prefill_memory[-8:]   # torch's use vs the elastic estimate
    console.print(f"tg{args.gen}: {statistics.median(tg):.1f} tok/s (min {min(tg):.1f}, max "
                  f"{max(tg):.1f}, {args.reps} reps); TTFT {statistics.median(ttft[1:]) * 1e3:.0f} ms; "
                  f"hit rate {stats['hit_rate']:.1%}; regime: {result['regime']}")
    if result["cache"]["prefetch"]:
        console.print(f"prefetch: {stats['prefetched'] / per_tok:.1f} experts/token guessed, precision "
                      f"{stats['prefetch_precision']:.1%}, recall {stats['prefetch_recall']:.1%}")
    v = result["vram"]
    cache = (f"expert cache {v['cache_peak'] / 2**30:.2f} GiB" if rt.report.cache_outside_torch else
             "expert cache included")
    console.print(f"VRAM peak: allocator {v['reserved_peak'] / 2**30:.2f} GiB reserved ({cache}; "
                  f"{stats['cache_slots'][0]} slots a layer now), nvidia-smi {(v['nvidia_smi_peak'] or 0) / 2**30:.2f} GiB (cap {vram / 2**30:.2f} GiB)")
    if args.save_profile:
        from moe_offload import save_profile
        save_profile(args.save_profile, rt.routing_counts(), str(loaded.metadata.get("general.name")))
    rt.close()
    return result


COMMANDS = {"bench": (add_parser, run)}
