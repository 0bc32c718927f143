"""The Markdown tables README.md and docs/BENCHMARKS.md show, made from result files (JSON) and
written between markers, one block a table:

  results        a row a VRAM cap: decode and prefill against llama.cpp, the nvidia-smi peak
  results-runs   every one of our runs behind it, with its date and repetitions
  results-llama  every llama.cpp run behind it, with the --n-cpu-moe that fit the cap
  expect         what to expect on your machine: rows named by an expectations file
                 (`--expect`), each with its command and, once measured, its result file

A document holds the blocks it wants; each is rewritten from the same files every time.
"""
from __future__ import annotations

import json
import os
import re

from . import data as D

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NOTICE = "<!-- made by the command below: edit the JSON, not this table -->"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _prefill_first_large(tests: list[str]) -> tuple[list[str], list[str]]:
    tg = [t for t in tests if t.startswith("tg")]
    pp = sorted((t for t in tests if t.startswith("pp")), key=lambda t: -int(t[2:]))
    return tg, pp


def _gib_peak(text: str) -> str:
    return text if text == "--" else re.sub(r"^([\d.,-]+)", r"\1 GiB", text)


def _rows(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


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
    out = []
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
        cells.append(_gib_peak(D.spread_text(r["vram"], 2)))
        out.append(cells)
    return _rows(head, out)


def _date(s: D.Source) -> str:
    run = s.data.get("run") if isinstance(s.data.get("run"), dict) else {}
    date = str(run.get("date") or "")[:10]
    if not date:   # a file transcribed from a document says when in its source line
        m = re.search(r"measured (\d{4}-\d\d-\d\d)", str(s.data.get("source", "")))
        date = m.group(1) if m else ""
    return date or "--"


def _median(v, digits: int, scale: float = 1.0) -> str:
    if isinstance(v, dict):
        med = D._num(v.get("median"))
        if med is None:
            return "--"
        lo, hi = D._num(v.get("min")), D._num(v.get("max"))
        f = f"{{:,.{digits}f}}"
        text = f.format(med * scale)
        if lo is not None and hi is not None and f.format(lo * scale) != f.format(hi * scale):
            text += f" ({f.format(lo * scale)}-{f.format(hi * scale)})"
        return text
    v = D._num(v)
    return "--" if v is None else f"{v * scale:,.{digits}f}"


def runs_table(sources: list[D.Source]) -> str:
    """Every run of ours: file, date, cap, regime, repetitions, each test's median (min-max),
    TTFT, hit rate, link bytes a token, the nvidia-smi peak."""
    tests = D.test_names(sources)
    tg, pp = _prefill_first_large(tests)
    pp = pp[::-1]
    head = (["file", "measured", "cap", "routing", "reps"] + [f"{t} tok/s" for t in pp + tg]
            + ["TTFT", "hit rate", "MB a token over PCIe", "peak (nvidia-smi)"])
    rows = []
    for s in sources:
        for _, r in D.our_runs(s):
            reps = {r[t].get("reps") for t in pp + tg if isinstance(r.get(t), dict)} - {None}
            cache = r.get("cache") if isinstance(r.get("cache"), dict) else {}
            hit = D._num(cache.get("hit_rate"))
            mb = D._num(cache.get("pcie_MB_per_token"))
            vram = r.get("vram") if isinstance(r.get("vram"), dict) else {}
            peak = D._num(vram.get("nvidia_smi_peak"))
            ttft = r.get("ttft_s")
            rows.append([f"`{s.name}`", _date(s), f"{r['vram_cap'] / D.GiB:g} GiB", D.regime_of(r),
                         ", ".join(str(x) for x in sorted(reps)) or "--"]
                        + [_median(r.get(t), 1 if t.startswith("tg") else 0) for t in pp + tg]
                        + [_median(ttft, 0, 1000.0) + " ms" if ttft is not None else "--",
                           "--" if hit is None else f"{100 * hit:.1f}%",
                           "--" if mb is None else f"{mb:.1f}",
                           "--" if peak is None else f"{peak / D.GiB:.2f} GiB"])
    return _rows(head, rows)


def llama_table(sources: list[D.Source]) -> str:
    """Every llama.cpp run: file, date, cap, the --n-cpu-moe that fit it, each test, its peak."""
    tests = D.test_names(sources)
    tg, pp = _prefill_first_large(tests)
    pp = pp[::-1]
    head = ["file", "measured", "cap", "--n-cpu-moe"] + [f"{t} tok/s" for t in pp + tg] + ["VRAM peak"]
    rows = []
    for s in sources:
        for _, r in D.llama_runs(s):
            cells = [f"`{s.name}`", _date(s), f"{r['vram_cap'] / D.GiB:g} GiB", str(r.get("n_cpu_moe", "--"))]
            for t in pp + tg:
                v = r["tests"].get(t)
                if isinstance(v, dict) and D._num(v.get("median")) is None and D._num(v.get("avg_ts")) is not None:
                    cells.append(f"{v['avg_ts']:,.{1 if t.startswith('tg') else 0}f} (mean)")
                else:
                    cells.append(_median(v, 1 if t.startswith("tg") else 0))
            peak = D._num(r.get("vram_peak"))
            cells.append("--" if peak is None else f"{peak / D.GiB:.2f} GiB")
            rows.append(cells)
    return _rows(head, rows)


# ---- what to expect on your machine ----------------------------------------------------------------

def load_expect(path: str) -> dict:
    """The expectations file: {"kind": "ftpatch-expect", "rows": [{"setup", "machine", "model",
    "command", "result": FILE relative to it, or null until measured}, ...]}; each result file
    read into the row as "data"."""
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    if not isinstance(spec, dict) or spec.get("kind") != "ftpatch-expect" or not isinstance(spec.get("rows"), list):
        raise ValueError(f"{path}: not an expectations file (\"kind\": \"ftpatch-expect\" with \"rows\")")
    base = os.path.dirname(path)
    for row in spec["rows"]:
        missing = {"setup", "machine", "model", "command"} - set(row)
        if missing:
            raise ValueError(f"{path}: a row lacks {', '.join(sorted(missing))}")
        row["data"] = None
        if row.get("result"):
            with open(os.path.join(base, row["result"]), encoding="utf-8") as f:
                row["data"] = json.load(f)
    return spec


def _tests_of(d: dict, kind: str) -> list[str]:
    return sorted((k for k in d if D.TEST.match(k) and k.startswith(kind) and isinstance(d[k], dict)),
                  key=lambda t: int(t[2:]))


def expect_table(spec: dict) -> str:
    head = ["setup", "machine", "model", "decode tok/s", "prefill tok/s", "measured", "command"]
    rows = []
    for row in spec["rows"]:
        d = row["data"]
        if d is None:
            decode = prefill = "not measured yet"
            when = "--"
        else:
            decode = "; ".join(f"{t} {_median(d[t], 1)}" for t in _tests_of(d, "tg")) or "--"
            prefill = "; ".join(f"{t} {_median(d[t], 0)}" for t in _tests_of(d, "pp")) or "--"
            when = _date(D.Source("", d))
            reps = {d[t].get("reps") for t in _tests_of(d, "tg") + _tests_of(d, "pp")} - {None}
            if reps:
                when += f", {'/'.join(str(x) for x in sorted(reps))} reps"
        rows.append([row["setup"], row["machine"], row["model"], decode, prefill, when,
                     f"`{row['command']}`"])
    return _rows(head, rows)


# ---- blocks and markers -------------------------------------------------------------------------------

def block(sources: list[D.Source], command: str, image: str | None = None) -> str:
    """The results block: the table, the files it was made from, the chart."""
    files = ", ".join(f"`{s.name}`" for s in sources)
    out = [BEGIN, NOTICE, "", table(sources), f"Made by `{command}` from {files}; the HTML page "
           "(`-o report.html`) names each cell's place in its JSON.", ""]
    if image:
        out += [f"![decode and prefill against the VRAM cap, ftpatch and llama.cpp]({image})", ""]
    out.append(END)
    return "\n".join(out)


def _wrap(name: str, body: str, command: str) -> str:
    begin, end = markers(name)
    return "\n".join([begin, NOTICE, "", body, f"Made by `{command}`.", "", end])


def blocks(sources: list[D.Source], command: str, image: str | None = None,
           expect: dict | None = None) -> dict[str, str]:
    """Every block these files can make, by marker name."""
    out = {"results": block(sources, command, image),
           "results-runs": _wrap("results-runs", runs_table(sources), command),
           "results-llama": _wrap("results-llama", llama_table(sources), command)}
    if expect is not None:
        out["expect"] = _wrap("expect", expect_table(expect), command)
    return out


def replace_block(text: str, new_block: str, name: str = "results") -> str:
    """`text` with what lies between the markers of `name` (markers included) replaced."""
    begin, end = markers(name)
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pat.search(text):
        raise ValueError(f"no {begin} ... {end} markers to write the table between")
    return pat.sub(lambda _: new_block, text, count=1)


def replace_blocks(text: str, made: dict[str, str]) -> tuple[str, list[str]]:
    """`text` with every block whose markers it holds rewritten; the names written. A document
    with markers for a block these files cannot make (`expect` without --expect) is an error."""
    written = []
    for name in re.findall(r"<!-- ([\w-]+):begin -->", text):
        if name not in made:
            raise ValueError(f"it has {markers(name)[0]} markers, and nothing here makes that "
                             "table" + (" (give --expect FILE)" if name == "expect" else ""))
        text = replace_block(text, made[name], name)
        written.append(name)
    if not written:
        raise ValueError(f"no {BEGIN} ... {END} markers to write the table between")
    return text, written
