"""`ftpatch bench kernels`: matrix-vector throughput per quant type on the CPU and the GPU, next to
the memory bandwidth measured in the same run, plus the expert-pool MoE decode path.

Method (printed by --help):
  * Shapes are H x O (input features x output rows, y[T, O] = x[T, H] @ W[O, H]^T), Qwen3.5-35B-A3B's:
    2048x512 expert gate/up, 512x2048 expert down, 2048x8192 and 4096x2048 dense projections,
    2048x248320 the output head. GB/s counts the weight bytes of one matrix per call.
  * GPU: native._cuda.matmul called directly (output preallocated), CUDA events around each call,
    median of --iters calls after --warmup. Every call reads a different copy of W out of a ring of
    copies larger than 3x the L2, so no call finds its weights in L2. Ceiling: a device-to-device
    copy of 1 GiB, (read + write bytes) / time, median of 5.
  * CPU: native.ops.matmul on CPU tensors (native._cpu, all cores unless --cpu-threads), wall time,
    median of --cpu-iters calls, copies rotated past 3x 64 MiB of cache, on each ISA of --cpu-isas
    (default: the one chosen at load; quant types multiply int8 activations on avx2 / avx512).
    Ceiling: a 1 GiB float32 torch.sum with all threads, read bytes / time. CPU prefill
    (--cpu-prefill-tokens, default 64; 0 skips): the same call with that many tokens (each weight
    row decoded once for all of them), weight GB/s and GFLOP/s.
  * Prefill (GPU, --prefill-tokens, default 512): native.ops.cuda_prefill_matmul = dequantize W to
    bf16 (native._cuda) + one cuBLAS GEMM, per shape, same timing; reported as time and weight GB/s
    next to the bf16 GEMM alone on an already dequantized W (the dequantize cost is the difference).
  * MoE: moe_ffn_pool (GPU; all E = 256 experts resident, identity slot map) and native.ops.moe_ffn
    (CPU) at T = 1, K = 8, H = 2048, F = 512; bytes = the 8 chosen experts' gate + up + down; a new
    random top-8 for every call. A type with a CPU repacked form (IQ3_S -> IQ3_S_N4) gets a
    second CPU row on that form: GB/s of the bytes it reads, and of the file type's bytes.
  * Weights are random valid blocks (loaders.quants.random_blocks), an 8 MiB pool tiled to size:
    throughput does not depend on the values.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import numpy as np
import torch

from loaders.quants import QUANT_TYPES, QuantType, quant_type, random_blocks

SHAPES = [(2048, 512, "expert gate/up"), (512, 2048, "expert down"), (2048, 8192, "projection"),
          (4096, 2048, "projection"), (2048, 248320, "output head")]
MOE = dict(E=256, H=2048, F=512, K=8)
MOE_TYPES = ["IQ3_S", "Q4_K", "Q6_K", "IQ4_XS", "Q8_0"]
POOL_BYTES = 8 << 20
HOST_CACHE = 64 << 20


def add_arguments(parser) -> None:
    """Options of the kernel benchmark (also usable as a group of `ftpatch bench`)."""
    if isinstance(parser, argparse._ArgumentGroup) and not parser.description:
        parser.description = "method: " + __doc__.split("Method (printed by --help):")[1].strip()

    def add(*names, **kw):
        try:
            parser.add_argument(*names, **kw)
        except argparse.ArgumentError:  # e.g. --json, already defined by `ftpatch bench`
            pass
    add("--types", help="comma-separated ggml types (default: all)")
    add("--shapes", help="HxO list, e.g. 2048x512,512x2048 (default: the five model shapes)")
    add("--tokens", type=int, default=1, help="tokens per matmul call, 1..8 (default 1)")
    add("--iters", type=int, default=20, help="timed GPU calls per point (default 20)")
    add("--warmup", type=int, default=3, help="untimed GPU calls first (default 3)")
    add("--cpu-iters", type=int, default=5, help="timed CPU calls per point (default 5)")
    add("--cpu-threads", type=int, default=0, help="CPU kernel threads (default: all cores)")
    add("--cpu-isas", help="CPU ISAs to measure, comma-separated, or 'all' (default: the active one)")
    add("--cpu-prefill-tokens", type=int, default=64,
        help="tokens of the CPU prefill point (default 64; 0 skips)")
    add("--prefill-tokens", type=int, default=512, help="tokens of the prefill point (0 skips)")
    add("--moe-types", help=f"types for the MoE path (default {','.join(MOE_TYPES)}; 'none' skips)")
    add("--no-cpu", action="store_true", help="GPU only")
    add("--no-gpu", action="store_true", help="CPU only")
    add("--json", action="store_true", help="print one JSON object")


def _types(text: str | None, default: list[str]) -> list[QuantType]:
    if not text:
        return [quant_type(n) for n in default]
    if text.strip().lower() == "none":
        return []
    return [quant_type(n.strip()) for n in text.split(",") if n.strip()]


def _shapes(text: str | None) -> list[tuple[int, int, str]]:
    if not text:
        return SHAPES
    known = {(h, o): what for h, o, what in SHAPES}
    out = []
    for item in text.split(","):
        h, o = (int(v) for v in item.lower().split("x"))
        out.append((h, o, known.get((h, o), "custom")))
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Ring:
    """`n` copies of a [rows, row_bytes] weight, each starting on a 256-byte and block boundary."""

    def __init__(self, q: QuantType, rows: int, cols: int, min_total: int, device: str,
                 pool: torch.Tensor):
        self.q, self.rows, self.cols = q, rows, cols
        self.row_bytes = q.row_bytes(cols)
        self.bytes = rows * self.row_bytes
        unit = 256 * q.block_bytes // math.gcd(256, q.block_bytes)
        self.stride = -(-self.bytes // unit) * unit
        self.n = max(2, -(-min_total // self.stride))
        self.buf = torch.empty(self.n * self.stride, dtype=torch.uint8, device=device)
        reps, k = self.buf.numel() // pool.numel(), pool.numel()
        if reps:
            self.buf[:reps * k].view(reps, k).copy_(pool.to(device).expand(reps, k))
        rest = self.buf.numel() - reps * k
        if rest:
            self.buf[reps * k:].copy_(pool[:rest].to(device))

    def view(self, i: int) -> torch.Tensor:
        off = (i % self.n) * self.stride
        return self.buf[off:off + self.bytes].view(self.rows, self.row_bytes)


def _pool(q: QuantType, rng: np.random.Generator) -> torch.Tensor:
    n = max(1, POOL_BYTES // q.block_bytes)
    return torch.from_numpy(random_blocks(q, n, rng).reshape(-1))


# ---- ceilings -----------------------------------------------------------------------------------

def device_copy_gbps() -> float:
    n = 1 << 28  # 1 GiB of float32
    src = torch.ones(n, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n * 4 / _median(times) / 1e9


def host_read_gbps() -> float:
    a = torch.ones(1 << 28)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        float(a.sum())
        times.append(time.perf_counter() - t)
    return a.numel() * 4 / _median(times[1:]) / 1e9


# ---- matmul points ------------------------------------------------------------------------------

def gpu_matmul(ext, ring: Ring, n_tok: int, iters: int, warmup: int) -> float:
    """Median seconds of one call."""
    x = torch.randn(n_tok, ring.cols, device="cuda")
    y = torch.empty(n_tok, ring.rows, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for i in range(warmup + iters):
        w = ring.view(i)
        if i >= warmup:
            events[i - warmup][0].record()
        ext.matmul(ring.q.type_id, w.data_ptr(), ring.rows, ring.cols, ring.row_bytes, x.data_ptr(),
                   n_tok, y.data_ptr(), stream)
        if i >= warmup:
            events[i - warmup][1].record()
    torch.cuda.synchronize()
    return _median([a.elapsed_time(b) / 1e3 for a, b in events])


def gpu_prefill(ring: Ring, n_tok: int, iters: int, warmup: int) -> tuple[float, float]:
    """Median seconds of dequantize + GEMM, and of the GEMM alone."""
    from native import ops
    x = torch.randn(n_tok, ring.cols, device="cuda")
    workspace = torch.empty(ring.rows * ring.cols * 2, dtype=torch.uint8, device="cuda")
    wt = workspace.view(torch.bfloat16).view(ring.rows, ring.cols)
    xb = x.to(torch.bfloat16)
    full, gemm = [], []
    for i in range(warmup + iters):
        w = ops.QTensor(ring.view(i), ring.q, (ring.rows, ring.cols))
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        ops.cuda_prefill_matmul(x, w, workspace)
        e[1].record()
        torch.mm(xb, wt.T)
        e[2].record()
        if i >= warmup:
            full.append(e)
    torch.cuda.synchronize()
    return (_median([a.elapsed_time(b) / 1e3 for a, b, _ in full]),
            _median([b.elapsed_time(c) / 1e3 for _, b, c in full]))


def cpu_matmul(ring: Ring, n_tok: int, iters: int) -> float:
    from native import ops
    x = torch.randn(n_tok, ring.cols)
    times = []
    with ops.cpu_threads_held(torch.device("cpu")):   # as in a forward: no wake-up in the timing
        for i in range(iters + 1):
            w = ops.QTensor(ring.view(i), ring.q, (ring.rows, ring.cols))
            t = time.perf_counter()
            ops.matmul(x, w)
            if i:
                times.append(time.perf_counter() - t)
    return _median(times)


# ---- MoE points ---------------------------------------------------------------------------------

def _moe_banks(q: QuantType, device: str, rng: np.random.Generator):
    E, H, F = MOE["E"], MOE["H"], MOE["F"]
    pool = _pool(q, rng)
    banks = []
    for rows, cols in ((F, H), (F, H), (H, F)):
        ring = Ring(q, E * rows, cols, 0, device, pool)
        banks.append((ring.view(0).view(E, rows, -1), rows, cols))
    return banks


def gpu_moe(ext, q: QuantType, iters: int, warmup: int, rng: np.random.Generator) -> tuple[float, int]:
    E, H, F, K = MOE["E"], MOE["H"], MOE["F"], MOE["K"]
    banks = _moe_banks(q, "cuda", rng)
    x = torch.randn(1, H, device="cuda")
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(warmup + iters)]).to(torch.int32).cuda()
    wts = torch.softmax(torch.randn(warmup + iters, K), -1).cuda()
    soe = torch.arange(E, dtype=torch.int32, device="cuda")
    y = torch.empty(1, H, device="cuda")
    skipped = torch.empty(1, K, dtype=torch.int32, device="cuda")
    scratch = torch.empty(ext.moe_scratch_bytes(1, K, F, H), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    args = [v for b, _, _ in banks for v in (q.type_id, b.data_ptr(), b[0].numel())]
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for i in range(warmup + iters):
        if i >= warmup:
            events[i - warmup][0].record()
        ext.moe_ffn_pool(x.data_ptr(), 1, H, F, ids[i].data_ptr(), wts[i].data_ptr(), K,
                         soe.data_ptr(), E, E, *args, y.data_ptr(), skipped.data_ptr(),
                         scratch.data_ptr(), scratch.numel(), stream)
        if i >= warmup:
            events[i - warmup][1].record()
    torch.cuda.synchronize()
    return _median([a.elapsed_time(b) / 1e3 for a, b in events]), K * sum(b[0].numel() for b, _, _ in banks)


def time_cpu_moe(banks: list, x: torch.Tensor, n_experts: int, k: int, iters: int,
                 warmup: int = 1) -> float:
    """Median wall time of native.ops.moe_ffn over CPU banks (gate, up, down QTensors) for one
    token x [1, H], a new random top-k of n_experts per call; the first `warmup` calls untimed."""
    from native import ops
    times = []
    with ops.cpu_threads_held(torch.device("cpu")):
        for i in range(iters + warmup):
            ids = torch.randperm(n_experts)[:k].view(1, k).to(torch.int32)
            w = torch.softmax(torch.randn(1, k), -1)
            t = time.perf_counter()
            ops.moe_ffn(x, *banks, ids, w)
            if i >= warmup:
                times.append(time.perf_counter() - t)
    return _median(times)


def cpu_moe(q: QuantType, iters: int, rng: np.random.Generator,
            repacked: bool = False) -> tuple[float, int]:
    """(median s, bytes of the 8 experts) of the CPU MoE point; `repacked`: the banks in the
    CPU's repacked form of q (native.ops.repack_for_cpu), bytes of that form."""
    from native import ops
    E, H, F, K = MOE["E"], MOE["H"], MOE["F"], MOE["K"]
    banks = _moe_banks(q, "cpu", rng)
    qts = [ops.QTensor(b.reshape(E * rows, -1), q, (E, rows, cols)) for b, rows, cols in banks]
    if repacked:
        qts = [ops.repack_for_cpu(w) for w in qts]
    nbytes = K * sum(w.expert(0).data.numel() for w in qts)
    return time_cpu_moe(qts, torch.randn(1, H), E, K, iters), nbytes


# ---- run ----------------------------------------------------------------------------------------

def engines(args: argparse.Namespace, ops) -> tuple[bool, bool, list[str]]:
    """(GPU measured, CPU measured, why each one left out is)."""
    why: list[str] = []
    use_gpu = use_cpu = False
    if getattr(args, "no_gpu", False):
        why.append("GPU: skipped by --no-gpu")
    elif ops._cuda is None:
        why.append("GPU: the CUDA extension is not built, ftpatch --version says why")
    elif not torch.cuda.is_available():
        why.append("GPU: none visible to torch")
    else:
        use_gpu = True
    if getattr(args, "no_cpu", False):
        why.append("CPU: skipped by --no-cpu")
    elif ops._cpu is None:
        why.append("CPU: the CPU extension is not built")
    else:
        use_cpu = True
    return use_gpu, use_cpu, why


def run(args: argparse.Namespace, console) -> int:
    from native import ops  # loads the extensions and hands them the IQ tables
    types = _types(getattr(args, "types", None), list(QUANT_TYPES))
    moe_types = _types(getattr(args, "moe_types", None), MOE_TYPES)
    shapes = _shapes(getattr(args, "shapes", None))
    n_tok = int(getattr(args, "tokens", 1))
    if not 1 <= n_tok <= 8:
        from ..errors import CLIError
        raise CLIError("--tokens must be 1..8 (decode kernels)")
    use_gpu, use_cpu, why_not = engines(args, ops)
    if not (use_gpu or use_cpu):
        from ..errors import CLIError
        raise CLIError("bench kernels has nothing to measure here: " + "; ".join(why_not))
    console.print("measuring: " + " and ".join(
        what for what, on in (("GPU", use_gpu), ("CPU", use_cpu)) if on)
        + "".join(f"; {w}" for w in why_not))
    if use_cpu and getattr(args, "cpu_threads", 0):
        ops._cpu.set_threads(args.cpu_threads)
    iters, warmup = max(1, args.iters), max(0, args.warmup)
    cpu_iters = max(1, args.cpu_iters)
    rng = np.random.default_rng(0)
    result: dict = {"method": __doc__.split("Method (printed by --help):")[1].strip(),
                    "tokens": n_tok, "bandwidth": {}, "matmul": [], "moe": []}
    l2 = 0
    if use_gpu:
        props = torch.cuda.get_device_properties(0)
        l2 = int(getattr(props, "L2_cache_size", 50 << 20))
        result["device"] = {"name": props.name, "sms": props.multi_processor_count, "l2_bytes": l2}
        result["bandwidth"]["device_copy_GBps"] = device_copy_gbps()
    isas: list[str] = []
    if use_cpu:
        want = getattr(args, "cpu_isas", None)
        have = list(ops._cpu.available_isas())
        isas = [ops._cpu.isa()] if not want else have if want.strip() == "all" else \
            [i.strip() for i in want.split(",") if i.strip()]
        bad = [i for i in isas if i not in have]
        if bad:
            from ..errors import CLIError
            raise CLIError(f"--cpu-isas: {', '.join(bad)} not available here ({', '.join(have)})")
        result["host"] = {"cpu_threads": ops._cpu.threads(), "isa": isas[0], "isas": isas}
        result["bandwidth"]["host_read_GBps"] = host_read_gbps()
    cpu_pre = int(getattr(args, "cpu_prefill_tokens", 0) or 0)
    dev_bw = result["bandwidth"].get("device_copy_GBps")
    host_bw = result["bandwidth"].get("host_read_GBps")

    for q in types:
        pool = _pool(q, rng)
        accum = ops._cuda.matmul_accum().get(q.name) if use_gpu else None
        for h, o, what in shapes:
            if h % max(32, q.block_elems):
                continue
            point = {"type": q.name, "shape": f"{h}x{o}", "H": h, "O": o, "what": what,
                     "bytes": o * q.row_bytes(h), "accum": accum}
            if use_gpu:
                ring = Ring(q, o, h, 3 * l2, "cuda", pool)
                t = gpu_matmul(ops._cuda, ring, n_tok, iters, warmup)
                point.update(gpu_us=t * 1e6, gpu_GBps=ring.bytes / t / 1e9,
                             gpu_pct=100 * ring.bytes / t / 1e9 / dev_bw)
                n_pre = int(getattr(args, "prefill_tokens", 0) or 0)
                if n_pre > 0 and o * h <= (1 << 28):
                    t, tg = gpu_prefill(ring, n_pre, max(3, iters // 4), 1)
                    point.update(prefill_tokens=n_pre, prefill_us=t * 1e6, prefill_gemm_us=tg * 1e6,
                                 prefill_GBps=ring.bytes / t / 1e9,
                                 prefill_TFLOPs=2 * n_pre * o * h / t / 1e12)
                del ring
            if use_cpu:
                ring = Ring(q, o, h, 3 * HOST_CACHE, "cpu", pool)
                before = ops._cpu.isa()
                try:
                    for isa in isas:
                        ops._cpu.set_isa(isa)
                        t = cpu_matmul(ring, n_tok, cpu_iters)
                        cell = {"us": t * 1e6, "GBps": ring.bytes / t / 1e9,
                                "pct": 100 * ring.bytes / t / 1e9 / host_bw,
                                "accum": ops._cpu.accumulation(q.name)}
                        if cpu_pre > 0 and o * h <= (1 << 24):
                            t = cpu_matmul(ring, cpu_pre, max(1, cpu_iters // 2))
                            cell.update(prefill_tokens=cpu_pre, prefill_us=t * 1e6,
                                        prefill_GBps=ring.bytes / t / 1e9,
                                        prefill_GFLOPs=2 * cpu_pre * o * h / t / 1e9)
                        point.setdefault("cpu", {})[isa] = cell
                finally:
                    ops._cpu.set_isa(before)
                first = point["cpu"][isas[0]]
                point.update(cpu_us=first["us"], cpu_GBps=first["GBps"], cpu_pct=first["pct"])
                del ring
            result["matmul"].append(point)
    for q in moe_types:
        point = {"type": q.name, **MOE, "T": 1}
        if use_gpu:
            t, nbytes = gpu_moe(ops._cuda, q, iters, warmup, rng)
            point.update(bytes=nbytes, gpu_us=t * 1e6, gpu_GBps=nbytes / t / 1e9)
        if use_cpu:
            before = ops._cpu.isa()
            try:
                for isa in isas:
                    ops._cpu.set_isa(isa)
                    t, nbytes = cpu_moe(q, cpu_iters, rng)
                    point.setdefault("cpu", {})[isa] = {"us": t * 1e6, "GBps": nbytes / t / 1e9,
                                                        "pct": 100 * nbytes / t / 1e9 / host_bw}
            finally:
                ops._cpu.set_isa(before)
            first = point["cpu"][isas[0]]
            point.update(bytes=nbytes, cpu_us=first["us"], cpu_GBps=first["GBps"], cpu_pct=first["pct"])
        result["moe"].append(point)
        form = ops.cpu_form(q) if use_cpu else None
        if form is not None:   # the same point on the CPU's repacked form of the type
            rp = {"type": form.name, "repacked_from": q.name, **MOE, "T": 1}
            before = ops._cpu.isa()
            try:
                for isa in isas:
                    ops._cpu.set_isa(isa)
                    t, own = cpu_moe(q, cpu_iters, rng, repacked=True)
                    rp.setdefault("cpu", {})[isa] = {"us": t * 1e6, "GBps": own / t / 1e9,
                                                     "pct": 100 * own / t / 1e9 / host_bw,
                                                     "file_GBps": point["bytes"] / t / 1e9}
            finally:
                ops._cpu.set_isa(before)
            first = rp["cpu"][isas[0]]
            rp.update(bytes=own, cpu_us=first["us"], cpu_GBps=first["GBps"], cpu_pct=first["pct"])
            result["moe"].append(rp)
    if use_gpu:
        torch.cuda.empty_cache()

    if getattr(args, "json", False):
        print(json.dumps(result, indent=1))
    else:
        _print(result, console, use_gpu, use_cpu)
    return 0


def _num(v: float) -> str:
    return f"{v:.1f}" if v < 10 else f"{v:.0f}"


def _print(result: dict, console, use_gpu: bool, use_cpu: bool) -> None:
    from rich.table import Table
    bw = result["bandwidth"]
    head = []
    if use_gpu:
        head.append(f"GPU {result['device']['name']}: copy {bw['device_copy_GBps']:.0f} GB/s")
    if use_cpu:
        head.append(f"CPU {result['host']['cpu_threads']} threads ({result['host']['isa']}): "
                    f"read {bw['host_read_GBps']:.1f} GB/s")
    console.print("; ".join(head) + f"; T = {result['tokens']}")
    shapes = list(dict.fromkeys(p["shape"] for p in result["matmul"]))
    for side, on in (("gpu", use_gpu), ("cpu", use_cpu)):
        if not on:
            continue
        if side == "cpu":
            _print_cpu(result, console, shapes)
            continue
        t = Table(title=f"{side.upper()} matmul: GB/s of weights (% of the {side} ceiling), H x O")
        t.add_column("type")
        for s in shapes:
            t.add_column(s, justify="right")
        rows: dict[str, dict] = {}
        for p in result["matmul"]:
            rows.setdefault(p["type"], {})[p["shape"]] = p
        for name, cells in rows.items():
            acc = cells[next(iter(cells))].get("accum")
            label = f"{name} ({acc})" if acc and side == "gpu" else name
            t.add_row(label, *[f"{_num(cells[s][side + '_GBps'])} ({cells[s][side + '_pct']:.0f}%)"
                               if s in cells else "-" for s in shapes])
        console.print(t)
    pre = [p for p in result["matmul"] if "prefill_us" in p]
    if pre:
        t = Table(title=f"GPU prefill, T={pre[0]['prefill_tokens']}: dequantize to bf16 + cuBLAS, "
                        "us (GEMM alone us), TFLOP/s")
        t.add_column("type")
        for s in shapes:
            t.add_column(s, justify="right")
        rows = {}
        for p in pre:
            rows.setdefault(p["type"], {})[p["shape"]] = p
        for name, cells in rows.items():
            t.add_row(name, *[f"{cells[s]['prefill_us']:.0f} ({cells[s]['prefill_gemm_us']:.0f}) "
                              f"{cells[s]['prefill_TFLOPs']:.0f}" if s in cells else "-" for s in shapes])
        console.print(t)
    if result["moe"]:
        t = Table(title="MoE decode, T=1 K=8 H=2048 F=512: us per call (GB/s of the 8 experts; CPU: "
                        "% of the host's read bandwidth)")
        t.add_column("type")
        if use_gpu:
            t.add_column("GPU", justify="right")
        isas = result["host"]["isas"] if use_cpu else []
        for isa in isas:
            t.add_column(f"CPU {isa}", justify="right")
        for p in result["moe"]:
            cells = [f"{p['gpu_us']:.1f} ({_num(p['gpu_GBps'])})" if "gpu_us" in p else "-"] if use_gpu else []
            cells += [f"{c['us']:.1f} ({_num(c['GBps'])}, {c['pct']:.0f}%)"
                      + (f"; {_num(c['file_GBps'])} of {p['repacked_from']}'s" if "file_GBps" in c else "")
                      for c in (p["cpu"][i] for i in isas)]
            label = f"{p['type']} (CPU form of {p['repacked_from']})" if "repacked_from" in p else p["type"]
            t.add_row(label, *cells)
        console.print(t)


def _print_cpu(result: dict, console, shapes: list[str]) -> None:
    """One table per CPU ISA: decode GB/s (% of the host's read bandwidth), and prefill."""
    from rich.table import Table
    for isa in result["host"]["isas"]:
        pts = [p for p in result["matmul"] if isa in p.get("cpu", {})]
        t = Table(title=f"CPU matmul on {isa}, T={result['tokens']}: GB/s of weights (% of the cpu "
                        "ceiling), H x O; prefill: GB/s, GFLOP/s")
        t.add_column("type")
        for s in shapes:
            t.add_column(s, justify="right")
        rows: dict[str, dict] = {}
        for p in pts:
            rows.setdefault(p["type"], {})[p["shape"]] = p["cpu"][isa]
        for name, cells in rows.items():
            label = f"{name} ({cells[next(iter(cells))]['accum']})"
            t.add_row(label, *[(f"{_num(c['GBps'])} ({c['pct']:.0f}%)" +
                                (f"; {_num(c['prefill_GBps'])}, {c['prefill_GFLOPs']:.0f}"
                                 if "prefill_GBps" in c else ""))
                               if (c := cells.get(s)) else "-" for s in shapes])
        console.print(t)


def main(argv: list[str] | None = None) -> int:
    """Standalone: python -m freetoken_patch.cli.bench_kernels [options]."""
    from rich.console import Console
    p = argparse.ArgumentParser(prog="bench_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    return run(args, Console(highlight=False, stderr=args.json))


if __name__ == "__main__":
    raise SystemExit(main())
