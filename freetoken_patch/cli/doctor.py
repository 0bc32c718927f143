"""`ftpatch doctor`: what this machine can do, in a few seconds -- GPUs, driver, torch, the native
build, host RAM, page-locking, huge pages, CPU features -- and with a model, how it runs here: on
the GPU under a cap (the plan, as inspect --vram) or, without a usable GPU, on the CPU.

Every check reads the system or asks a library; none raises (a failed check is reported). The
exit status: 1 when a model was given and runs neither on this machine's GPU nor on its CPU, else 0.

Host RAM a model needs: on the GPU path, every routed expert in page-locked host RAM (the GPU's
cache holds copies) and what else stays on the host; on the CPU path, every weight (in the CPU's
repacked form where its type has one) and the KV and state for the context. Both plus the
process itself (PROCESS_BYTES). Without a model, the largest file is about MemTotal -
HOST_HEADROOM (experts are nearly all of a MoE file).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import resource
import shutil
import subprocess
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Check what this machine can do: the GPU(s) (compute capability, VRAM), driver and torch CUDA
versions, whether the native extensions are built and for which GPUs, host RAM and the largest
model it can host, the locked-memory limit and whether page-locking works, huge pages, and the CPU
features the kernels use. With a model: the plan for this machine's GPU (as inspect --vram) and a
command line to run it, or without a usable GPU the command for the CPU and the host RAM it needs.
Exit status 1 when a model is given and runs neither on the GPU nor on the CPU here.
"""

EPILOG = """\
examples:
  ftpatch doctor                     # this machine
  ftpatch doctor model.gguf          # and the plan for this model on this machine's GPU
  ftpatch doctor model.gguf --json   # one JSON object
"""

HOST_HEADROOM = 4 << 30     # host RAM kept for the OS, Python, torch and the page cache (a rule)
# Python, torch and the extensions: `ftpatch run` on the tiny synthetic model peaked at 262 MiB
# resident on the development machine, its weights 6 MiB of it
PROCESS_BYTES = 320 << 20
VRAM_KEEP = 256 << 20       # of the GPU's free memory, left to other programs in the suggestion
PIN_TEST_BYTES = 64 << 20   # the buffer page-locked through the CUDA extension
CPU_FLAGS = ("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "amx_tile")


def add_parser(sub) -> None:
    s = sub.add_parser("doctor", help="what this machine can do (GPU, RAM, pinning, build); "
                                      "with a model, its plan here",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", nargs="?", help="GGUF file, any shard of a split set, or a folder")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    s.add_argument("--ctx", type=int, metavar="N",
                   help="context length for the plan (default: as run and chat choose it, the "
                        "model's trained context up to 4096)")


# ---- the checks: each returns a JSON-ready dict and never raises ----------------------------------

def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (counts, e.g. HugePages_Total, as they are)."""
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        m = re.match(r"(\w+):\s+(\d+)(\s+kB)?", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def driver() -> dict[str, Any]:
    """The NVIDIA driver's version and the CUDA version it supports (None where absent)."""
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", _read("/proc/driver/nvidia/version"))
    version = m.group(1) if m else None
    if version is None and shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=5)
            version = r.stdout.split("\n")[0].strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    cuda = None
    try:
        lib, v = ctypes.CDLL("libcuda.so.1"), ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            cuda = f"{v.value // 1000}.{v.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return {"version": version, "cuda": cuda}


def build_record() -> dict[str, Any] | None:
    """native/_build.json, written by CMake when the package was built: whether the CUDA extension
    was built and why (None in a source tree, or a build older than the record)."""
    from importlib.resources import files
    try:
        d = json.loads(files("native").joinpath("_build.json").read_text())
    except (OSError, ValueError, ModuleNotFoundError):
        return None
    return d if isinstance(d, dict) else None


def cuda_build_text(cuda: dict[str, Any] | None, record: dict[str, Any] | None) -> str:
    """One line on the CUDA kernels of this build, with the reason recorded at build time."""
    why = (record or {}).get("cuda_reason")
    if cuda:
        return (f"built by nvcc {cuda['compiler']} for {', '.join(cuda['archs'])}"
                + (f" ({why})" if why else ""))
    if why:
        return f"not built: {why}; see docs/INSTALL.md"
    return "not built (no build record here: a source tree, or an older install; docs/INSTALL.md)"


def build() -> dict[str, Any]:
    from native import build_info
    out = build_info.summary()
    out["version"] = _version()
    out["record"] = build_record()
    return out


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ftpatch")
    except PackageNotFoundError:
        return None


def gpus(archs: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """torch's view, and per GPU: name, capability, VRAM, whether the kernels run on it."""
    import torch

    from native import build_info
    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "error": None}
    out: list[dict[str, Any]] = []
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            cc = (p.major, p.minor)
            try:
                free, total = torch.cuda.mem_get_info(i)
            except RuntimeError:
                free, total = None, p.total_memory
            out.append({"index": i, "name": p.name, "capability": f"{cc[0]}.{cc[1]}",
                        "vram_bytes": total, "free_bytes": free,
                        "kernels_run": bool(archs) and build_info.runs_on(archs, cc),
                        "problem": build_info.mismatch(p.name, cc, archs) if archs else
                        "the CUDA extension is not built"})
    except Exception as e:  # a broken driver or context: say so, go on
        info["error"] = f"{type(e).__name__}: {e}"
    return info, out


def pinning(gpu_usable: bool) -> dict[str, Any]:
    """RLIMIT_MEMLOCK, mlock of one page, and (with a usable GPU) the runtime's own pin_host."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    fmt = lambda v: None if v == resource.RLIM_INFINITY else v  # noqa: E731
    out: dict[str, Any] = {"memlock_soft": fmt(soft), "memlock_hard": fmt(hard),
                           "mlock": None, "cuda_pin": None, "cuda_pin_error": None}
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(1 << 16)
        ok = libc.mlock(buf, ctypes.c_size_t(1 << 16)) == 0
        if ok:
            libc.munlock(buf, ctypes.c_size_t(1 << 16))
        out["mlock"] = ok
    except (OSError, AttributeError):
        pass
    if gpu_usable:
        try:
            import torch

            from native import offload_native
            t = torch.empty(PIN_TEST_BYTES, dtype=torch.uint8)
            offload_native.pin_host(t)
            offload_native.unpin_host(t)
            out["cuda_pin"] = True
        except Exception as e:
            out["cuda_pin"], out["cuda_pin_error"] = False, str(e)
    return out


def huge_pages() -> dict[str, Any]:
    def chosen(path: str) -> str | None:
        m = re.search(r"\[(\w+)\]", _read(path))
        return m.group(1) if m else None
    mi = meminfo()
    return {"thp_enabled": chosen("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": chosen("/sys/kernel/mm/transparent_hugepage/defrag"),
            "hugepages_total": mi.get("HugePages_Total"),
            "hugepage_bytes": mi.get("Hugepagesize"),
            "anon_huge_bytes": mi.get("AnonHugePages")}


def cpu() -> dict[str, Any]:
    flags: set[str] = set()
    model = None
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        elif line.startswith("model name") and model is None:
            model = line.split(":", 1)[1].strip()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"model": model or platform.processor() or None, "machine": platform.machine(),
            "cores": os.cpu_count(), "usable_cores": usable,
            "features": {f: f in flags for f in CPU_FLAGS}}


def host_ram() -> dict[str, Any]:
    mi = meminfo()
    total, avail = mi.get("MemTotal", 0), mi.get("MemAvailable", 0)
    return {"total_bytes": total, "available_bytes": avail,
            "largest_model_bytes": max(0, total - HOST_HEADROOM),
            "rule": "every routed expert in page-locked host RAM, the dense part in VRAM; "
                    f"{HOST_HEADROOM >> 30} GiB left to the OS, the process and the page cache"}


def cpu_weight_bytes(model) -> int:
    """Host RAM the weights take on the CPU path: the file's bytes, or for a type the CPU repacks
    (moe_offload's repack_cpu_weights: not the embedding) the repacked form's."""
    from native import ops
    total = 0
    for w in model.weights.values():
        form = ops.cpu_form(w.qtype) if w.name != "token_embd.weight" and len(w.shape) in (2, 3) else None
        rows = 1
        for d in w.shape[:-1]:
            rows *= d
        total += rows * form.row_bytes(w.shape[-1]) if form else w.nbytes
    return total


def cpu_plan(model, path: str, n_ctx: int, ram: dict[str, Any]) -> dict[str, Any]:
    """The CPU path: every weight in host RAM, KV (float32 on the CPU) and state for n_ctx."""
    from moe_offload import kv_bytes_per_token, recurrent_state_bytes
    weights = cpu_weight_bytes(model)
    kv = kv_bytes_per_token(model, 4) * n_ctx + recurrent_state_bytes(model)
    need = weights + kv + PROCESS_BYTES
    reasons = []
    if model.problems:
        reasons.append(f"the file has problems ({len(model.problems)}; ftpatch inspect lists them)")
    avail = ram.get("available_bytes") or ram["total_bytes"]
    if need > avail:
        reasons.append(f"host RAM: it needs ~{need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB is available")
    return {"weight_bytes": weights, "kv_state_bytes": kv, "process_bytes": PROCESS_BYTES,
            "host_need_bytes": need, "runs": not reasons, "reasons": reasons,
            "command": f"ftpatch chat {path} --ctx {n_ctx}" if not reasons else None}


def model_plan(path: str, n_ctx: int | None, gpu: dict[str, Any] | None,
               ram: dict[str, Any]) -> dict[str, Any]:
    """The plan for this machine's GPU (inspect --vram's) and a suggested command line; the CPU's
    command where the GPU cannot run it."""
    from moe_offload import is_expert_tensor, plan_sketch

    from .model_args import context_size, open_model_named
    model = open_model_named(path, strict=False)
    n_ctx = context_size(n_ctx, model.config.n_ctx_train, allow_long=n_ctx is not None)
    expert_bytes = sum(w.nbytes for w in model.weights.values() if is_expert_tensor(w.name))
    vram = None
    if gpu is not None:
        free = gpu["free_bytes"] if gpu["free_bytes"] is not None else gpu["vram_bytes"]
        vram = max(0, free - VRAM_KEEP) // (256 << 20) * (256 << 20)   # in 256 MiB steps
    plan = plan_sketch(model, vram, n_ctx).as_dict() if vram else None
    host_need = expert_bytes + (plan["host_bytes"] if plan else 0) + PROCESS_BYTES
    reasons = []
    if model.problems:
        reasons.append(f"the file has problems ({len(model.problems)}; ftpatch inspect lists them)")
    if gpu is None:
        reasons.append("no CUDA GPU that torch can use")
    elif not gpu["kernels_run"]:
        reasons.append(gpu["problem"])
    if plan is not None and not plan["fits"]:
        reasons.append("the dense part does not fit the GPU's free memory (try --host-head)")
    if host_need > ram["total_bytes"]:
        reasons.append(f"host RAM: the experts need {host_need / 2**30:.1f} GiB, "
                       f"the machine has {ram['total_bytes'] / 2**30:.1f} GiB")
    gib = f"{vram / 2**30:g}GiB" if vram else None
    out = {"path": str(path), "n_ctx": n_ctx, "expert_bytes": expert_bytes,
           "host_need_bytes": host_need, "vram_bytes": vram, "plan": plan,
           "runs_on_gpu": not reasons, "reasons": reasons,
           "command": f"ftpatch chat {path} --vram {gib} --ctx {n_ctx}" if not reasons else None}
    out["cpu"] = None if out["runs_on_gpu"] else cpu_plan(model, str(path), n_ctx, ram)
    out["runs_here"] = out["runs_on_gpu"] or out["cpu"]["runs"]
    return out


def diagnose(model: str | None = None, n_ctx: int | None = None) -> dict[str, Any]:
    """Everything doctor reports, as one JSON-ready object."""
    b = build()
    archs = (b.get("cuda") or {}).get("archs", [])
    torch_info, gpu_list = gpus(archs)
    usable = next((g for g in gpu_list if g["kernels_run"]), None)
    ram = host_ram()
    out = {"build": b, "driver": driver(), "torch": torch_info, "gpus": gpu_list,
           "host_ram": ram, "pinning": pinning(usable is not None), "huge_pages": huge_pages(),
           "cpu": cpu()}
    if model is not None:
        out["model"] = model_plan(model, n_ctx, usable or (gpu_list[0] if gpu_list else None), ram)
    return out


# ---- the text view -------------------------------------------------------------------------------

def _gib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.1f} GiB" if n >= 1 << 30 else f"{n / 2**20:.0f} MiB"


def render(d: dict[str, Any]) -> str:
    b, t, drv = d["build"], d["torch"], d["driver"]
    lines = [f"ftpatch {b['version'] or '(source tree)'}"]
    cpu_b, cuda_b = b.get("cpu"), b.get("cuda")
    lines.append("  CPU kernels: " + (f"{cpu_b['isa']} (available: {', '.join(cpu_b['available'])})"
                                      if cpu_b else "not built (the torch reference runs)"))
    lines.append("  CUDA kernels: " + cuda_build_text(cuda_b, b.get("record")))
    lines.append(f"torch {t['torch']}, CUDA {t['torch_cuda'] or 'none (a CPU build)'}; driver "
                 f"{drv['version'] or 'none'}" + (f" (CUDA {drv['cuda']})" if drv["cuda"] else ""))
    if t["error"]:
        lines.append(f"  CUDA error: {t['error']}")
    for g in d["gpus"]:
        lines.append(f"GPU {g['index']}: {g['name']}, compute capability {g['capability']}, "
                     f"{_gib(g['vram_bytes'])} ({_gib(g['free_bytes'])} free); kernels "
                     + ("run on it" if g["kernels_run"] else f"do not run: {g['problem']}"))
    if not d["gpus"]:
        lines.append("GPU: none that torch can use")
    r = d["host_ram"]
    lines.append(f"host RAM: {_gib(r['total_bytes'])} ({_gib(r['available_bytes'])} available); "
                 f"largest model it can host ~{_gib(r['largest_model_bytes'])} ({r['rule']})")
    p = d["pinning"]
    lim = lambda v: "unlimited" if v is None else _gib(v) if v >= 1 << 30 else f"{v >> 10} KiB"  # noqa: E731
    pin = ("works" if p["cuda_pin"] else f"FAILED ({p['cuda_pin_error']})" if p["cuda_pin"] is False
           else "not tried (no usable GPU)")
    lines.append(f"page-locking: ulimit -l {lim(p['memlock_soft'])} (hard {lim(p['memlock_hard'])}), "
                 f"mlock {'works' if p['mlock'] else 'fails'}, CUDA pinning {pin}")
    if p["cuda_pin"] is False:
        lines.append("  without it the expert banks stay pageable: the GPU cannot read experts over "
                     "PCIe, so misses run on the CPU and prefill copies at ~19 GB/s instead of ~50")
    h = d["huge_pages"]
    lines.append(f"huge pages: transparent {h['thp_enabled'] or 'unknown'} (defrag "
                 f"{h['thp_defrag'] or 'unknown'}), {h['hugepages_total'] or 0} reserved, "
                 f"{_gib(h['anon_huge_bytes'])} in use" + (
                     "; the expert banks ask for 2 MiB pages with madvise: 'never' leaves them on "
                     "4 KiB pages" if h["thp_enabled"] == "never" else ""))
    c = d["cpu"]
    have = [f for f, on in c["features"].items() if on]
    lines.append(f"CPU: {c['model']}, {c['usable_cores']} of {c['cores']} cores usable; "
                 f"{', '.join(have) or 'none of ' + ', '.join(CPU_FLAGS)}")
    if "model" in d:
        m = d["model"]
        lines.append(f"model {m['path']}: experts {_gib(m['expert_bytes'])}; context "
                     f"{m['n_ctx']:,} tokens")
        if m["plan"]:
            pl = m["plan"]
            lines.append(f"  plan for {_gib(pl['vram_bytes'])} of VRAM (context {pl['n_ctx']:,}): "
                         f"dense {_gib(pl['dense_bytes'])}, KV {_gib(pl['kv_bytes'])}, workspaces "
                         f"{_gib(pl['workspace_bytes'])}; {pl['experts_fit']:,} of "
                         f"{pl['experts_total']:,} experts in VRAM "
                         f"({100 * pl['experts_fit_fraction']:.1f}%), {pl['decode_experts_fit']:,} "
                         f"while decoding")
        if m["runs_on_gpu"]:
            lines.append(f"  host RAM needed ~{_gib(m['host_need_bytes'])} (the experts and the "
                         f"process)")
            lines.append(f"  runs on the GPU here: {m['command']}")
        else:
            c = m["cpu"]
            lines.append("  not on the GPU here: " + "; ".join(m["reasons"]))
            lines.append(f"  on the CPU: host RAM needed ~{_gib(c['host_need_bytes'])} (weights "
                         f"{_gib(c['weight_bytes'])}, KV and state {_gib(c['kv_state_bytes'])}, "
                         f"the process {_gib(c['process_bytes'])})")
            lines.append(f"  runs on the CPU here: {c['command']}" if c["runs"] else
                         "  cannot run on the CPU here either: " + "; ".join(c["reasons"]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from .inputs import check_positive
    check_positive("--ctx", args.ctx)
    d = diagnose(args.model, args.ctx)
    print(json.dumps(d) if args.json else render(d))
    return 0 if "model" not in d or d["model"]["runs_here"] else 1


COMMANDS = {"doctor": (add_parser, run)}
