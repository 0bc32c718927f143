"""Several VRAM caps in one `ftpatch bench` call, and llama.cpp's `llama-bench` beside ours.

    run_caps(caps, measure, llama=None) -> dict          the JSON of a multi-cap run
        measure(cap) -> dict                             our result at one cap (bench.py)
        llama: LlamaBench | None                         runs the user's llama-bench at each cap

At each cap ours runs first, then llama-bench on the same file with the same prompt sizes, decode
length, repetitions and threads, and the `--n-cpu-moe N` that fits the cap: the smallest N whose
GPU part (dense weights, experts of the layers N.., KV and state, compute buffer, CUDA context;
`llama_gpu_bytes`, from moe_offload.placement's arithmetic) is under the cap. nvidia-smi is
polled while llama-bench runs; a peak over the cap retries with N + 1, and every attempt is kept.

A missing or failing llama-bench costs one line on the console and an "error" in the JSON; our
own numbers are written all the same. Nothing here needs a GPU: `measure` and the nvidia-smi
command are injected, so tests run it with fakes.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

GiB = 1 << 30
MiB = 1 << 20
NVIDIA_SMI = "nvidia-smi"         # the command polled for a process's VRAM (tests point it at a fake)
LLAMA_UBATCH = 512                # llama-bench's default -ub: the compute buffer's token count
LLAMA_CONTEXT_FALLBACK = 680 * MiB  # CUDA context + cuBLAS, if placement no longer names it


# -- the --n-cpu-moe that fits a cap ------------------------------------------------------------------

def llama_gpu_bytes(model, n_cpu_moe: int, n_ctx: int, n_ubatch: int = LLAMA_UBATCH) -> dict:
    """Estimated VRAM of llama.cpp with every layer on the GPU (-ngl 99) and the experts of the
    first `n_cpu_moe` layers on the CPU. The token embedding stays in host RAM (llama.cpp keeps
    the input embedding on the CPU); the compute buffer is the logits of one micro-batch plus its
    activations. Bytes by part, and their "total"."""
    from moe_offload import placement as pl
    c = model.config
    dense = sum(w.nbytes for w in model.weights.values()
                if not pl.is_expert_tensor(w.name) and w.name != "token_embd.weight")
    per_expert = pl.expert_bytes_per_layer(model)                  # layer -> bytes of one expert
    experts = sum(b * c.n_expert for layer, b in per_expert.items() if layer >= n_cpu_moe)
    kv = pl.kv_bytes_per_token(model) * n_ctx
    state = pl.recurrent_state_bytes(model)
    ub = min(n_ubatch, n_ctx)
    compute = c.n_vocab * ub * 4 + 24 * ub * c.n_embd * 4 + 4 * ub * c.n_expert_used * c.n_ff_exp * 4
    context = getattr(pl, "CUDA_CONTEXT_MEASURED", None) or LLAMA_CONTEXT_FALLBACK
    parts = {"dense": dense, "experts": experts, "kv": kv, "state": state, "compute": compute,
             "context": context}
    parts["total"] = sum(parts.values())
    return parts


def fit_n_cpu_moe(model, cap: int, n_ctx: int, n_ubatch: int = LLAMA_UBATCH) -> dict:
    """The smallest N (0 .. expert layers) whose estimate is under `cap`, with that estimate;
    N is None when even every expert on the CPU does not fit."""
    layers = len(_expert_layers(model))
    for n in range(layers + 1):
        est = llama_gpu_bytes(model, n, n_ctx, n_ubatch)
        if est["total"] <= cap:
            return {"n_cpu_moe": n, "n_layers": layers, "estimate": est}
    return {"n_cpu_moe": None, "n_layers": layers, "estimate": llama_gpu_bytes(model, layers, n_ctx, n_ubatch)}


def _expert_layers(model) -> list[int]:
    from moe_offload.placement import expert_bytes_per_layer
    return sorted(expert_bytes_per_layer(model))


# -- nvidia-smi, polled for one process -----------------------------------------------------------------

class VramPoll:
    """Peak VRAM of process `pid` by nvidia-smi every `interval` s. Per process where nvidia-smi
    lists the pid; otherwise the whole device's use above what it was before the process started
    ("device" method). peak is None when nvidia-smi cannot be run."""

    def __init__(self, interval: float = 0.1):
        self.interval, self.pid = interval, None
        self.peak: int | None = None
        self.method: str | None = None
        self.baseline = self._device_used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _smi(*query: str) -> list[list[str]] | None:
        try:
            out = subprocess.run([NVIDIA_SMI, *query, "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode:
            return None
        return [[p.strip() for p in line.split(",")] for line in out.stdout.splitlines() if line.strip()]

    def _device_used(self) -> int | None:
        rows = self._smi("--query-gpu=memory.used")
        try:
            return sum(int(float(r[0])) for r in rows) * MiB if rows else None
        except ValueError:
            return None

    def sample(self) -> None:
        rows = self._smi("--query-compute-apps=pid,used_memory") or []
        for r in rows:
            if len(r) == 2 and r[0].isdigit() and int(r[0]) == self.pid:
                try:
                    self._note(int(float(r[1])) * MiB, "process")
                except ValueError:
                    pass
                return
        used = self._device_used()
        if used is not None and self.baseline is not None and self.method != "process":
            self._note(max(0, used - self.baseline), "device")

    def _note(self, val: int, method: str) -> None:
        if method == "process" and self.method == "device":
            self.peak = None          # a per-process figure replaces the device-wide one
        self.method = method
        self.peak = max(self.peak or 0, val)

    def start(self, pid: int) -> None:
        self.pid = pid
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self) -> int | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        return self.peak


# -- llama-bench ---------------------------------------------------------------------------------------

def spread_of(samples: list[float]) -> dict:
    """The statistic bench.py reports for ours: median, min, max of the repetitions."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "reps": len(samples), "all": [round(x, 2) for x in samples]}


def parse_llama_json(text: str) -> dict:
    """llama-bench -o json (a list of test objects) -> {"pp512": spread, "tg128": spread, ...}
    from each test's samples_ts (avg_ts alone when samples are absent)."""
    rows = json.loads(text)
    if not isinstance(rows, list):
        raise ValueError("llama-bench's JSON is not a list of tests")
    tests = {}
    for r in rows:
        n_p, n_g = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
        name = f"pp{n_p}" if n_g == 0 else f"tg{n_g}" if n_p == 0 else f"pp{n_p}+tg{n_g}"
        samples = r.get("samples_ts") or [r["avg_ts"]]
        tests[name] = spread_of([float(x) for x in samples])
        tests[name]["avg_ts"], tests[name]["stddev_ts"] = r.get("avg_ts"), r.get("stddev_ts")
    return tests


@dataclass
class LlamaBench:
    """The user's llama-bench, run on `model_path` at each cap. `model` is the LoadedModel for
    the budget arithmetic; `extra` are more llama-bench arguments (passed as they are)."""
    binary: str
    model_path: str
    model: object
    prompt_sizes: list[int]
    gen: int
    reps: int
    extra: list[str] = field(default_factory=list)
    timeout_s: float = 1800.0
    log: Callable[[str], None] = print
    error: str | None = None           # set once the binary is found missing or failing

    def available(self) -> bool:
        if self.error is None and not (shutil.which(self.binary) or
                                       (os.path.isfile(self.binary) and os.access(self.binary, os.X_OK))):
            self._fail(f"{self.binary} is not an executable file or a command on PATH")
        return self.error is None

    def _fail(self, why: str) -> None:
        self.error = why
        self.log(f"llama-bench: {why}; ftpatch's own numbers are written without the comparison")

    def command(self, n_cpu_moe: int, threads: int) -> list[str]:
        return [self.binary, "-m", self.model_path, "-p", ",".join(map(str, self.prompt_sizes)),
                "-n", str(self.gen), "-r", str(self.reps), "-t", str(threads), "-ngl", "99",
                "--n-cpu-moe", str(n_cpu_moe), "-o", "json", *self.extra]

    def run_once(self, n_cpu_moe: int, threads: int) -> dict:
        """One llama-bench call: its tests, the VRAM peak seen, its raw JSON rows."""
        cmd = self.command(n_cpu_moe, threads)
        poll = VramPoll()
        t = time.perf_counter()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            return {"n_cpu_moe": n_cpu_moe, "command": shlex.join(cmd), "error": f"cannot start: {e}"}
        poll.start(proc.pid)
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err = f"ran past {self.timeout_s:.0f} s\n{err}"
        peak = poll.stop()
        att = {"n_cpu_moe": n_cpu_moe, "command": shlex.join(cmd), "rc": proc.returncode,
               "wall_s": round(time.perf_counter() - t, 2), "vram_peak": peak,
               "vram_method": poll.method}
        if proc.returncode != 0:
            last = [ln for ln in (err or "").splitlines() if ln.strip()][-1:] or ["no message"]
            att["error"] = f"exited {proc.returncode}: {last[0].strip()[:300]}"
            return att
        try:
            att["tests"] = parse_llama_json(out)
            att["raw"] = json.loads(out)
        except (ValueError, KeyError, TypeError) as e:
            att["error"] = f"its output is not llama-bench JSON ({e})"
        return att

    def run_at(self, cap: int, threads: int) -> dict | None:
        """llama-bench at one cap: start at the estimated N; while the measured peak is over the
        cap, N + 1. None when the binary is missing or has failed before."""
        if not self.available():
            return None
        n_ctx = max(self.prompt_sizes + [self.gen])     # llama-bench's context: one test's tokens
        fit = fit_n_cpu_moe(self.model, cap, n_ctx)
        res = {"vram_cap": cap, "n_ctx_estimated": n_ctx, "threads": threads,
               "n_cpu_moe_estimated": fit["n_cpu_moe"], "n_layers": fit["n_layers"],
               "estimate": fit["estimate"], "attempts": []}
        n = fit["n_cpu_moe"]
        if n is None:
            res["error"] = (f"does not fit: every expert on the CPU is estimated at "
                            f"{fit['estimate']['total'] / GiB:.2f} GiB")
            self.log(f"llama-bench at {cap / GiB:g} GiB: {res['error']}")
            return res
        while n <= fit["n_layers"]:
            self.log(f"llama-bench at {cap / GiB:g} GiB: --n-cpu-moe {n}")
            att = self.run_once(n, threads)
            res["attempts"].append({k: v for k, v in att.items() if k != "raw"})
            if "error" in att:
                self._fail(att["error"])
                res["error"] = att["error"]
                return res
            over = att["vram_peak"] is not None and att["vram_peak"] > cap
            res["attempts"][-1]["over_cap"] = over
            if not over:
                res.update(n_cpu_moe=n, tests=att["tests"], vram_peak=att["vram_peak"],
                           vram_method=att["vram_method"], vram_checked=att["vram_peak"] is not None,
                           raw=att["raw"])
                return res
            n += 1
        res["error"] = "over the cap with every expert on the CPU"
        return res


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
             log: Callable[[str], None] = print) -> dict:
    """Ours at each cap, then llama-bench at that cap; one JSON object for the whole run."""
    from ..errors import CLIError
    runs, theirs, failed = [], [], None
    for cap in caps:
        log(f"-- cap {cap / GiB:g} GiB: ftpatch")
        try:
            r = measure(cap)
        except CLIError:
            raise                      # the call itself is wrong (no GPU, a bad flag): stop
        except Exception as e:         # this cap failed (does not fit, ...): the others still run
            failed = e
            r = {"vram_cap": cap, "error": f"{type(e).__name__}: {e}"}
            log(f"cap {cap / GiB:g} GiB: {r['error']}")
        runs.append(r)
        if llama is not None:
            threads = int((r.get("machine") or {}).get("cpu_threads") or os.cpu_count() or 1)
            theirs.append(llama.run_at(cap, threads))
    ok = [r for r in runs if "error" not in r]
    if not ok and failed is not None:
        raise failed
    first = ok[0] if ok else {}
    out = {"kind": "ftpatch-bench-caps", "caps": list(caps),
           "machine": first.get("machine"), "model": first.get("model"),
           "regime": first.get("regime"), "runs": runs}
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
    result = run_caps(caps, measure, llama, log)
    result.update(method=method, run=info)
    write_result(args, result)
    for row in result.get("comparison", []):
        parts = [f"{t} {v['ratio']:.2f}x" for t, v in row["tests"].items() if v["ratio"]]
        if parts:
            log(f"cap {row['vram_cap'] / GiB:g} GiB, ours / llama.cpp (--n-cpu-moe "
                f"{row.get('llama_n_cpu_moe')}): " + ", ".join(parts))
    return 0
