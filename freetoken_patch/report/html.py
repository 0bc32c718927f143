"""One self-contained HTML page: SVG charts drawn here, a few lines of inline script for hover and
legend toggles, the JSON files embedded. Nothing is fetched when the page is viewed.

Each plotted point carries `data-src` ("FILE#/pointer") and `data-value`; the page's script checks
every point against the embedded JSON and writes the count of mismatches into
`<html data-mismatch>`, and any script error into `<html data-js-errors>` (the CI test reads both).
"""
from __future__ import annotations

import json
import math
from html import escape

from . import data as D

W, H = 640, 340
ML, MR, MT, MB = 64, 20, 16, 44
COLORS = {("ftpatch", "model"): "#1f5fa8", ("ftpatch", "trace"): "#2a9d55", ("llama.cpp", ""): "#c8402b"}
MARKERS = {"model": "circle", "trace": "square", "": "diamond"}


def nice_ticks(top: float, n: int = 5) -> list[float]:
    """0 .. a round number >= top, in n or so round steps."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(math.ceil(top / step - 1e-9)) + 1)]


def fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _marker(kind: str, x: float, y: float, color: str, attrs: str) -> str:
    if kind == "square":
        return f'<rect x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="{color}" {attrs}>'
    if kind == "diamond":
        return (f'<polygon points="{x:.1f},{y - 5.5:.1f} {x + 5.5:.1f},{y:.1f} {x:.1f},{y + 5.5:.1f} '
                f'{x - 5.5:.1f},{y:.1f}" fill="{color}" {attrs}>')
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="{color}" {attrs}>'


def _close(kind: str) -> str:
    return {"square": "</rect>", "diamond": "</polygon>"}.get(kind, "</circle>")


def svg_chart(ch: D.Chart) -> str:
    caps = sorted({p.x for s in ch.series for p in s.points})
    x0, x1 = (caps[0] - 1, caps[-1] + 1) if len(caps) == 1 else (caps[0], caps[-1])
    pad = (x1 - x0) * 0.08
    x0, x1 = x0 - pad, x1 + pad
    top = max([p.hi if p.hi is not None else p.y for s in ch.series for p in s.points] +
              ([caps[-1]] if ch.diagonal else []))
    ticks = nice_ticks(top * 1.05)
    y1 = ticks[-1]

    def sx(x):
        return ML + (x - x0) / (x1 - x0) * (W - ML - MR)

    def sy(y):
        return H - MB - y / y1 * (H - MT - MB)

    o = [f'<svg class="chart" id="chart-{escape(ch.id)}" viewBox="0 0 {W} {H}" width="{W}" '
         f'height="{H}" role="img" aria-label="{escape(ch.title)}" xmlns="http://www.w3.org/2000/svg">']
    step = ticks[1] - ticks[0]
    tick_digits = 0 if step >= 1 and float(step).is_integer() else max(0, -math.floor(math.log10(step)) + 1)
    for t in ticks:
        o.append(f'<line class="grid" x1="{ML}" x2="{W - MR}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>'
                 f'<text class="tick" x="{ML - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">'
                 f'{t:,.{tick_digits}f}</text>')
    for c in caps:
        o.append(f'<text class="tick" x="{sx(c):.1f}" y="{H - MB + 16}" text-anchor="middle">{c:g}</text>')
    o.append(f'<line class="axis" x1="{ML}" x2="{W - MR}" y1="{H - MB}" y2="{H - MB}"/>'
             f'<line class="axis" x1="{ML}" x2="{ML}" y1="{MT}" y2="{H - MB}"/>'
             f'<text class="label" x="{(ML + W - MR) / 2:.0f}" y="{H - 8}" text-anchor="middle">'
             f'{escape(ch.xlabel)}</text><text class="label" transform="translate(14,{(MT + H - MB) / 2:.0f}) '
             f'rotate(-90)" text-anchor="middle">{escape(ch.ylabel)}</text>')
    if ch.diagonal:
        o.append(f'<line class="cap" x1="{sx(x0):.1f}" y1="{sy(x0):.1f}" x2="{sx(x1):.1f}" '
                 f'y2="{sy(min(x1, y1)):.1f}"><title>the cap (y = x)</title></line>')
    n = len(ch.series)
    for i, s in enumerate(ch.series):
        color = COLORS.get((s.runtime, s.regime), "#555")
        kind = MARKERS.get(s.regime, "circle")
        dx = (i - (n - 1) / 2) * 7
        o.append(f'<g class="series" data-series="{i}" data-label="{escape(s.label)}">')
        meds = {}
        for p in s.points:
            meds.setdefault(p.x, []).append(p.y)
        line = " ".join(f"{sx(x) + dx:.1f},{sy(sorted(ys)[len(ys) // 2]):.1f}" for x, ys in sorted(meds.items()))
        o.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        for p in s.points:
            X, Y = sx(p.x) + dx, sy(p.y)
            if p.lo is not None and p.hi is not None:
                o.append(f'<line class="err" x1="{X:.1f}" x2="{X:.1f}" y1="{sy(p.lo):.1f}" '
                         f'y2="{sy(p.hi):.1f}" stroke="{color}"/>')
            spread = f" (min {fmt(p.lo)}, max {fmt(p.hi)})" if p.lo is not None and p.hi is not None else ""
            tip = f"{s.label} at {p.x:g} GiB: {fmt(p.y)} {ch.ylabel}{spread}" + \
                (f"; {p.note}" if p.note else "") + f"\n{p.src}"
            attrs = (f'class="pt" data-src="{escape(p.src)}" data-value="{p.y!r}" data-scale="{p.scale!r}" '
                     f'data-x="{p.x!r}" '
                     f'data-tip="{escape(tip)}"')
            o.append(_marker(kind, X, Y, color, attrs) + f"<title>{escape(tip)}</title>" + _close(kind))
        o.append("</g>")
    o.append("</svg>")
    legend = "".join(
        f'<button class="key" data-chart="{escape(ch.id)}" data-series="{i}">'
        f'<span style="background:{COLORS.get((s.runtime, s.regime), "#555")}"></span>'
        f'{escape(s.label)}</button>' for i, s in enumerate(ch.series))
    return (f'<figure class="card"><figcaption>{escape(ch.title)}</figcaption>{"".join(o)}'
            f'<div class="legend">{legend}</div></figure>')


CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1440px;
color:#1d232b;background:#fff;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.grid-charts{display:flex;flex-wrap:wrap;gap:16px}
.card{border:1px solid #d9dee5;border-radius:6px;padding:10px 12px;margin:0}
figcaption{font-weight:600;margin-bottom:4px}
svg .grid{stroke:#eceff3}svg .axis{stroke:#8a939e}svg .tick{font-size:11px;fill:#5b6570}
svg .label{font-size:12px;fill:#333}svg .cap{stroke:#999;stroke-dasharray:5 4}
svg .pt{cursor:pointer;stroke:#fff;stroke-width:1}svg .pt:hover{stroke:#000;stroke-width:2}
svg .hidden{display:none}
.legend{display:flex;flex-wrap:wrap;gap:6px;margin-top:4px;max-width:640px}
.key{font:12px system-ui,sans-serif;border:1px solid #ccd3db;background:#f6f8fa;border-radius:4px;
padding:2px 8px;cursor:pointer}.key span{display:inline-block;width:10px;height:10px;margin-right:5px;
border-radius:2px}.key.off{opacity:.4}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #d9dee5;padding:3px 8px;
text-align:right}th{background:#f3f5f8}td:first-child,th:first-child{text-align:left}
dl.meta{display:grid;grid-template-columns:max-content auto;gap:2px 14px;margin:8px 0}
dl.meta dt{font-weight:600}dl.meta dd{margin:0}
#tip{position:fixed;pointer-events:none;background:#1d232b;color:#fff;padding:5px 8px;border-radius:4px;
font-size:12px;white-space:pre;display:none;z-index:9}
table.files td,table.files th{text-align:left;vertical-align:top}details{margin:8px 0}code{font-size:12px}.note{color:#5b6570}
"""

SCRIPT_HEAD = """
(function(){var h=document.documentElement;
window.addEventListener('error',function(e){h.setAttribute('data-js-errors',
(h.getAttribute('data-js-errors')||'')+(e.message||'error')+';');});})();
"""

SCRIPT = """
(function(){
var h=document.documentElement,tip=document.getElementById('tip'),src={};
document.querySelectorAll('script.ftpatch-source').forEach(function(s){
  src[s.getAttribute('data-name')]=JSON.parse(s.textContent);});
function at(ref){var i=ref.indexOf('#'),v=src[ref.slice(0,i)],parts=ref.slice(i+1).split('/').slice(1);
  for(var k=0;k<parts.length;k++){if(v===undefined||v===null)return undefined;
    v=v[parts[k].replace(/~1/g,'/').replace(/~0/g,'~')];}return v;}
var bad=0,pts=document.querySelectorAll('.pt');
pts.forEach(function(p){var v=at(p.getAttribute('data-src')),shown=parseFloat(p.getAttribute('data-value')),
  scale=parseFloat(p.getAttribute('data-scale'));
  if(typeof v!=='number'||!(Math.abs(shown-v*scale)<=1e-9*Math.max(1,Math.abs(shown))))bad++;
  p.addEventListener('mousemove',function(e){tip.textContent=p.getAttribute('data-tip');
    tip.style.display='block';tip.style.left=(e.clientX+14)+'px';tip.style.top=(e.clientY+10)+'px';});
  p.addEventListener('mouseleave',function(){tip.style.display='none';});});
document.querySelectorAll('.key').forEach(function(b){b.addEventListener('click',function(){
  var g=document.querySelector('#chart-'+b.getAttribute('data-chart')+' g[data-series="'+
    b.getAttribute('data-series')+'"]');g.classList.toggle('hidden');b.classList.toggle('off');});});
h.setAttribute('data-points',String(pts.length));h.setAttribute('data-mismatch',String(bad));
h.setAttribute('data-ready','1');
})();
"""


def _describe(v) -> str:
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_describe(x)}" for k, x in v.items())
    if isinstance(v, list):
        return ", ".join(_describe(x) for x in v)
    return str(v)


def _about(s: D.Source, key: str):
    first = next((r for _, r in D.our_runs(s)), {})
    return s.data.get(key) or first.get(key) or {}


def _meta(sources: list[D.Source]) -> str:
    """Machine, model and method once where every file agrees; the files, one row each."""
    common, per_file = [], []
    for key in ("machine", "model", "method"):
        vals = {json.dumps(_about(s, key), sort_keys=True) for s in sources if _about(s, key)}
        if len(vals) == 1:
            common.append((key, _describe(json.loads(vals.pop()))))
        elif vals:
            per_file.append(key)
    dl = "<dl class='meta'>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>"
                                       for k, v in common) + "</dl>"
    head = ["file", "source", "routing", "caps", "run"] + per_file + ["llama-bench"]
    rows = []
    for s in sources:
        d = s.data
        src = d.get("source") or ""
        if d.get("transcribed"):
            src += f" ({d['transcribed']})"
        if d.get("synthetic_sample"):
            src = f"synthetic sample: {d['synthetic_sample']}"
        if d.get("complete") is False:
            src += " (incomplete: the run stopped before its last cap)"
        lb = d.get("llama_bench") or {}
        lbt = ""
        if lb:
            lbt = f"{lb.get('binary')}" + (f"; error: {lb['error']}" if lb.get("error") else "")
            for _, r in D.llama_runs(s):
                lbt += f"; {r['vram_cap'] / D.GiB:g} GiB: --n-cpu-moe {r.get('n_cpu_moe')}"
                if len(r.get("attempts") or []) > 1:
                    lbt += f" after {len(r['attempts'])} attempts"
        cells = [s.name, src, "; ".join(sorted({str(r.get("regime")) for _, r in D.our_runs(s)})),
                 ", ".join(f"{c:g}" for c in sorted({r["vram_cap"] / D.GiB for _, r in D.our_runs(s)})),
                 _describe(_about(s, "run"))] + [_describe(_about(s, k)) for k in per_file] + [lbt]
        rows.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
    files = ("<table class='files'><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) +
             "</tr>" + "".join(rows) + "</table>")
    return dl + files


def _cell(points: list[D.Point], digits: int = 1) -> str:
    srcs = "\n".join(p.src for p in points)
    return f'<td title="{escape(srcs)}">{escape(D.spread_text(points, digits))}</td>'


def _summary(sources: list[D.Source]) -> str:
    tests, rows = D.summary(sources)
    head = "<tr><th>cap</th>" + "".join(
        f"<th>{t}: model routing</th><th>{t}: trace</th><th>{t}: llama.cpp</th><th>{t}: ratio</th>"
        for t in tests) + "<th>nvidia-smi peak (GiB)</th></tr>"
    body = []
    for r in rows:
        cells = [f"<td>{r['cap']:g} GiB</td>"]
        for t in tests:
            c = r[t]
            dg = 1 if t.startswith("tg") else 0
            cells += [_cell(c["model"], dg), _cell(c["trace"], dg), _cell(c["llama"], dg),
                      f"<td>{escape(D.ratio_text(c['model'], c['llama']))}</td>"]
        cells.append(_cell(r["vram"], 2))
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table id='summary'>{head}{''.join(body)}</table>"


def _every_figure(sources: list[D.Source]) -> str:
    out = []
    for s in sources:
        rows = "".join(f'<tr><td><code>{escape(s.name)}#{escape(p)}</code></td><td class="fig" '
                       f'data-src="{escape(s.name)}#{escape(p)}">{v!r}</td></tr>'
                       for p, v in D.figures(s.data))
        out.append(f"<details><summary>{escape(s.name)}: every number in the file</summary>"
                   f"<table class='figures'>{rows}</table></details>")
    return "".join(out)


def _embedded(sources: list[D.Source]) -> str:
    return "".join(f'<script type="application/json" class="ftpatch-source" data-name="{escape(s.name)}">'
                   + json.dumps(D.finite(s.data)).replace("</", "<\\/") + "</script>" for s in sources)


def page(sources: list[D.Source], title: str = "ftpatch bench report") -> str:
    charts = D.charts(sources)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<script>{SCRIPT_HEAD}</script><style>{CSS}</style></head><body>
<h1>{escape(title)}</h1>
<p class="note">Throughput is tokens a second: pp N prefills N prompt tokens, tg N decodes N tokens.
A point is the median of a run's timed repetitions, its bar their min and max; several points at one
cap are separate runs. llama.cpp ran with the <code>--n-cpu-moe</code> that fits each cap. Hover a
point for its value and its place in the JSON; click a legend entry to hide its series.</p>
<h2>Summary: a row a cap</h2>{_summary(sources)}
<h2>Charts</h2><div class="grid-charts">{"".join(svg_chart(c) for c in charts)}</div>
<h2>What was measured: machine, model, method, files</h2>{_meta(sources)}
<h2>Every figure</h2>{_every_figure(sources)}
<div id="tip"></div>{_embedded(sources)}<script>{SCRIPT}</script></body></html>
"""
