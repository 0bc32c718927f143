"""The README's results table, made from JSON files and written between two markers."""
from __future__ import annotations

import re

from . import data as D

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _prefill_first_large(tests: list[str]) -> tuple[list[str], list[str]]:
    tg = [t for t in tests if t.startswith("tg")]
    pp = sorted((t for t in tests if t.startswith("pp")), key=lambda t: -int(t[2:]))
    return tg, pp


def table(sources: list[D.Source]) -> str:
    """A row a cap (largest first): decode by routing regime beside llama.cpp, prefill beside
    llama.cpp, the nvidia-smi peak. A cell is a run's median, or the range of several runs'."""
    tests, rows = D.summary(sources)
    tg, pp = _prefill_first_large(tests)
    head = ["cap"]
    for t in tg:
        head += [f"decode {t} tok/s (model routing)", "llama.cpp", "ratio", f"decode {t} (routing trace)"]
    for t in pp:
        head += [f"prefill {t} tok/s", "llama.cpp", "ratio"]
    head.append("peak (nvidia-smi)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['cap']:g} GiB"]
        for t in tg:
            c = r[t]
            cells += [D.spread_text(c["model"], 1), D.spread_text(c["llama"], 1),
                      D.ratio_text(c["model"], c["llama"]), D.spread_text(c["trace"], 1)]
        for t in pp:
            c = r[t]
            cells += [D.spread_text(c["model"], 0), D.spread_text(c["llama"], 0),
                      D.ratio_text(c["model"], c["llama"])]
        peak = D.spread_text(r["vram"], 2)
        cells.append(peak if peak == "--" else re.sub(r"^([\d.,-]+)", r"\1 GiB", peak))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def block(sources: list[D.Source], command: str, image: str | None = None) -> str:
    """What goes between the markers: the table, the files it was made from, the chart."""
    files = ", ".join(f"`{s.name}`" for s in sources)
    out = [BEGIN, "<!-- made by the command below: edit the JSON, not this table -->", "",
           table(sources), f"Made by `{command}` from {files}; the HTML page "
           "(`-o report.html`) names each cell's place in its JSON.", ""]
    if image:
        out += [f"![decode and prefill against the VRAM cap, ftpatch and llama.cpp]({image})", ""]
    out.append(END)
    return "\n".join(out)


def replace_block(text: str, new_block: str) -> str:
    """`text` with what lies between BEGIN and END (markers included) replaced."""
    pat = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pat.search(text):
        raise ValueError(f"no {BEGIN} ... {END} markers to write the table between")
    return pat.sub(lambda _: new_block, text, count=1)
