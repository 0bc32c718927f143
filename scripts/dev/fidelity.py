"""Model-level fidelity per quant type: logits of tiny synthetic qwen35moe files on CUDA and on
the CPU's int8 kernels against the exact path (the CPU's generic kernels: float32 math on the
file's own weights), beside the bars: ggml's arithmetic emulated on the CPU, and llama.cpp's own
CPU logits where a dump_logits binary is given.

    python scripts/dev/fidelity.py --out fidelity.json [--types Q8_0,Q6_K] [--seeds 0,1,2]
    python scripts/dev/fidelity.py --out cpu.json --seeds 0,1,2,3,4,5,6,7,8,9 --llama ./llama_logits

Modes (each against the CPU path, same file, same prompt):
  cuda-prefill   the prompt as one prefill (dense matmuls: dequantize + cuBLAS at the
                 library's PREFILL_DTYPE; experts: the int8-activation kernels)
  cuda-decode    the prompt token by token (every matmul through the int8-activation kernels)
  prefill-<dt>   cuda-prefill with PREFILL_DTYPE forced to bf16 / f16 / f32 (diagnosis)
  ggml-q8-emulated  CPU, every matmul with x rounded to int8 per 32 values (d = amax/127):
                 the bar of the CUDA path (native.numerics)
  cuda-emulated  CPU, the CUDA path's arithmetic emulated (native.numerics): its prediction
  ggml-cpu-emulated  CPU, every matmul as llama.cpp's CPU build does it (each weight type's own
                 activation type: q8_0, q8_1, q8_K, f16; native.numerics): the CPU path's bar
  cpu-prompt     the CPU's int8 kernels (the best ISA), the prompt as one prefill
  cpu-tokens     the same, token by token (decode)
  llama.cpp      (--llama BIN) llama.cpp's CPU logits of the prompt in one batch, its default
                 f16 KV cache; llama.cpp-f32kv with an f32 one. BIN: scripts/dev/llama_logits.cpp
                 built against a llama.cpp build (its header says how)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TYPES = ["F32", "F16", "IQ2_XXS", "IQ3_S", "IQ3_XXS", "Q2_K", "Q3_K", "Q4_K", "IQ4_XS", "Q6_K",
         "Q8_0", "mixed"]
MIXED = dict(type="IQ3_S", expert_type="IQ3_S", down_type="Q4_K", output_type="Q6_K")


def compare(got, ref) -> dict:
    import numpy as np
    a, b = got.double().reshape(-1, got.shape[-1]).cpu(), ref.double().reshape(-1, ref.shape[-1]).cpu()
    return {"top1": float((a.argmax(-1) == b.argmax(-1)).double().mean()),
            "corr": float(np.corrcoef(a.flatten().numpy(), b.flatten().numpy())[0, 1]),
            "max_abs": float((a - b).abs().max())}


def logits(model, toks, decode: bool = False):
    import torch
    with torch.inference_mode():
        state = model.new_state(1, toks.shape[1] + 8)
        if decode:
            return torch.stack([model.decode(toks[:, t], state)[0] for t in range(toks.shape[1])])
        return model.prefill(toks, state, all_logits=True)[0]


def llama_logits(binary: str, path: Path, toks: torch.Tensor, n_vocab: int, kv: str) -> torch.Tensor:
    """llama.cpp's CPU logits of the prompt `toks` [1, T] in one batch ([T, n_vocab] float32)."""
    with tempfile.TemporaryDirectory() as tmp:
        tok_file, out_file = Path(tmp) / "tokens.i32", Path(tmp) / "logits.f32"
        toks[0].to(torch.int32).numpy().tofile(tok_file)
        subprocess.run([binary, str(path), str(tok_file), str(out_file), kv, "2", "prompt"],
                       check=True, capture_output=True)
        return torch.from_numpy(np.fromfile(out_file, np.float32).reshape(toks.shape[1], n_vocab))


def per_matmul(seed: int = 0) -> None:
    from loaders.quants import QUANT_TYPES, dequantize_reference, random_tensor
    from native.numerics import GGML_CPU_ACTIVATION, ggml_cpu_matmul, q8_round
    print(f"CPU ISA {cpu_ext.isa()}; relative RMS error of y = x W^T, gaussian / wide-range x")
    print("| type | ggml CPU (activation) | int8 per 32 | ours (kernels) | ours / ggml |")
    print("|---|---|---|---|---|")
    for name, q in QUANT_TYPES.items():
        if q.family == "float":
            continue
        cells = {k: [] for k in ("ggml", "q8", "ours")}
        for kind in ("gauss", "range"):
            rng = np.random.default_rng([seed, q.type_id, kind == "range"])
            o, h, t = 64, 4 * max(32, q.block_elems), 8
            err = {k: 0.0 for k in cells}
            norm = 0.0
            for _ in range(8):
                raw = random_tensor(q, (o, h), rng)
                w = torch.from_numpy(dequantize_reference(raw, q, (o, h)).astype(np.float64))
                x = rng.standard_normal((t, h))
                if kind == "range":
                    x *= np.exp(1.5 * rng.standard_normal((1, h)))
                    x[rng.random((t, h)) < 0.002] *= 200.0
                x = x.astype(np.float32)
                xt = torch.from_numpy(x)
                ref = xt.double() @ w.T
                mins = None
                if GGML_CPU_ACTIVATION[name] == "q8_1":
                    m = raw.reshape(o, -1, q.block_bytes)[:, :, q.m_offset:q.m_offset + 2]
                    mins = torch.from_numpy(np.ascontiguousarray(m).view(np.float16)[..., 0].astype(np.float32))
                y = np.zeros((t, o), np.float32)
                cpu_ext.matmul(q.type_id, raw.ctypes.data, o, h, raw.shape[1], x.ctypes.data, t, y.ctypes.data, 0)
                for k, got in (("ggml", ggml_cpu_matmul(xt, w, name, mins)), ("q8", q8_round(xt) @ w.T),
                               ("ours", torch.from_numpy(y).double())):
                    err[k] += float((got - ref).pow(2).sum())
                norm += float(ref.pow(2).sum())
            for k in cells:
                cells[k].append((err[k] / norm) ** 0.5)
        ratio = " / ".join(f"{a / b:.3f}" for a, b in zip(cells["ours"], cells["ggml"]))
        fmt = lambda v: " / ".join(f"{e:.2e}" for e in v)  # noqa: E731
        print(f"| {name} | {fmt(cells['ggml'])} ({GGML_CPU_ACTIVATION[name]}) | {fmt(cells['q8'])} | "
              f"{fmt(cells['ours'])} ({cpu_ext.accumulation(name)}) | {ratio} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--tokens", type=int, default=20, help="prompt positions per file")
    ap.add_argument("--dir", default="/tmp/ftpatch-fidelity")
    ap.add_argument("--diagnose", action="store_true", help="also prefill at bf16 / f16 / f32")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU int8 kernels' modes")
    ap.add_argument("--schemes", default="ggml-cpu,ggml-q8,cuda", help="emulated schemes to run")
    ap.add_argument("--llama", default=None, help="scripts/dev/llama_logits.cpp, built")
    ap.add_argument("--per-matmul", action="store_true", help="the per-matmul table only (no --out)")
    ap.add_argument("--out")
    args = ap.parse_args()
    global cpu_ext, np, ops, torch   # the helpers above use them; imported after --help
    import numpy as np
    import torch

    from loaders import open_model
    from loaders.synth import SynthOptions, synthesize
    from moe_offload.models import build_model
    import native._cpu as cpu_ext
    from native import ops
    from native.numerics import emulate
    if args.per_matmul:
        per_matmul()
        return 0
    if not args.out:
        ap.error("--out is required (except with --per-matmul)")
    cuda = torch.cuda.is_available()
    best_isa = cpu_ext.isa()   # (the import above fails without the CPU extension)
    cpu_ext.set_isa("generic")  # the exact CPU path: float activations (avx2 / avx512 round)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.types.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            t0 = time.perf_counter()
            kw = dict(MIXED) if name == "mixed" else dict(type=name)
            path = Path(args.dir) / f"{name}-s{seed}.gguf"
            if not path.exists():
                synthesize(path, SynthOptions(seed=seed, **kw), threads=4)
            loaded = open_model(path)
            gen = torch.Generator().manual_seed(seed)
            toks = torch.randint(0, loaded.config.n_vocab, (1, args.tokens), generator=gen)
            cpu = build_model(loaded, "cpu")
            exact = logits(cpu, toks)
            row = {"type": name, "seed": seed}
            for scheme in [s for s in args.schemes.split(",") if s]:
                with emulate(scheme):
                    row[f"{scheme}-emulated"] = compare(logits(cpu, toks), exact)
            if not args.no_cpu and best_isa != "generic":
                cpu_ext.set_isa(best_isa)
                try:
                    row["cpu-prompt"] = compare(logits(cpu, toks), exact)
                    row["cpu-tokens"] = compare(logits(cpu, toks, decode=True), exact)
                finally:
                    cpu_ext.set_isa("generic")
            if args.llama:
                row["llama.cpp"] = compare(llama_logits(args.llama, path, toks, loaded.config.n_vocab, "f16"), exact)
                row["llama.cpp-f32kv"] = compare(
                    llama_logits(args.llama, path, toks, loaded.config.n_vocab, "f32"), exact)
            if cuda:
                gpu = build_model(loaded, "cuda")
                tc = toks.cuda()
                row["cuda-prefill"] = compare(logits(gpu, tc), exact)
                row["cuda-decode"] = compare(logits(gpu, tc, decode=True), exact)
                if args.diagnose:
                    saved = ops.PREFILL_DTYPE
                    for dt_name, dt in (("bf16", torch.bfloat16), ("f16", torch.float16),
                                        ("f32", torch.float32)):
                        ops.PREFILL_DTYPE = dt
                        row[f"prefill-{dt_name}"] = compare(logits(gpu, tc), exact)
                    ops.PREFILL_DTYPE = saved
                del gpu
                torch.cuda.empty_cache()
            rows.append(row)
            print(name, seed, {k: (round(v["top1"], 2), round(v["corr"], 5)) for k, v in row.items()
                               if isinstance(v, dict)}, f"{time.perf_counter() - t0:.1f}s", flush=True)
    Path(args.out).write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=1))
    # summary per type: mean over seeds
    modes = [k for k in rows[0] if isinstance(rows[0][k], dict)]
    print("\n| type | " + " | ".join(f"{m} top-1 / corr" for m in modes) + " |")
    for name in args.types.split(","):
        rs = [r for r in rows if r["type"] == name]
        cells = [f"{np.mean([r[m]['top1'] for r in rs]):.2f} / {np.mean([r[m]['corr'] for r in rs]):.5f}"
                 for m in modes]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
