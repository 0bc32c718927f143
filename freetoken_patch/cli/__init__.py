"""`ftpatch`: the command line. Each command lives in its own module of this package
(COMMAND_MODULES, listed by hand: a new command adds one name); this file builds the parser from
them, dispatches, and turns our exceptions into one line on stderr (a traceback only with
--debug)."""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

EPILOG = """\
examples:
  ftpatch chat                                  # chat with the embedded default (random weights)
  ftpatch synth --preset tiny -o tiny.gguf      # write a small synthetic qwen35moe model
  ftpatch inspect model.gguf --vram 8GiB        # what is in a model, and how it fits 8 GiB
  ftpatch COMMAND --help                        # a command's flags and examples
"""


def version_text() -> str:
    """The package version and what this build's kernels can run on."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        lines = [f"ftpatch {version('ftpatch')}"]
    except PackageNotFoundError:
        lines = ["ftpatch (not installed: running from a source tree)"]
    try:
        from native import _cpu
        lines.append(f"CPU kernels: {_cpu.isa()} in use (available here: "
                     f"{', '.join(_cpu.available_isas())}; FTPATCH_CPU_ISA picks one)")
    except ImportError as e:
        lines.append(f"CPU kernels: not built ({e}); the torch reference runs instead")
    from native import build_info

    from .doctor import build_record, cuda_build_text
    lines.append("CUDA kernels: " + cuda_build_text(build_info.summary()["cuda"], build_record()))
    return "\n".join(lines)


class _Version(argparse.Action):
    """--version, worked out only when asked (it loads the CPU extension)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


# The command modules, in the order --help lists them; each maps its command names to
# (add_parser, run) in COMMANDS.
COMMAND_MODULES = ("inspect", "synth", "tokenize", "logits", "run", "chat", "bench", "freetoken",
                   "pr_notes", "doctor", "serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ftpatch", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Run large Mixture-of-Experts GGUF models on a small GPU: hot experts in "
                    "VRAM, cold ones in host RAM, CPU and PCIe working alongside the GPU.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument("--version", action=_Version,
                   help="show the version and the kernels this build has, and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for modname in COMMAND_MODULES:
        mod = importlib.import_module(f"{__name__}.{modname}")
        for name, (register, func) in mod.COMMANDS.items():
            register(sub)
            sub.choices[name].set_defaults(func=func)
    return p


def _known_errors() -> tuple[type[BaseException], ...]:
    from loaders import GGUFError
    from moe_offload import OffloadError
    from native.errors import NativeError
    from ..errors import CLIError
    return (GGUFError, NativeError, OffloadError, CLIError, OSError)


def _out_of_memory(e: BaseException) -> str | None:
    """One line for a failed allocation (torch raises RuntimeError on the CPU), else None."""
    text = str(e)
    if not (isinstance(e, MemoryError) or "out of memory" in text.lower()
            or "can't allocate memory" in text):
        return None
    m = re.search(r"allocate (\d+) bytes", text)
    asked = f" ({int(m.group(1)) / 2**30:.1f} GiB asked for)" if m else ""
    return f"out of memory{asked}; a smaller --ctx needs less"


def _quiet_broken_pipe() -> int:
    """The reader of our output went away (`ftpatch ... | head`): stop without a word, as a
    program killed by SIGPIPE would, and keep the interpreter's final flush from complaining."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 128 + 13   # SIGPIPE


def main(argv: list[str] | None = None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()   # a closed pipe shows here, not in the interpreter's exit
        return rc
    except SystemExit:   # --help, --version, argparse's errors: their output flushed the same way
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            raise SystemExit(_quiet_broken_pipe()) from None
        raise
    except BrokenPipeError:
        return _quiet_broken_pipe()


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        raise
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
    except (MemoryError, RuntimeError) as e:
        msg = _out_of_memory(e)
        if args.debug or msg is None:
            raise
        print(f"ftpatch: error: {msg}", file=sys.stderr)
        return 1
