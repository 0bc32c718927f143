"""`ftpatch pr-notes build | check | measure`: the pull requests in pr_notes/ against FreeToken."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub) -> None:
    s = sub.add_parser(
        "pr-notes", help="build pr_notes/<N> into a git-am patch series for FreeToken; evidence",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Each folder pr_notes/<N>-<slug>/ is one pull request to FreeToken (or a "
                    "review suggestion for someone else's): its text (PR.md), the change "
                    "(change/ at the repository's paths, pr.toml) and the evidence JSON our "
                    "tools wrote. The series is made against FreeToken 0.2.1's files placed at "
                    "the repository's layout (python/freetoken/..., tests/<subsystem>/test_*.py).",
        epilog="examples:\n"
               "  SP=$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')\n"
               "  ftpatch pr-notes build 1 --freetoken $SP --out /tmp/pr1   # patches/, 1.diff, 1.md\n"
               "  git -C ~/FreeToken am /tmp/pr1/patches/*.patch             # onto a 0.2.1 checkout\n"
               "  ftpatch pr-notes check 1 --freetoken $SP --out /tmp/pr1 "
               "--json pr_notes/1-gguf-header-reader/evidence/tests.json\n"
               "  ftpatch pr-notes measure header --model m.gguf --pr-tree /tmp/pr1/upstream "
               "--json header.json\n"
               "  ftpatch pr-notes measure bank-load --model m.gguf --json bank_load.json")
    cmds = s.add_subparsers(dest="pr_command", metavar="{build,check,measure}", required=True)
    for name, what in (("build", "write BUILD/upstream (git, 0.2.1 + the PR's commits), "
                                 "BUILD/patches/*.patch, BUILD/N.diff, BUILD/N.md"),
                       ("check", "build, git am the series onto 0.2.1, run its tests before "
                                 "(they must fail for the reason pr.toml names) and after")):
        b = cmds.add_parser(name, help=what)
        b.add_argument("number", type=int, help="the PR folder's number")
        b.add_argument("--freetoken", required=True, metavar="DIR",
                       help="folder holding FreeToken 0.2.1's unpacked `freetoken` package")
        b.add_argument("--out", required=True, metavar="BUILD", help="output folder")
        if name == "build":
            b.add_argument("--author", metavar="'NAME <EMAIL>'",
                           help="the patches' author (default: git config user.name / user.email)")
        if name == "check":
            b.add_argument("--json", help="write the record here (evidence kind pr_tests)")
    m = cmds.add_parser("measure", help="write evidence JSON: header reads, bank loads, parity")
    m.add_argument("what", choices=("header", "bank-load", "fill-threads", "parity"))
    m.add_argument("--model", help="header, bank-load: the GGUF (any shard or folder)")
    m.add_argument("--repeats", type=int, default=None,
                   help="runs per reader / loader and cache state (header: 3, bank-load: 2)")
    m.add_argument("--cache", default=None,
                   help="cold, warm or both (header: warm, bank-load: cold,warm)")
    m.add_argument("--pr-tree", metavar="BUILD/upstream",
                   help="header: also time the pull request's FreeToken (`pr-notes build`'s "
                        "BUILD/upstream); bank-load: a tree whose freetoken/ a PR changed")
    m.add_argument("--readers", default=None,
                   help="header: which of freetoken,pr,patched (default: all three with "
                        "--pr-tree, else freetoken,patched)")
    m.add_argument("--tasks", default=None,
                   help="header: which of metadata,tensor_index,parse_args,tokenizer,scheduler "
                        "(default all)")
    m.add_argument("--threads", type=int, help="bank-load: loader threads (default min(8, CPUs))")
    m.add_argument("--workdir", default=None, help="parity: where the synthetic files go")
    m.add_argument("--json", required=True, help="where to write the record")


def _list(text: str | None, default: tuple[str, ...], known) -> tuple[str, ...]:
    from freetoken_patch.errors import CLIError
    got = tuple(x for x in (text or "").split(",") if x) or default
    bad = [x for x in got if x not in known]
    if bad:
        raise CLIError(f"unknown {', '.join(bad)}; choose from {', '.join(known)}")
    return got


def run(args) -> int:
    from freetoken_patch.errors import CLIError
    from freetoken_patch.upstream import prbuild
    if args.pr_command == "build":
        paths = prbuild.build(args.number, args.freetoken, args.out, author=args.author)
        patches = sorted(paths["patches"].glob("*.patch"))
        print(f"wrote {len(patches)} patch(es) in {paths['patches']}, {paths['diff']}, "
              f"{paths['text']} and the repository {paths['repo']}")
        return 0
    if args.pr_command == "check":
        rec = prbuild.check(args.number, args.freetoken, args.out)
        if args.json:
            Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
        print(f"git am: {'applies' if rec['series_applies'] else 'DOES NOT APPLY'}; "
              f"0.2.1: {rec['before']['outcomes']} "
              f"({'for the reason named' if rec['before_behavioural'] else 'NOT for the reason named'}"
              f"{': ' + '; '.join(rec['before_problems']) if rec['before_problems'] else ''}); "
              f"patched: {rec['after']['outcomes']}")
        return 0 if rec["series_applies"] and rec["before_behavioural"] \
            and rec["after"]["returncode"] == 0 else 1
    from freetoken_patch.upstream import measure
    if args.what == "header":
        if not args.model:
            raise CLIError("measure header needs --model")
        readers = _list(args.readers, ("freetoken", "pr", "patched") if args.pr_tree
                        else ("freetoken", "patched"), measure.HEADER_READERS)
        if "pr" in readers and not args.pr_tree:
            raise CLIError("the pr reader needs --pr-tree BUILD/upstream (from `pr-notes build`)")
        rec = measure.header(args.model, tasks=_list(args.tasks, tuple(measure.HEADER_TASKS),
                                                     measure.HEADER_TASKS),
                             readers=readers, repeats=args.repeats or 3,
                             cache=args.cache or "warm", pr_tree=args.pr_tree)
    elif args.what == "fill-threads":
        if not args.model:
            raise CLIError("measure fill-threads needs --model")
        rec = measure.fill_threads(args.model, repeats=args.repeats or 2,
                                   caches=tuple(c for c in (args.cache or "cold,warm").split(",") if c))
    elif args.what == "bank-load":
        if not args.model:
            raise CLIError("measure bank-load needs --model")
        rec = measure.bank_load(args.model, repeats=args.repeats or 2,
                                caches=tuple(c for c in (args.cache or "cold,warm").split(",") if c),
                                threads=args.threads, pr_tree=args.pr_tree)
    else:
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            rec = measure.parity(args.workdir or tmp)
    Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


COMMANDS = {"pr-notes": (add_parser, run)}
