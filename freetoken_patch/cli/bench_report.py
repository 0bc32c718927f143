"""`ftpatch bench report RESULTS.json...`: results of `ftpatch bench` as one HTML page
(`-o`), PNG charts (`--png DIR`) and the README's results table (`--markdown FILE`, written
between `<!-- results:begin -->` and `<!-- results:end -->`). With none of them, the table is
printed. The work is in freetoken_patch.report.
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
    g.add_argument("--markdown", metavar="FILE",
                   help="report: rewrite the results table between the markers in FILE")
    g.add_argument("--markdown-image", metavar="PATH",
                   help="report: the chart the table links to (default: summary.png of --png, "
                        "relative to FILE)")
    g.add_argument("--title", default="ftpatch bench report", help="report: the page's title")


def refuse_inputs(args: argparse.Namespace) -> None:
    """`bench MODEL` takes one model: extra positionals belong to `bench report` only."""
    if getattr(args, "inputs", None):
        raise CLIError(f"bench takes one model; {' '.join(args.inputs)!r} is left over "
                       "(several result files go to `ftpatch bench report`)")


def _command_text(inputs: list[str], markdown: str, image: str | None) -> str:
    """The command the README names (a folder's files as DIR/*.json)."""
    dirs = {os.path.dirname(p) for p in inputs}
    files = f"{dirs.pop() or '.'}/*.json" if len(dirs) == 1 and len(inputs) > 2 else " ".join(inputs)
    png = f" --png {os.path.dirname(image) or '.'}" if image else ""
    return f"ftpatch bench report {files} --markdown {os.path.basename(markdown)}{png}"


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
    if args.png:
        if not png.available():
            console.print("--png needs matplotlib: pip install 'ftpatch[report]'; the other "
                          "outputs are written", markup=False, soft_wrap=True)
            rc = 1
        else:
            paths = png.write(sources, args.png)
            console.print(f"wrote {len(paths)} PNG files to {args.png}", markup=False, soft_wrap=True)
            if image is None and args.markdown:
                image = os.path.relpath(os.path.join(args.png, "summary.png"),
                                        os.path.dirname(os.path.abspath(args.markdown)) or ".")
    if args.markdown:
        try:
            with open(args.markdown, encoding="utf-8") as f:
                text = f.read()
            new = markdown.replace_block(text, markdown.block(
                sources, _command_text(files, args.markdown, image), image))
        except OSError as e:
            raise CLIError(f"bench report: cannot read {args.markdown}: {e.strerror}") from None
        except ValueError as e:
            raise CLIError(f"bench report: {args.markdown}: {e}") from None
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(new)
        console.print(f"wrote the results table into {args.markdown}", markup=False, soft_wrap=True)
    if not (args.output or args.png or args.markdown):
        print(markdown.table(sources), end="")
    return rc
