"""Several VRAM caps in one `ftpatch bench` call, with llama.cpp's `llama-bench` beside ours.

    run_caps(caps, measure, llama=None) -> dict          the JSON of a multi-cap run
        measure(cap) -> dict                             our result at one cap (bench.py)
        llama: llama_bench.LlamaBench | None             the user's llama-bench at each cap
    run_cli(args, sizes, console, run_one) -> int        `ftpatch bench MODEL` after its checks

At each cap ours runs first, then llama-bench on the same file with the same prompt sizes, decode
length, repetitions and threads, and the `--n-cpu-moe` that fits the cap (llama_bench.py). A
missing or failing llama-bench costs one line on the console and an "error" in the JSON; our own
numbers are written all the same. Nothing here needs a GPU: `measure` is injected, so tests run
it with stand-ins.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from typing import Callable

from .llama_bench import LlamaBench, size_text


# -- several caps, ours and theirs interleaved -------------------------------------------------------------

def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def compare(ours: dict, theirs: dict | None) -> dict:
    """Per test (pp N, tg N) the two medians and ours / theirs."""
    tests = sorted(k for k in ours if k[:2] in ("pp", "tg") and k[2:].isdigit())
    out = {"vram_cap": ours.get("vram_cap"), "regime": ours.get("regime"), "tests": {}}
    if theirs and theirs.get("n_cpu_moe") is not None:
        out["llama_n_cpu_moe"] = theirs["n_cpu_moe"]
    for t in tests:
        o = ours[t]["median"]
        l_ = ((theirs or {}).get("tests") or {}).get(t, {}).get("median")
        out["tests"][t] = {"ours": o, "llama": l_, "ratio": ratio(o, l_)}
    return out


def run_caps(caps: list[int], measure: Callable[[int], dict], llama: LlamaBench | None = None,
             log: Callable[[str], None] = print,
             progress: Callable[[dict], None] | None = None) -> dict:
    """Ours at each cap, then llama-bench at that cap; one JSON object for the whole run.
    progress(partial) gets the object so far after each cap (bench writes --out with it)."""
    from ..errors import CLIError
    runs, theirs, failed = [], [], None
    for cap in caps:
        log(f"-- cap {size_text(cap)}: ftpatch")
        try:
            r = measure(cap)
        except CLIError:
            raise                      # the call itself is wrong (no GPU, a bad flag): stop
        except Exception as e:         # this cap failed (does not fit, ...): the others still run
            failed = e
            r = {"vram_cap": cap, "error": f"{type(e).__name__}: {e}"}
            log(f"cap {size_text(cap)}: {r['error']}")
        runs.append(r)
        if llama is not None:
            threads = int((r.get("machine") or {}).get("cpu_threads") or os.cpu_count() or 1)
            theirs.append(llama.run_at(cap, threads))
        if progress is not None:
            progress(_assemble(caps, runs, theirs, llama))
    if not any("error" not in r for r in runs) and failed is not None:
        raise failed
    return _assemble(caps, runs, theirs, llama)


def _assemble(caps: list[int], runs: list[dict], theirs: list, llama: LlamaBench | None) -> dict:
    ok = [r for r in runs if "error" not in r]
    first = ok[0] if ok else {}
    out = {"kind": "ftpatch-bench-caps", "caps": list(caps),
           "machine": first.get("machine"), "model": first.get("model"),
           "regime": first.get("regime"), "runs": list(runs)}
    if llama is not None:
        out["llama_bench"] = {"binary": llama.binary, "error": llama.error,
                              "runs": [t for t in theirs if t is not None]}
        out["comparison"] = [compare(o, t) for o, t in zip(runs, theirs) if "error" not in o]
    return out


# -- the command line (bench.py hands over here) ---------------------------------------------------------

def run_info() -> dict:
    """When, with which command, and from which commit of ftpatch (if it runs from a checkout)."""
    import datetime
    import sys
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": shlex.join(["ftpatch", *sys.argv[1:]])}
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=5)
        if rev.returncode == 0 and rev.stdout.strip():
            info["commit"] = rev.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def method_of(args, sizes: list[int]) -> dict:
    """How each figure was measured (the page and the README state it from here)."""
    return {"warmup_runs": 1, "reps": args.reps, "statistic": "median of the reps, with min and max",
            "prompt_sizes": sizes, "gen": args.gen, "decode_prompt_tokens": 16, "ctx": args.ctx,
            "chunk": args.chunk,
            "pp": "N random prompt tokens / prefill wall time",
            "tg": "N greedy decode steps / their wall time, after a 16-token prompt (TTFT apart)",
            "llama_bench": "median, min and max of samples_ts (its -r repetitions after its warm-up)"}


def _release_gpu() -> None:
    """Between caps: what torch still caches goes back, and the peaks start again."""
    import gc
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    except ImportError:
        pass


def write_result(args, result: dict) -> None:
    if args.json:
        print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def run_cli(args, sizes: list[int], console, run_one) -> int:
    """`ftpatch bench MODEL`: one cap as before, or several caps and llama-bench beside them.
    run_one(args, sizes, console) -> dict measures one cap (args.vram)."""
    import argparse
    caps = args.vram if isinstance(args.vram, list) else [args.vram]

    def log(msg: str) -> None:
        console.print(msg, markup=False, highlight=False, soft_wrap=True)

    def measure(cap: int) -> dict:
        one = argparse.Namespace(**vars(args))
        one.vram = cap
        try:
            return run_one(one, sizes, console)
        finally:
            _release_gpu()

    info, method = run_info(), method_of(args, sizes)
    if len(caps) == 1 and not args.compare_llama_bench:
        result = measure(caps[0])
        result.update(method=method, run=info)
        write_result(args, result)
        return 0
    llama = None
    if args.compare_llama_bench:
        from loaders import open_model
        llama = LlamaBench(binary=args.compare_llama_bench, model_path=args.model,
                           model=open_model(args.model), prompt_sizes=sizes, gen=args.gen,
                           reps=args.reps, extra=shlex.split(args.llama_bench_args), log=log)
        llama.available()
    def progress(partial: dict) -> None:       # a run cut short keeps the caps it finished
        if args.out:
            partial.update(method=method, run=info, complete=False)
            with open(args.out, "w") as f:
                json.dump(partial, f, indent=1)
    result = run_caps(caps, measure, llama, log, progress)
    result.update(method=method, run=info)
    write_result(args, result)
    for row in result.get("comparison", []):
        parts = [f"{t} {v['ratio']:.2f}x" for t, v in row["tests"].items() if v["ratio"]]
        if parts:
            log(f"cap {size_text(row['vram_cap'])}, ours / llama.cpp (--n-cpu-moe "
                f"{row.get('llama_n_cpu_moe')}): " + ", ".join(parts))
    return 0
