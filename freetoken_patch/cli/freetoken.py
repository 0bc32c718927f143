"""`ftpatch freetoken doctor | serve | profile`: FreeToken 0.2.1 with our patch applied."""
from __future__ import annotations

import argparse
import json

# The one account of what the [freetoken] extra costs (this command's help, pr_notes/README.md).
EXTRA_COST = """\
the [freetoken] extra (pip install 'ftpatch[freetoken]'):
  installs freetoken==0.2.1 with its own pins: torch 2.14 built for CUDA 13 (it replaces a CPU
  torch) with 18 CUDA and NVIDIA wheels, and older openai (<3), transformers (<5.19) and
  huggingface_hub (<2) than ftpatch's own server takes; its wheel is for Python 3.11 only.
  Give it a virtual environment of its own, or install it without dependencies beside ftpatch
  (what CI does; enough for doctor, profile and the GGUF code, not for serving):
    pip install --no-deps freetoken==0.2.1 flashlib==0.4.0 'triton>=3.6,<3.9'
    pip install 'msgpack>=1.1,<2' 'pyzmq>=27,<28'"""

PATCH_SUMMARY = ("GGUF headers read without gguf-py's per-value views (the same metadata), "
                 "parallel GGUF expert banks, --model as any shard or a folder, the patch applied "
                 "in the processes `ft serve` spawns")


def add_parser(sub) -> None:
    s = sub.add_parser(
        "freetoken", help="FreeToken with our patch: doctor, serve, routing profiles",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"FreeToken 0.2.1 with the runtime patch: {PATCH_SUMMARY}.",
        epilog="examples:\n"
               "  ftpatch freetoken doctor --model Qwen3.6-35B-A3B-IQ3_S.gguf --compare\n"
               "  ftpatch freetoken serve --model Qwen3.6-35B-A3B-IQ3_S-00002-of-00003.gguf\n"
               "  ftpatch bench m.gguf --vram 8GiB --save-profile ours.json\n"
               "  ftpatch freetoken profile ours.json -o ft.json --model-path m.gguf\n"
               "  ft serve --model m.gguf --moe-cache-split profile:ft.json\n\n" + EXTRA_COST)
    cmds = s.add_subparsers(dest="ft_command", metavar="{doctor,serve,profile}", required=True)
    d = cmds.add_parser("doctor", help="version, file hashes, hooks here and in a spawned child, "
                        "and the GGUF header parse time", epilog=EXTRA_COST,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.add_argument("--no-child", action="store_true", help="skip the spawned-child check")
    d.add_argument("--model", metavar="GGUF",
                   help="time FreeToken's read of this model's header with the patch (any shard "
                        "or folder)")
    d.add_argument("--compare", action="store_true",
                   help="with --model: also time FreeToken 0.2.1's own reader (gguf-py; tens of "
                        "seconds on a large vocabulary) and check both give the same metadata")
    v = cmds.add_parser(
        "serve", help="FreeToken's server (`ft serve ARGS`) with the patch applied",
        prefix_chars="\0", add_help=False, usage="ftpatch freetoken serve [--help] [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"Runs FreeToken's `ft serve ARGS` in this process with the patch applied: "
                    f"{PATCH_SUMMARY}. Every argument goes to `ft serve` unchanged; with "
                    "FreeToken installed, --help lists its flags after this text.",
        epilog="examples:\n"
               "  ftpatch freetoken serve --model Qwen3.6-35B-A3B-IQ3_S-00002-of-00003.gguf\n"
               "  ftpatch freetoken serve --model ~/models/Qwen3.6-35B-A3B/ --port 8000\n\n"
               + EXTRA_COST)
    v.add_argument("ft_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="passed to `ft serve` unchanged (--help: this text, then FreeToken's)")
    p = cmds.add_parser("profile", help="write a FreeToken --moe-cache-split profile from ours",
                        epilog=EXTRA_COST, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("routing", help="our routing profile (ftpatch bench --save-profile)")
    p.add_argument("-o", "--out", required=True, help="FreeToken profile to write (JSON)")
    p.add_argument("--model-path", help="the GGUF FreeToken will serve (names the profile)")
    # `serve --help` is answered in run(): its arguments are FreeToken's, so argparse never sees it
    s.set_defaults(serve_parser=v)


def freetoken_installed() -> bool:
    import importlib.metadata as md
    import importlib.util
    try:
        md.distribution("freetoken")
    except md.PackageNotFoundError:
        return False
    return importlib.util.find_spec("freetoken") is not None


def _serve_help(args) -> int:
    args.serve_parser.print_help()
    if not freetoken_installed():
        print("\nFreeToken is not installed here, so its own `ft serve` flags cannot be listed; "
              "they follow this text once it is (see above).")
        return 0
    print("\nFreeToken's `ft serve` flags:\n", flush=True)
    try:   # its argument parser alone: `ft serve --help` would import the web stack first
        from freetoken.server.args import parse_args
        parse_args(["--help"], prog="ft serve")
    except SystemExit as e:   # argparse's --help exits
        return int(e.code or 0)
    except Exception as e:   # a FreeToken that cannot import its parser: say why, one line
        print(f"(not listed: FreeToken's argument parser does not import here: "
              f"{type(e).__name__}: {e})")
    return 0


def run(args) -> int:
    from freetoken_patch import upstream
    if args.ft_command == "doctor":
        from freetoken_patch.upstream import doctor
        if args.compare and not args.model:
            from freetoken_patch.errors import CLIError
            raise CLIError("--compare times a model's header: give it --model GGUF")
        r = doctor.report(spawn_child=not args.no_child, model=args.model, compare=args.compare)
        print(json.dumps(r, indent=1) if args.json else doctor.render(r))
        return 0 if doctor.healthy(r) else 1
    if args.ft_command == "serve":
        if any(a in ("-h", "--help") for a in args.ft_args):
            return _serve_help(args)
        upstream.apply()
        from freetoken.cli import main as ft_main
        return int(ft_main(["serve", *args.ft_args]) or 0)
    from freetoken_patch.upstream.profile import model_name
    name = model_name(args.model_path) if args.model_path else None
    out = upstream.convert_profile(args.routing, args.out, model=name)
    print(f"wrote {out} (use: --moe-cache-split profile:{out})")
    return 0


COMMANDS = {"freetoken": (add_parser, run)}
