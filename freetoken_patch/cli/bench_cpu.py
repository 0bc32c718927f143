"""`ftpatch bench MODEL --device cpu`: prefill and decode throughput of the CPU-only path (every
weight in host RAM, native._cpu kernels on --threads cores), measured and reported like the GPU
bench (bench.py): warm-up, then the median of --reps repetitions with min and max, the same JSON
keys (ppN, tgN, ttft_s, machine, model, method). Runs on a machine without CUDA.
"""
from __future__ import annotations

import os
import platform
import statistics
import time

import numpy as np
import torch

from ..errors import CLIError


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "reps": len(xs),
            "all": [round(x, 2) for x in xs]}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _repacked(model) -> list[str]:
    """The repacked CPU forms the model's weights run in (none: the file's own)."""
    qs = [q for ex in getattr(model, "experts", ()) for q in (ex.gate, ex.up, ex.down)]
    qs += [q for blk in getattr(model, "blk", ()) for q in blk.values()] + [getattr(model, "head", None)]
    return sorted({q.qtype.name for q in qs if getattr(getattr(q, "qtype", None), "family", "") == "repacked"})


def run_one(args, sizes: list[int], console) -> dict:
    """Prefill at each size and decode, on the CPU, as one JSON object (bench.py's shape)."""
    from loaders import open_model
    from moe_offload import kv_bytes_per_token, open_backend, settings_dict
    from native import ops
    if ops._cpu is None:
        raise CLIError("bench --device cpu needs the CPU extension (native._cpu), which is not built")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise CLIError(f"--threads {threads}: give 1 or more threads")
    if threads:
        ops._cpu.set_threads(threads)
    # torch runs only the light parts (norms, attention, the conv); its own thread pool would
    # fight the kernels' pool for the same cores (measured: slower decode and prefill with both)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    loaded = open_model(args.model)
    c = loaded.config
    if max(sizes + [16 + args.gen]) > args.ctx:
        raise CLIError(f"a {max(sizes)}-token prompt needs --ctx {max(sizes)} or more")
    from .model_args import kv_type_for
    kv = kv_type_for(args, loaded, args.ctx, vram=None)   # every weight in host RAM
    with console.status("loading (weights stay memory-mapped in host RAM)..."):
        backend = open_backend(loaded, device="cpu", n_ctx=args.ctx,
                               cpu_repack=getattr(args, "cpu_repack", "auto"),
                               mtp=any(d != 0 for d in getattr(args, "draft", [])), kv_type=kv)
        model = backend.model
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    result: dict = {
        "machine": {"gpu": None, "device": "cpu", "cpu": _cpu_name(), "host": platform.node(),
                    "cpu_threads": ops._cpu.threads(), "torch_threads": torch.get_num_threads(),
                    "cores": os.cpu_count(), "isa": ops._cpu.isa(),
                    "threads_pinned": ops._cpu.threads_pinned(), "iq3s_grid": ops._cpu.iq3s_grid(),
                    "cpu_repacked": _repacked(model)},
        "model": {"path": args.model, "name": loaded.metadata.get("general.name"),
                  "synthetic": "ftpatch.synth.preset" in loaded.metadata},
        "device": "cpu", "vram_cap": None, "ctx": args.ctx, "load_s": round(load_s, 2),
        "kv": {"type": kv, "bytes_per_token": kv_bytes_per_token(c, kv)},
        "regime": "model routing (synthetic weights: near-uniform)"
        if "ftpatch.synth.preset" in loaded.metadata else "model routing",
        "settings": {k: v for k, v in settings_dict().items() if k != "offload"},
    }
    with torch.inference_mode():
        for n in sizes:
            times = []
            for r in range(args.reps + 1):
                st = backend.new_state(1, args.ctx)
                toks = torch.from_numpy(rng.integers(0, c.n_vocab, (1, n)))
                t = time.perf_counter()
                model.prefill(toks, st, chunk=args.chunk)
                if r:  # the first run warms up (pages of the memory-mapped file, the pool)
                    times.append(n / (time.perf_counter() - t))
                del st
            result[f"pp{n}"] = _spread(times)
            console.print(f"pp{n}: {statistics.median(times):.1f} tok/s (min {min(times):.1f}, "
                          f"max {max(times):.1f}, {args.reps} reps)")
        tg, ttft = [], []
        for r in range(args.reps + 1):
            st = backend.new_state(1, args.ctx)
            toks = torch.from_numpy(rng.integers(0, c.n_vocab, (1, 16)))
            t = time.perf_counter()
            nxt = model.prefill(toks, st).argmax(-1)
            ttft.append(time.perf_counter() - t)
            t = time.perf_counter()
            for _ in range(args.gen):
                nxt = model.decode(nxt, st).argmax(-1)
            if r:
                tg.append(args.gen / (time.perf_counter() - t))
        # which decode ran: one native call a token, or the per-op path (FTPATCH_DECODE_LOOP=0,
        # or a model the loop does not mirror)
        result["decode_path"] = model.decode_path(st)
    result[f"tg{args.gen}"] = _spread(tg)
    result["ttft_s"] = _spread(ttft[1:])
    console.print(f"tg{args.gen}: {statistics.median(tg):.2f} tok/s (min {min(tg):.2f}, max "
                  f"{max(tg):.2f}, {args.reps} reps); TTFT {statistics.median(ttft[1:]) * 1e3:.0f} ms; "
                  f"CPU {result['machine']['cpu_threads']} threads ({result['machine']['isa']}, "
                  f"{result['decode_path']} decode)")
    drafts = [d for d in getattr(args, "draft", []) if d != 0]   # 0: the plain run beside anyway
    if drafts:
        result.update(_speculative(args, loaded, backend, drafts, console))
    return result


def _speculative(args, loaded, backend, drafts: list, console) -> dict:
    """--draft on the CPU: plain against speculative greedy decoding with the file's MTP head,
    as the GPU bench reports it (bench_spec.speculative_tg)."""
    from .bench_spec import speculative_tg, summary
    runs = []
    with torch.inference_mode():
        for draft in drafts:
            runs.append(speculative_tg(backend, draft, gen=args.gen, reps=args.reps,
                                       n_vocab=loaded.config.n_vocab,
                                       new_state=lambda: backend.new_state(1, args.ctx),
                                       phases=getattr(args, "phase_times", False)))
            console.print(summary(runs[-1]))
    return {"speculative": runs[0] if len(runs) == 1 else runs}
