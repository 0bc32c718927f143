"""`ftpatch pr-notes build | check | measure`: the pull requests in pr_notes/ against FreeToken."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    s = sub.add_parser(
        "pr-notes", help="build pr_notes/<N> into a diff against FreeToken; the evidence tools",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Each folder pr_notes/<N>-<slug>/ is one pull request to FreeToken: its text "
                    "(PR.md), the change (change/, pr.toml) and the evidence JSON our tools wrote.",
        epilog="examples:\n"
               "  SP=$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')\n"
               "  ftpatch pr-notes build 1 --freetoken $SP --out /tmp/pr1   # tree/, 1.diff, 1.md\n"
               "  ftpatch pr-notes check 1 --freetoken $SP --out /tmp/pr1 "
               "--json pr_notes/1-parallel-gguf-banks/evidence/tests.json\n"
               "  ftpatch pr-notes measure parity --json parity.json\n"
               "  ftpatch pr-notes measure bank-load --model m.gguf --json bank_load.json")
    cmds = s.add_subparsers(dest="pr_command", metavar="{build,check,measure}", required=True)
    for name, what in (("build", "write BUILD/tree (patched FreeToken), BUILD/N.diff, BUILD/N.md"),
                       ("check", "build, apply the diff to 0.2.1, run its tests before and after")):
        b = cmds.add_parser(name, help=what)
        b.add_argument("number", type=int, help="the PR folder's number")
        b.add_argument("--freetoken", required=True, metavar="DIR",
                       help="folder holding FreeToken 0.2.1's unpacked `freetoken` package")
        b.add_argument("--out", required=True, metavar="BUILD", help="output folder")
        if name == "check":
            b.add_argument("--json", help="write the record here (evidence kind pr_tests)")
    m = cmds.add_parser("measure", help="write evidence JSON: bank-load times or loader parity")
    m.add_argument("what", choices=("bank-load", "fill-threads", "parity"))
    m.add_argument("--model", help="bank-load: the GGUF to load (any shard or folder)")
    m.add_argument("--repeats", type=int, default=2, help="bank-load: runs per loader and cache")
    m.add_argument("--cache", default="cold,warm", help="bank-load: cold, warm or both")
    m.add_argument("--pr-tree", metavar="BUILD/tree",
                   help="bank-load: also time the FreeToken tree a `pr-notes build` wrote")
    m.add_argument("--threads", type=int, help="bank-load: loader threads (default min(8, CPUs))")
    m.add_argument("--workdir", default=None, help="parity: where the synthetic files go")
    m.add_argument("--json", required=True, help="where to write the record")


def run(args) -> int:
    from freetoken_patch.errors import CLIError
    from freetoken_patch.upstream import prbuild
    if args.pr_command == "build":
        tree, diff = prbuild.build(args.number, args.freetoken, args.out)
        print(f"wrote {tree}, {diff} and {diff.with_suffix('.md')}")
        return 0
    if args.pr_command == "check":
        rec = prbuild.check(args.number, args.freetoken, args.out)
        if args.json:
            Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
        print(f"diff applies: {rec['diff_applies']}; before: {rec['before']['outcomes']}; "
              f"after: {rec['after']['outcomes']}")
        return 0 if rec["diff_applies"] and rec["after"]["returncode"] == 0 else 1
    from freetoken_patch.upstream import measure
    if args.what == "fill-threads":
        if not args.model:
            raise CLIError("measure fill-threads needs --model")
        rec = measure.fill_threads(args.model, repeats=args.repeats,
                                   caches=tuple(c for c in args.cache.split(",") if c))
    elif args.what == "bank-load":
        if not args.model:
            raise CLIError("measure bank-load needs --model")
        rec = measure.bank_load(args.model, repeats=args.repeats,
                                caches=tuple(c for c in args.cache.split(",") if c),
                                threads=args.threads, pr_tree=args.pr_tree)
    else:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            rec = measure.parity(args.workdir or tmp)
    Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


COMMANDS = {"pr-notes": (add_parser, run)}
