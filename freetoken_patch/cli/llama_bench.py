"""The user's `llama-bench` at a VRAM cap: the `--n-cpu-moe` that fits, the run, its VRAM peak.

    fit_n_cpu_moe(model, cap, n_ctx) -> {"n_cpu_moe": N, "estimate": bytes by part}
    LlamaBench(binary, model_path, model, prompt_sizes, gen, reps).run_at(cap, threads) -> dict

llama.cpp keeps the experts of the first N layers on the CPU (`--n-cpu-moe N`, every layer
otherwise on the GPU with `-ngl 99`). The N for a cap is the smallest whose estimated GPU part
(`llama_gpu_bytes`: dense weights, experts of layers N.., KV and state, compute buffer, CUDA
context; moe_offload.offload.placement's arithmetic) is under the cap. nvidia-smi is polled while it runs
(`VramPoll`); a peak over the cap retries with N + 1, and every attempt is kept. On the H200 the
estimate picks the N of the measured anchors (23 / 29 / 35 at 8 / 6 / 4 GiB, docs/BENCHMARKS.md).
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


def size_text(n: int) -> str:
    """8 GiB, 700 MiB: a cap as --vram takes it."""
    return f"{n / GiB:g} GiB" if n >= GiB else f"{n / MiB:g} MiB"


# -- the --n-cpu-moe that fits a cap ------------------------------------------------------------------

def llama_gpu_bytes(model, n_cpu_moe: int, n_ctx: int, n_ubatch: int = LLAMA_UBATCH) -> dict:
    """Estimated VRAM of llama.cpp with every layer on the GPU (-ngl 99) and the experts of the
    first `n_cpu_moe` layers on the CPU. The token embedding stays in host RAM (llama.cpp keeps
    the input embedding on the CPU); the compute buffer is the logits of one micro-batch plus its
    activations. Bytes by part, and their "total"."""
    from moe_offload import (CUDA_CONTEXT_MEASURED, expert_bytes_per_layer, is_expert_tensor,
                             kv_bytes_per_token, recurrent_state_bytes)
    c = model.config
    dense = sum(w.nbytes for w in model.weights.values()
                if not is_expert_tensor(w.name) and w.name != "token_embd.weight")
    per_expert = expert_bytes_per_layer(model)                  # layer -> bytes of one expert
    experts = sum(b * c.n_expert for layer, b in per_expert.items() if layer >= n_cpu_moe)
    kv = kv_bytes_per_token(model) * n_ctx
    state = recurrent_state_bytes(model)
    ub = min(n_ubatch, n_ctx)
    compute = c.n_vocab * ub * 4 + 24 * ub * c.n_embd * 4 + 4 * ub * c.n_expert_used * c.n_ff_exp * 4
    context = CUDA_CONTEXT_MEASURED or LLAMA_CONTEXT_FALLBACK
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
    from moe_offload import expert_bytes_per_layer
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


def llama_rows(text: str) -> list[dict]:
    """llama-bench -o json's list of test objects (lines a build prints before it: skipped)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("[")), 0)
    rows = json.loads("\n".join(lines[start:]))
    if not isinstance(rows, list):
        raise ValueError("llama-bench's JSON is not a list of tests")
    return rows


def parse_llama_json(text: str) -> dict:
    """llama-bench -o json -> {"pp512": spread, "tg128": spread, ...} from each test's
    samples_ts (avg_ts alone when samples are absent)."""
    tests = {}
    for r in llama_rows(text):
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
            att["raw"] = llama_rows(out)
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
            self.log(f"llama-bench at {size_text(cap)}: {res['error']}")
            return res
        while n <= fit["n_layers"]:
            self.log(f"llama-bench at {size_text(cap)}: --n-cpu-moe {n}")
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
