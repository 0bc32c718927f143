"""`ftpatch`: the command line. Each subcommand lives in its own module; this file parses and
dispatches, and turns our exceptions into one line on stderr (a traceback only with --debug)."""
from __future__ import annotations

import argparse
import sys

from .model_args import size_arg

EPILOG = """\
examples:
  ftpatch chat                                  chat with the embedded default (random weights)
  ftpatch synth --preset tiny -o tiny.gguf      write a small synthetic qwen35moe model
  ftpatch inspect model.gguf --vram 8GiB        what is in a model, and how it fits 8 GiB
"""


# -- commands ----------------------------------------------------------------------------------------

def cmd_inspect(args: argparse.Namespace) -> int:
    from . import inspect_model
    return inspect_model.run(args.model, args.json, args.vram, args.ctx, _console())


def cmd_synth(args: argparse.Namespace) -> int:
    from . import synth_cmd
    return synth_cmd.run(args, _console())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ftpatch", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Run large Mixture-of-Experts GGUF models on a small GPU: hot experts in "
                    "VRAM, cold ones in host RAM, CPU and PCIe working alongside the GPU.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("inspect", help="describe a GGUF model: config, parameters, bytes, plan",
                       description="Describe a GGUF model: architecture, config, parameter count "
                                   "(total and active per token), bytes by tensor class and type, "
                                   "per-layer table, kernel support, and a VRAM plan sketch.")
    s.add_argument("model", help="GGUF file, any shard of a split set, or a folder")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    s.add_argument("--vram", type=size_arg, metavar="SIZE",
                   help="sketch the plan for this much VRAM (e.g. 8GiB)")
    s.add_argument("--ctx", type=int, default=8192, help="context length for the plan (default 8192)")
    s.set_defaults(func=cmd_inspect)

    from . import synth_cmd
    synth_cmd.add_parser(sub, size_arg)
    s = sub.choices["synth"]
    s.set_defaults(func=cmd_synth)

    for name, (register, func) in _extra_commands().items():
        register(sub)
        sub.choices[name].set_defaults(func=func)
    return p


def _extra_commands() -> dict:
    """Commands contributed by other modules of this package: name -> (add_parser, run)."""
    out = {}
    for modname in ("tokenize_cmd", "model_cmds", "chat", "bench", "serve"):
        try:
            mod = __import__(f"freetoken_patch.{modname}", fromlist=["COMMANDS"])
        except ModuleNotFoundError as e:
            if e.name == f"freetoken_patch.{modname}":
                continue
            raise
        out.update(getattr(mod, "COMMANDS", {}))
    return out


def _console():
    from rich.console import Console
    return Console(highlight=False)


def _known_errors() -> tuple[type[BaseException], ...]:
    from loaders import GGUFError
    from moe_offload.errors import OffloadError
    from native.errors import NativeError
    from .errors import CLIError
    return (GGUFError, NativeError, OffloadError, CLIError, OSError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("ftpatch: interrupted", file=sys.stderr)
        return 130
    except _known_errors() as e:
        if args.debug:
            raise
        msg = str(e) or type(e).__name__
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{e.filename}: {msg}"
        print(f"ftpatch: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
