"""The report's charts as PNG files (matplotlib, the optional `ftpatch[report]` extra)."""
from __future__ import annotations

import os

from . import data as D
from .html import COLORS

MPL_MARKERS = {"model": "o", "trace": "s", "": "D"}


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _draw(ax, ch: D.Chart) -> None:
    caps = sorted({p.x for s in ch.series for p in s.points})
    span = (caps[-1] - caps[0]) if len(caps) > 1 else 2.0
    for i, s in enumerate(ch.series):
        color = COLORS.get((s.runtime, s.regime), "#555")
        dx = (i - (len(ch.series) - 1) / 2) * span * 0.012        # series side by side at a cap
        xs = [p.x + dx for p in s.points]
        ys = [p.y for p in s.points]
        err = [[max(0.0, p.y - (p.lo if p.lo is not None else p.y)) for p in s.points],
               [max(0.0, (p.hi if p.hi is not None else p.y) - p.y) for p in s.points]]
        ax.errorbar(xs, ys, yerr=err, fmt=MPL_MARKERS.get(s.regime, "o"), color=color,
                    capsize=3, label=s.label, markersize=5)
        meds: dict[float, list[float]] = {}
        for p in s.points:
            meds.setdefault(p.x, []).append(p.y)
        line = sorted((x, sorted(v)[len(v) // 2]) for x, v in meds.items())
        ax.plot([x + dx for x, _ in line], [y for _, y in line], color=color, linewidth=1.6)
    if ch.diagonal and caps:
        ax.plot([caps[0], caps[-1]], [caps[0], caps[-1]], "--", color="#999", linewidth=1,
                label="the cap")
    ax.set_xticks(caps)
    ax.set_xticklabels([f"{c:g}" for c in caps])
    ax.set_ylim(bottom=0)
    ax.set_xlabel(ch.xlabel)
    ax.set_ylabel(ch.ylabel)
    ax.set_title(ch.title, fontsize=10)
    ax.grid(axis="y", color="#e6e9ee")
    ax.legend(fontsize=7, loc="best")


def write(sources: list[D.Source], out_dir: str) -> list[str]:
    """One PNG a chart (CHART_ID.png) and summary.png: decode and the largest prefill side by
    side (the README's chart). Returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    charts = D.charts(sources)
    paths = []
    for ch in charts:
        fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
        _draw(ax, ch)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"{ch.id}.png"))
        fig.savefig(paths[-1], metadata={"Software": None})
        plt.close(fig)
    tg = [c for c in charts if c.id.startswith("tg")]
    pp = sorted((c for c in charts if c.id.startswith("pp")), key=lambda c: -int(c.id[2:]))
    pair = tg[:1] + pp[:1]
    if pair:
        fig, axes = plt.subplots(1, len(pair), figsize=(6.0 * len(pair), 3.8), dpi=110, squeeze=False)
        for ax, ch in zip(axes[0], pair):
            _draw(ax, ch)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "summary.png"))
        fig.savefig(paths[-1], metadata={"Software": None})
        plt.close(fig)
    return paths
