"""`ftpatch synth`: write a synthetic qwen35moe GGUF with real shapes and random weights."""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from loaders.quants import QUANT_TYPES
from loaders.synth import PRESETS, SynthOptions, synthesize

from ..errors import CLIError
from .inputs import check, check_fraction, check_positive, check_seed
from .model_args import size_arg


def add_parser(sub) -> None:
    types = ", ".join(QUANT_TYPES)
    s = sub.add_parser(
        "synth", help="write a synthetic qwen35moe GGUF (random weights, real shapes)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a synthetic qwen35moe GGUF: random valid quant blocks with |w| ~ 0.02, "
                    "the real tensor shapes of a preset, a byte-level BPE tokenizer.\n\n"
                    "presets:\n  tiny      4 layers, hidden 256, 16 experts top-4 (CI: well under a second)\n"
                    "  35b-a3b   Qwen3.5-35B-A3B's shapes: 40 layers, 256 experts top-8, hidden 2048,\n"
                    "            vocab 248,320 (~14 GiB at IQ3_S)\n\n"
                    f"types: {types}",
        epilog="examples:\n"
               "  ftpatch synth -o tiny.gguf                                     # the tiny preset\n"
               "  ftpatch synth --preset 35b-a3b --type IQ3_S -o /tmp/35b.gguf   # ~14 GiB\n"
               "  ftpatch synth --type IQ3_S --down-type Q4_K --output-type Q6_K "
               "--tensor-type 'attn_(q|k|v)=Q4_K' -o mixed.gguf")
    s.add_argument("-o", "--out", required=True, help="output .gguf path")
    s.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="the shapes to use (see presets above; default tiny)")
    s.add_argument("--seed", type=int, default=0,
                   help="random seed, 0 or more; same seed, same file (default 0)")
    s.add_argument("--type", default="IQ3_S", metavar="TYPE",
                   help="type of every 2-D weight not set otherwise (default IQ3_S)")
    s.add_argument("--expert-type", metavar="TYPE", help="routed experts (default: --type)")
    s.add_argument("--down-type", metavar="TYPE", help="ffn_down_exps (default: --expert-type)")
    s.add_argument("--output-type", metavar="TYPE", help="output head (default: --type)")
    s.add_argument("--embed-type", default="Q8_0", metavar="TYPE", help="token embedding (default Q8_0)")
    s.add_argument("--tensor-type", action="append", default=[], metavar="REGEX=TYPE",
                   help="override the type of tensors whose name matches REGEX (repeatable)")
    s.add_argument("--routing-skew", type=float, default=0.0, metavar="A",
                   help="router row scales ~ rank^-A: 0 routes uniformly, 1 strongly favours a few "
                        "experts (default 0)")
    s.add_argument("--mtp", action="store_true", help="add the MTP (NextN) block")
    s.add_argument("--mtp-agree", type=float, metavar="RATE",
                   help="add an MTP block whose greedy draft agrees with the trunk on about RATE "
                        "of the tokens (0..1; makes the trunk near-bigram: a speculative "
                        "decoding benchmark, not a model)")
    s.add_argument("--layers", type=int, help="override the preset's layer count")
    s.add_argument("--split-max-size", type=size_arg, default=0, metavar="SIZE",
                   help="write shards of at most SIZE (e.g. 4GiB): NAME-00001-of-0000N.gguf")
    s.add_argument("--vocab", metavar="GGUF",
                   help="copy the tokenizer from this GGUF (padded to the model's vocabulary); "
                        "default: the built-in byte-level BPE")
    s.add_argument("--threads", type=int, help="generator threads (default: all cores, max 16)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    console = Console(highlight=False)
    check_seed("--seed", args.seed)
    check("--routing-skew", args.routing_skew,
          math.isfinite(args.routing_skew) and args.routing_skew >= 0, "give a number >= 0")
    check_positive("--layers", args.layers)
    check_fraction("--mtp-agree", args.mtp_agree)
    check_positive("--threads", args.threads)
    overrides = []
    for item in args.tensor_type:
        if "=" not in item:
            raise CLIError(f"--tensor-type {item!r}: write it as REGEX=TYPE, e.g. 'attn_v=Q4_K'")
        pat, t = item.rsplit("=", 1)
        overrides.append((pat, t))
    opts = SynthOptions(preset=args.preset, seed=args.seed, type=args.type,
                        expert_type=args.expert_type, down_type=args.down_type,
                        output_type=args.output_type, embed_type=args.embed_type,
                        tensor_types=tuple(overrides), routing_skew=args.routing_skew,
                        mtp=args.mtp, mtp_agree=args.mtp_agree, n_layer=args.layers,
                        split_max_size=args.split_max_size,
                        vocab=args.vocab)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
    t0 = time.perf_counter()
    with Progress(TextColumn("[bold]synth[/] {task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(Path(args.out).name, total=None)

        def progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total, description=name)

        paths = synthesize(args.out, opts, progress=progress, threads=args.threads)
    dt = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in paths)
    console.print(f"wrote {', '.join(str(p) for p in paths)}: {size / (1 << 30):.2f} GiB in "
                  f"{dt:.1f} s ({size / dt / (1 << 20):.0f} MiB/s); random weights, seed {args.seed}",
                  soft_wrap=True)
    return 0


COMMANDS = {"synth": (add_parser, run)}
