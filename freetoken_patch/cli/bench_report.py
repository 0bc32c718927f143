"""`ftpatch bench report RESULTS.json...`: results of `ftpatch bench` as one HTML page
(`-o`), PNG charts (`--png DIR`) and the Markdown tables of README.md and docs/BENCHMARKS.md
(`--markdown FILE`, repeatable: each table written between its markers in each file, see
freetoken_patch/report/markdown.py; `--expect FILE` adds the "what to expect" table). With none
of them, the summary table is printed. The work is in freetoken_patch.report.
"""
from __future__ import annotations

import argparse
import os

from ..errors import CLIError


def add_arguments(g) -> None:
    g.add_argument("inputs", nargs="*", metavar="RESULTS.json",
                   help="report: more result files (the first is in the place of MODEL)")
    g.add_argument("-o", "--output", metavar="HTML", help="report: write the HTML page here")
    g.add_argument("--png", metavar="DIR", help="report: write the charts as PNG files here "
                   "(needs matplotlib: pip install 'ftpatch[report]')")
    g.add_argument("--markdown", metavar="FILE", action="append",
                   help="report: rewrite the tables between their markers in FILE (repeatable: "
                        "README.md and docs/BENCHMARKS.md from the same files)")
    g.add_argument("--markdown-image", metavar="PATH",
                   help="report: the chart the results table links to, a path from the current "
                        "folder (default: summary.png in --png's folder)")
    g.add_argument("--expect", metavar="FILE",
                   help="report: an expectations file (rows of setups with their commands and "
                        "result files) for the 'what to expect' table")
    g.add_argument("--title", default="ftpatch bench report", help="report: the page's title")


def refuse_inputs(args: argparse.Namespace) -> None:
    """`bench MODEL` takes one model: extra positionals belong to `bench report` only."""
    if getattr(args, "inputs", None):
        raise CLIError(f"bench takes one model; {' '.join(args.inputs)!r} is left over "
                       "(several result files go to `ftpatch bench report`)")


def _command_text(inputs: list[str], markdown: list[str], image: str | None,
                  expect: str | None = None) -> str:
    """The command the documents name (a folder's files as DIR/*.json)."""
    dirs = {os.path.dirname(p) for p in inputs}
    files = f"{dirs.pop() or '.'}/*.json" if len(dirs) == 1 and len(inputs) > 2 else " ".join(inputs)
    exp = f" --expect {expect}" if expect else ""
    docs = "".join(f" --markdown {m}" for m in markdown)
    png = f" --png {os.path.dirname(image) or '.'}" if image else ""
    return f"ftpatch bench report {files}{exp}{docs}{png}"


def run(args: argparse.Namespace, console) -> int:
    from ..report import data, html, markdown, png
    files = list(args.inputs)
    if not files:
        raise CLIError("bench report needs result files: ftpatch bench report RESULTS.json... "
                       "-o report.html")
    try:
        sources = data.load(files)
    except OSError as e:
        raise CLIError(f"bench report: cannot read {e.filename}: {e.strerror}") from None
    except ValueError as e:
        raise CLIError(f"bench report: {e}") from None
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise CLIError("bench report: two result files share a name; points name their file, "
                       "so give each file its own name")
    if not any(data.our_runs(s) or data.llama_runs(s) for s in sources):
        raise CLIError("bench report: no measured run in these files (ftpatch bench --out writes one)")
    rc = 0
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(html.page(sources, args.title))
        console.print(f"wrote {args.output}: {len(data.charts(sources))} charts", markup=False, soft_wrap=True)
    image = args.markdown_image
    expect = None
    if args.expect:
        try:
            expect = markdown.load_expect(args.expect)
        except OSError as e:
            raise CLIError(f"bench report: cannot read {e.filename}: {e.strerror}") from None
        except ValueError as e:
            raise CLIError(f"bench report: {e}") from None
    if args.png:
        if not png.available():
            console.print("--png needs matplotlib: pip install 'ftpatch[report]'; the other "
                          "outputs are written", markup=False, soft_wrap=True)
            rc = 1
        else:
            paths = png.write(sources, args.png)
            console.print(f"wrote {len(paths)} PNG files to {args.png}", markup=False, soft_wrap=True)
            if image is None:
                image = os.path.join(args.png, "summary.png")
    command = _command_text(files, args.markdown or [], image, args.expect)
    for doc in args.markdown or []:
        here = os.path.relpath(image, os.path.dirname(os.path.abspath(doc))) if image else None
        try:
            with open(doc, encoding="utf-8") as f:
                text = f.read()
            new, written = markdown.replace_blocks(
                text, markdown.blocks(sources, command, here, expect))
        except OSError as e:
            raise CLIError(f"bench report: cannot read {doc}: {e.strerror}") from None
        except ValueError as e:
            raise CLIError(f"bench report: {doc}: {e}") from None
        with open(doc, "w", encoding="utf-8") as f:
            f.write(new)
        console.print(f"wrote {', '.join(written)} into {doc}", markup=False, soft_wrap=True)
    if not (args.output or args.png or args.markdown):
        print(markdown.table(sources), end="")
    return rc
