"""`ftpatch freetoken doctor | serve | profile`: FreeToken 0.2.1 with our patch applied."""
from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    s = sub.add_parser(
        "freetoken", help="FreeToken with our patch: doctor, serve, routing profiles",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="FreeToken 0.2.1 (pip install 'ftpatch[freetoken]') with the runtime patch: "
                    "parallel GGUF expert banks, --model as any shard or a folder, the patch "
                    "applied in the processes `ft serve` spawns.",
        epilog="examples:\n"
               "  ftpatch freetoken doctor\n"
               "  ftpatch freetoken serve --model Qwen3.6-35B-A3B-IQ3_S-00002-of-00003.gguf\n"
               "  ftpatch bench m.gguf --vram 8GiB --save-profile ours.json\n"
               "  ftpatch freetoken profile ours.json -o ft.json --model-path m.gguf\n"
               "  ft serve --model m.gguf --moe-cache-split profile:ft.json")
    cmds = s.add_subparsers(dest="ft_command", metavar="{doctor,serve,profile}", required=True)
    d = cmds.add_parser("doctor", help="version, file hashes, hooks here and in a spawned child")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.add_argument("--no-child", action="store_true", help="skip the spawned-child check")
    v = cmds.add_parser("serve", help="FreeToken's server (`ft serve ARGS`) with the patch applied",
                        prefix_chars="\0")
    v.add_argument("ft_args", nargs=argparse.REMAINDER, help="passed to `ft serve` unchanged")
    p = cmds.add_parser("profile", help="write a FreeToken --moe-cache-split profile from ours")
    p.add_argument("routing", help="our routing profile (ftpatch bench --save-profile)")
    p.add_argument("-o", "--out", required=True, help="FreeToken profile to write (JSON)")
    p.add_argument("--model-path", help="the GGUF FreeToken will serve (names the profile)")


def run(args) -> int:
    from freetoken_patch import upstream
    if args.ft_command == "doctor":
        from freetoken_patch.upstream import doctor
        r = doctor.report(spawn_child=not args.no_child)
        print(json.dumps(r, indent=1) if args.json else doctor.render(r))
        return 0 if doctor.healthy(r) else 1
    if args.ft_command == "serve":
        upstream.apply()
        from freetoken.cli import main as ft_main
        return int(ft_main(["serve", *args.ft_args]) or 0)
    from freetoken_patch.upstream.profile import model_name
    name = model_name(args.model_path) if args.model_path else None
    out = upstream.convert_profile(args.routing, args.out, model=name)
    print(f"wrote {out} (use: --moe-cache-split profile:{out})")
    return 0


COMMANDS = {"freetoken": (add_parser, run)}
