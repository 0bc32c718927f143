"""Results of `ftpatch bench` (JSON files) -> the series the charts and tables draw.

Every point keeps where it came from: `src` is "FILE#/json/pointer" of the number it shows
(RFC 6901), so a figure on the page or in the README can be found in its JSON.

Files read: one cap (`ftpatch bench --out`), several caps with or without llama-bench
(`"kind": "ftpatch-bench-caps"`), and results written by hand from a document (the same shapes,
with a `"source"` naming the document).
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field

GiB = 1 << 30
TEST = re.compile(r"^(pp|tg)(\d+)$")
OURS, LLAMA = "ftpatch", "llama.cpp"


@dataclass
class Source:
    name: str                  # the file's name as the page shows it
    data: dict


@dataclass
class Point:
    x: float                   # the VRAM cap, GiB
    y: float
    src: str                   # FILE#/pointer of y
    lo: float | None = None    # min of the repetitions (None: not recorded)
    hi: float | None = None
    note: str = ""
    scale: float = 1.0         # y = (the JSON's number) * scale (hit rate in %, bytes in GiB)


@dataclass
class Series:
    label: str
    runtime: str               # OURS or LLAMA
    regime: str                # "model", "trace", or "" (llama.cpp runs the model's routing)
    points: list[Point] = field(default_factory=list)


@dataclass
class Chart:
    id: str
    title: str
    ylabel: str
    series: list[Series]
    xlabel: str = "VRAM cap (GiB)"
    diagonal: bool = False     # draw y = x (the cap itself)


def load(paths: list[str]) -> list[Source]:
    out = []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"{p}: not an ftpatch bench result (a JSON object)")
        out.append(Source(os.path.basename(p), data))
    return out


def pointer(*parts) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def resolve(data, ptr: str):
    """The value at an RFC 6901 pointer."""
    for part in ptr.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def our_runs(s: Source) -> list[tuple[str, dict]]:
    """(pointer, run) for each of our runs in a file that measured (no "error")."""
    d = s.data
    if "runs" in d:
        return [(pointer("runs", i), r) for i, r in enumerate(d["runs"])
                if isinstance(r, dict) and "error" not in r and r.get("vram_cap")]
    return [("", d)] if d.get("vram_cap") else []


def llama_runs(s: Source) -> list[tuple[str, dict]]:
    lb = s.data.get("llama_bench") or {}
    return [(pointer("llama_bench", "runs", i), r) for i, r in enumerate(lb.get("runs") or [])
            if isinstance(r, dict) and r.get("tests") and r.get("vram_cap")]


def regime_of(run: dict) -> str:
    return "trace" if str(run.get("regime", "")).startswith("trace") else "model"


def test_names(sources: list[Source]) -> list[str]:
    names = set()
    for s in sources:
        for _, r in our_runs(s):
            names |= {k for k in r if TEST.match(k) and isinstance(r[k], dict)}
        for _, r in llama_runs(s):
            names |= {k for k in r["tests"] if TEST.match(k)}
    return sorted(names, key=lambda t: (t[:2] != "tg", int(TEST.match(t)[2])))


def _num(v):
    """v if it is a finite number (not a bool), else None."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return v if ok else None


def finite(data):
    """The JSON value with NaN and infinities as None (a browser's JSON.parse refuses them)."""
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, list):
        return [finite(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return None
    return data


def _ours(sources, metric, scale=1.0) -> list[Series]:
    """One series a regime; metric(run) -> (pointer parts below the run, spread dict or number)."""
    by = {}
    for s in sources:
        for base, r in our_runs(s):
            got = metric(r)
            if got is None:
                continue
            parts, v = got
            cap = r["vram_cap"] / GiB
            src = f"{s.name}#{base}{pointer(*parts)}"
            if isinstance(v, dict):
                if _num(v.get("median")) is None:
                    continue
                lo, hi = _num(v.get("min")), _num(v.get("max"))
                pt = Point(cap, v["median"] * scale, src + "/median",
                           None if lo is None else lo * scale, None if hi is None else hi * scale,
                           f"median of {v.get('reps', '?')}", scale)
            elif _num(v) is not None:
                pt = Point(cap, v * scale, src, scale=scale)
            else:
                continue
            reg = regime_of(r)
            label = f"{OURS}, {'model routing' if reg == 'model' else 'routing trace'}"
            by.setdefault(reg, Series(label, OURS, reg)).points.append(pt)
    return [by[k] for k in ("model", "trace") if k in by]


def _llama(sources, metric, scale=1.0) -> list[Series]:
    ser = Series(f"{LLAMA} (--n-cpu-moe fit to the cap)", LLAMA, "")
    for s in sources:
        for base, r in llama_runs(s):
            got = metric(r)
            if got is None:
                continue
            parts, v = got
            src = f"{s.name}#{base}{pointer(*parts)}"
            note = f"--n-cpu-moe {r.get('n_cpu_moe')}"
            if isinstance(v, dict) and _num(v.get("median")) is None and _num(v.get("avg_ts")) is not None:
                ser.points.append(Point(r["vram_cap"] / GiB, v["avg_ts"] * scale, src + "/avg_ts",
                                        note=note + "; llama-bench's mean", scale=scale))
            elif isinstance(v, dict) and _num(v.get("median")) is not None:
                lo, hi = _num(v.get("min")), _num(v.get("max"))
                ser.points.append(Point(r["vram_cap"] / GiB, v["median"] * scale, src + "/median",
                                        None if lo is None else lo * scale,
                                        None if hi is None else hi * scale, note, scale))
            elif _num(v) is not None:
                ser.points.append(Point(r["vram_cap"] / GiB, v * scale, src, note=note, scale=scale))
    return [ser] if ser.points else []


def _at(run: dict, *path):
    v = run
    for p in path:
        if not isinstance(v, dict) or p not in v:
            return None
        v = v[p]
    return (path, v) if v is not None else None


def charts(sources: list[Source]) -> list[Chart]:
    """Throughput against the cap (a chart per test), then cache, link and VRAM."""
    out = []
    for t in test_names(sources):
        kind = "decode" if t.startswith("tg") else "prefill"
        ser = _ours(sources, lambda r: _at(r, t)) + _llama(sources, lambda r: _at(r, "tests", t))
        if ser:
            out.append(Chart(t, f"{kind} {t}: tokens a second against the VRAM cap", "tok/s", ser))
    hit = _ours(sources, lambda r: _at(r, "cache", "hit_rate"), 100.0)
    if hit:
        out.append(Chart("hit_rate", "expert cache hit rate while decoding", "% of selections", hit))
    link = _ours(sources, lambda r: _at(r, "cache", "pcie_MB_per_token"))
    if link:
        out.append(Chart("pcie", "bytes a decoded token moves over the link", "MB a token", link))
    vram = _ours(sources, lambda r: _at(r, "vram", "nvidia_smi_peak"), 1 / GiB)
    for s in vram:
        s.label += ": nvidia-smi peak"
    vram += _llama(sources, lambda r: _at(r, "vram_peak"), 1 / GiB)
    if vram:
        out.append(Chart("vram", "VRAM peak (nvidia-smi) against the cap", "GiB", vram, diagonal=True))
    return out


# -- the summary: a row a cap ----------------------------------------------------------------------------

def _values(series: list[Series], cap: float, runtime: str, regime: str | None) -> list[Point]:
    return [p for s in series if s.runtime == runtime and (regime is None or s.regime == regime)
            for p in s.points if abs(p.x - cap) < 1e-9]


def summary(sources: list[Source]) -> tuple[list[str], list[dict]]:
    """The tests and, per cap (largest first), the points of each column: ours by regime and
    llama.cpp for every test, and our nvidia-smi peak."""
    tests = test_names(sources)
    by_chart = {c.id: c for c in charts(sources)}
    caps = sorted({p.x for c in by_chart.values() for s in c.series for p in s.points
                   if s.runtime == OURS}, reverse=True)
    rows = []
    for cap in caps:
        row = {"cap": cap}
        for t in tests:
            ser = by_chart[t].series if t in by_chart else []
            row[t] = {"model": _values(ser, cap, OURS, "model"),
                      "trace": _values(ser, cap, OURS, "trace"),
                      "llama": _values(ser, cap, LLAMA, None)}
        v = by_chart.get("vram")
        row["vram"] = _values(v.series, cap, OURS, "model") if v else []
        rows.append(row)
    return tests, rows


def spread_text(points: list[Point], digits: int = 1) -> str:
    """One run: its median; several: the range of their medians and how many ("6 runs"), or the
    one figure they all read."""
    if not points:
        return "--"
    ys = sorted(p.y for p in points)
    f = f"{{:,.{digits}f}}"
    if f.format(ys[0]) == f.format(ys[-1]):
        return f.format(ys[0])
    return f"{f.format(ys[0])}-{f.format(ys[-1])} ({len(ys)} runs)"


def ratio_text(ours: list[Point], theirs: list[Point]) -> str:
    if not ours or not theirs:
        return "--"
    ref = statistics.median(p.y for p in theirs)
    lo, hi = min(p.y for p in ours) / ref, max(p.y for p in ours) / ref
    return f"{lo:.1f}x" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}x"


def figures(data, base: str = "") -> list[tuple[str, object]]:
    """Every number of a JSON value with its pointer (booleans and strings left out)."""
    out = []
    if isinstance(data, dict):
        for k, v in data.items():
            out += figures(v, base + pointer(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += figures(v, base + pointer(i))
    elif _num(data) is not None:
        out.append((base, data))
    return out
