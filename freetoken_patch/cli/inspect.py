"""`ftpatch inspect`: what a GGUF holds, what it costs, and how it would sit in a VRAM budget."""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import asdict
from typing import Any

from loaders import LoadedModel
from loaders.footprint import gib as _gib
from loaders.quants import QUANT_TYPES
from moe_offload import is_expert_tensor, plan_sketch

from .inputs import check_positive
from .model_args import open_model_named, size_arg

DESCRIPTION = """\
Describe a GGUF model: architecture, config, parameter count (total and active per token), bytes
by tensor class and type, per-layer table, kernel support, and with --vram a sketch of how it
would sit in that much GPU memory. The exit status is 1 if the file has problems (listed).
"""

EPILOG = """\
examples:
  ftpatch inspect model.gguf                       # tables
  ftpatch inspect model.gguf --vram 8GiB           # and how it fits an 8 GiB GPU
  ftpatch inspect model.gguf --vram 8GiB --ctx 32768
  ftpatch inspect model.gguf --vram 8GiB --ctx 131072 --kv-type q8_0
  ftpatch inspect model-00001-of-00003.gguf --json # any shard of a split set; one JSON object
"""


def add_parser(sub) -> None:
    s = sub.add_parser("inspect", help="describe a GGUF model: config, parameters, bytes, plan",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", help="GGUF file, any shard of a split set, or a folder")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    s.add_argument("--vram", type=size_arg, metavar="SIZE",
                   help="sketch the plan for this much VRAM (e.g. 8GiB)")
    s.add_argument("--ctx", type=int, metavar="N",
                   help="context length for the plan (default: as run and chat choose it, the "
                        "model's trained context up to 4096)")
    s.add_argument("--kv-type", choices=("auto", "f16", "q8_0", "q4_0"), default="auto",
                   help="the KV cache's type in the plan (default auto: what --vram runs pick "
                        "for the context, f16 while its KV leaves the expert cache its share)")


def tensor_class(name: str, aside: bool = False) -> str:
    """A coarse class for byte accounting."""
    if aside:
        return "mtp"
    if name.startswith("token_embd"):
        return "embedding"
    if name.startswith("output."):
        return "output head"
    if is_expert_tensor(name):
        return "routed experts"
    if "shexp" in name:
        return "shared expert"
    if "ffn_gate_inp" in name:
        return "router"
    if "norm" in name:
        return "norms"
    if "ssm_" in name or ".attn_gate" in name or (".attn_qkv" in name):
        return "delta-net"
    if ".attn_" in name:
        return "attention"
    return "other"


def parameter_counts(model: LoadedModel) -> tuple[int, int]:
    """(total trunk parameters, active per token): K/E of routed experts, one embedding row."""
    c = model.config
    total = active = 0
    for w in model.weights.values():
        n = w.n_elements
        total += n
        if is_expert_tensor(w.name):
            active += n // c.n_expert * c.n_expert_used
        elif w.name == "token_embd.weight":
            active += c.n_embd
        else:
            active += n
    if c.tied_output:
        active += model.weights["token_embd.weight"].n_elements - c.n_embd
    return total, active


def kernel_support() -> dict[str, dict[str, bool]]:
    """Which types the native kernels handle on each engine (reference handles all)."""
    try:
        from native import ops
        return ops.supported_types()
    except Exception:  # the native package may be partially built; report reference only
        return {name: {"reference": True, "cpu": False, "cuda": False} for name in QUANT_TYPES}


def cuda_engine() -> str:
    """The CUDA kernels here: "ready", "built, no GPU" (torch sees no device) or "not built"."""
    import importlib.util

    import torch
    if importlib.util.find_spec("native._cuda") is None:
        return "not built"
    return "ready" if torch.cuda.is_available() else "built, no GPU"


def describe(model: LoadedModel, vram: int | None = None, n_ctx: int | None = None,
             kv_type: str = "auto") -> dict[str, Any]:
    """Everything `inspect` shows, as one JSON-ready object. The plan's context: n_ctx, or the one
    `run` and `chat` choose (the trained context, up to their default)."""
    from .model_args import context_size
    c = model.config
    if n_ctx is None:
        n_ctx = context_size(None, c.n_ctx_train)
    total, active = parameter_counts(model)
    tensors = [{"name": w.name, "type": w.qtype.name, "shape": list(w.shape), "bytes": w.nbytes}
               for w in model.weights.values()]
    by_class: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for w in model.weights.values():
        by_class[tensor_class(w.name)][w.qtype.name] += w.nbytes
    for w in model.aside.values():
        by_class["mtp"][w.qtype.name] += w.nbytes
    layers = []
    for i in range(c.n_layer):
        pre = f"blk.{i}."
        ws = [w for n, w in model.weights.items() if n.startswith(pre)]
        exps = {w.name[len(pre):].replace("_exps.weight", ""): w.qtype.name
                for w in ws if is_expert_tensor(w.name)}
        layers.append({
            "layer": i, "kind": "delta-net" if c.recurrent[i] else "attention",
            "mixer_bytes": sum(w.nbytes for w in ws if not is_expert_tensor(w.name)
                               and "shexp" not in w.name and "ffn_gate_inp" not in w.name),
            "expert_bytes": sum(w.nbytes for w in ws if is_expert_tensor(w.name)),
            "expert_types": exps,
            "mixer_types": sorted({w.qtype.name for w in ws if w.shape and len(w.shape) > 1
                                   and not is_expert_tensor(w.name)}),
        })
    support = kernel_support()
    used_types = sorted({w.qtype.name for w in model.weights.values()})
    md = model.metadata
    out: dict[str, Any] = {
        "architecture": model.arch.name,
        "name": md.get("general.name"),
        "files": [str(p) for p in model.file.paths],
        "file_bytes": model.file.file_size,
        "gguf_version": model.file.version,
        "synthetic": "ftpatch.synth.preset" in md,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(c).items()},
        "parameters": total,
        "parameters_active": active,
        "parameters_mtp": sum(w.n_elements for w in model.aside.values()),
        "tensor_bytes": sum(w.nbytes for w in model.weights.values()),
        "bytes_by_class": {k: dict(v) for k, v in by_class.items()},
        "layers": layers,
        "types": {t: support.get(t, {}) for t in used_types},
        "cuda_engine": cuda_engine(),
        "tensors": tensors,
        "extra_tensors": [t.name for t in model.extras],
        "problems": model.problems,
    }
    out["memory"] = memory_estimate(model, n_ctx)
    if vram is not None:
        if kv_type == "auto":
            from moe_offload import auto_kv_type
            kv_type = auto_kv_type(model, vram, n_ctx)
        out["plan"] = plan_sketch(model, vram, n_ctx, kv_type=kv_type).as_dict()
        if n_ctx > c.n_ctx_train:
            out["notes"] = [f"--ctx {n_ctx} is past the {c.n_ctx_train:,} tokens the model was "
                            "trained for: run, chat and serve need --allow-long-ctx for it"]
    return out


def memory_estimate(model: LoadedModel, n_ctx: int) -> dict[str, Any]:
    """What running the model on the CPU takes beside its weights at context n_ctx (one
    sequence), the key that makes it largest, and whether this machine has it now."""
    from moe_offload import estimate_memory, host_room
    est = estimate_memory(model.config, n_ctx)
    room, limit = host_room()
    return {**est.as_dict(), "host_room_bytes": room, "host_room_limit": limit or None,
            "fits": room is None or est.total <= room,
            "fix": est.fix() if est.culprit is not None else None}


def render(d: dict[str, Any], console) -> None:
    """The human view of `describe`."""
    from rich.table import Table
    c = d["config"]
    title = f"[bold]{d['name'] or d['files'][0]}[/] — {d['architecture']}, GGUF v{d['gguf_version']}"
    console.print(title)
    if d["synthetic"]:
        console.print("[yellow]synthetic model: random weights (made by ftpatch synth)[/]")
    console.print(f"files: {', '.join(d['files'])} ({_gib(d['file_bytes'])})")
    console.print(
        f"parameters: [bold]{d['parameters']:,}[/] total, {d['parameters_active']:,} active per "
        f"token" + (f", MTP block {d['parameters_mtp']:,} kept aside" if d["parameters_mtp"] else ""))
    n_rec = sum(c["recurrent"])
    console.print(
        f"layers {c['n_layer']} ({n_rec} delta-net + {c['n_layer'] - n_rec} attention), "
        f"hidden {c['n_embd']}, vocab {c['n_vocab']:,}, experts {c['n_expert']} top-{c['n_expert_used']} "
        f"(ff {c['n_ff_exp']}, shared ff {c['n_ff_shexp']}), heads {c['n_head']}/{c['n_head_kv']} "
        f"x {c['head_dim']} (rope {c['n_rot']} dims, base {c['rope_base']:g}), context {c['n_ctx_train']:,}")
    t = Table(title="bytes by tensor class and type", show_lines=False)
    t.add_column("class")
    t.add_column("types")
    t.add_column("bytes", justify="right")
    for cls, types in sorted(d["bytes_by_class"].items(), key=lambda kv: -sum(kv[1].values())):
        t.add_row(cls, ", ".join(f"{k} {_gib(v)}" for k, v in sorted(types.items())),
                  _gib(sum(types.values())))
    t.add_row("[bold]total[/]", "", f"[bold]{_gib(d['tensor_bytes'])}[/]")
    console.print(t)
    lt = Table(title="layers")
    for col in ("layer", "kind", "mixer", "mixer types", "experts", "gate / up / down"):
        lt.add_column(col, justify="right" if col in ("layer", "mixer", "experts") else "left")
    for L in d["layers"]:
        et = L["expert_types"]
        lt.add_row(str(L["layer"]), L["kind"], _gib(L["mixer_bytes"]), ",".join(L["mixer_types"]),
                   _gib(L["expert_bytes"]),
                   " / ".join(et.get(k, "-") for k in ("ffn_gate", "ffn_up", "ffn_down"))
                   if "ffn_gate_up" not in et else f"{et['ffn_gate_up']} (fused) / {et.get('ffn_down')}")
    console.print(lt)
    kt = Table(title="kernels for the types in this file")
    for col in ("type", "reference", "CPU", "CUDA"):
        kt.add_column(col)
    yes = lambda b: "[green]yes[/]" if b else "[red]no[/]"  # noqa: E731
    engine = d.get("cuda_engine", "ready")
    for name, s in d["types"].items():
        cuda = yes(s.get("cuda", False)) if engine == "ready" else f"[yellow]{engine}[/]"
        kt.add_row(name, yes(s.get("reference", False)), yes(s.get("cpu", False)), cuda)
    console.print(kt)
    if d["extra_tensors"]:
        console.print(f"extra tensors (not used): {', '.join(d['extra_tensors'][:8])}")
    for p in d["problems"]:
        console.print(f"[red]problem:[/] {p}")
    for note in d.get("notes", ()):
        console.print(f"[yellow]note:[/] {note}")
    m = d["memory"]
    console.print(f"run-time memory beside the weights (CPU, context {m['n_ctx']:,}, estimated): "
                  f"delta-net state {_gib(m['state_bytes'])}, KV {_gib(m['kv_bytes'])}, largest "
                  f"prompt chunk {_gib(m['workspace_bytes'])}; total {_gib(m['total_bytes'])}")
    why = m["largest_because"]
    if not m["fits"]:
        console.print(f"  [red]more than this machine can give now ({_gib(m['host_room_bytes'])}, "
                      f"{m['host_room_limit']}): {m['fix'] or 'use a machine with more memory'}[/]")
    elif why is not None and why["key"] != "--ctx":
        console.print(f"  [yellow]note:[/] {m['fix']}")
    if "plan" in d:
        p = d["plan"]
        console.print(f"[bold]plan for {_gib(p['vram_bytes'])} of VRAM[/] (context {p['n_ctx']:,}):")
        console.print(f"  dense weights {_gib(p['dense_bytes'])} (+ {_gib(p['host_bytes'])} kept in "
                      f"host RAM), KV {p['kv_type']} {_gib(p['kv_bytes'])}, "
                      f"delta-net state {_gib(p['state_bytes'])}, "
                      f"workspaces + staging + CUDA context (est.) {_gib(p['workspace_bytes'])}")
        if not p["fits"]:
            console.print("  [red]the dense part does not fit: raise --vram, or keep the output head "
                          "in host RAM too (--host-head)[/]")
        console.print(f"  left for experts {_gib(p['expert_budget_bytes'])}: {p['experts_fit']:,} of "
                      f"{p['experts_total']:,} experts ({100 * p['experts_fit_fraction']:.1f}%), "
                      f"{_gib(p['expert_bytes_mean'])} each; while decoding a short conversation "
                      f"(the prefill workspace and the unused KV lent to the cache) "
                      f"{p['decode_experts_fit']:,}")


def show(path: str, as_json: bool, vram: int | None, n_ctx: int | None, console,
         kv_type: str = "auto") -> int:
    """Print `describe` as tables (or JSON); 1 when the model has problems."""
    model = open_model_named(path, strict=False)
    d = describe(model, vram, n_ctx, kv_type)
    if as_json:
        print(json.dumps(d))
    else:
        render(d, console)
    return 0 if not model.problems else 1


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    check_positive("--ctx", args.ctx)
    return show(args.model, args.json, args.vram, args.ctx, Console(highlight=False),
                getattr(args, "kv_type", "auto"))


COMMANDS = {"inspect": (add_parser, run)}
