"""Evidence for the pull-request text: JSON our tools wrote, rendered as Markdown. A PR's `PR.md`
names it as `{{evidence:NAME}}` (the file `evidence/NAME.json`); numbers are never typed in."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..errors import CLIError


def _machine(m: dict) -> str:
    return (f"{m.get('cpu') or 'unknown CPU'}, {m.get('cores')} cores, {m.get('ram_gib')} GiB RAM, "
            f"Python {m.get('python')}")


LOADER_NAMES = {"freetoken": "FreeToken 0.2.1", "pr": "this PR", "patched": "ftpatch's runtime patch"}


def bank_load(d: dict) -> str:
    loaders = [k for k in LOADER_NAMES if any(r["loader"] == k for r in d["runs"])]
    head = " | ".join(LOADER_NAMES[k] for k in loaders)
    rows = [f"| page cache | {head} |", "|---" * (len(loaders) + 1) + "|"]
    nbytes = d["runs"][0]["bank_bytes"]
    headers = [r["freetoken_header_seconds"] for r in d["runs"]]
    cached: dict[str, list[float]] = {}
    for r in d["runs"]:
        cached.setdefault(r["cache"], []).append(r["page_cache_kib_before"] / 2**20)
    for cache in dict.fromkeys(r["cache"] for r in d["runs"]):
        cells, base = [], None
        for k in loaders:
            s = [r["seconds"] for r in d["runs"] if r["cache"] == cache and r["loader"] == k]
            med = statistics.median(s)
            base = base or med
            speed = "" if k == "freetoken" else f"; {base / med:.2f}x"
            cells.append(f"{med:.2f} s ({min(s):.2f}-{max(s):.2f}, n={len(s)}; "
                         f"{nbytes / med / 1e9:.2f} GB/s{speed})")
        rows.append(f"| {cache} | " + " | ".join(cells) + " |")
    return "\n".join([
        f"`{d['model']}`: {d['file_bytes'] / 2**30:.2f} GiB in {d['shards']} file(s), "
        f"{d['layers']} MoE layers, {nbytes / 2**30:.2f} GiB of expert banks; {d['threads']} "
        f"loader threads. Machine: {_machine(d['machine'])}.", "",
        *rows, "",
        "Median (min-max) wall time of the bank-loading call, its bank bytes per second, and the "
        f"speed-up over FreeToken 0.2.1. Method: {d['method']}.", "",
        f"FreeToken's header parse of this file (gguf-py's reader, outside the times above): "
        f"median {statistics.median(headers):.1f} s over {len(headers)} runs. The page cache "
        "(all files, /proc/meminfo Cached) before the runs: " + "; ".join(
            f"{c} {min(v):.1f}-{max(v):.1f} GiB" for c, v in cached.items()) + "."])


def parity(d: dict) -> str:
    rows = ["| file | shards | opened | banks | bytes compared | identical |",
            "|---|---|---|---|---|---|"]
    for c in d["cases"]:
        rows.append(f"| {c['case']} | {c['shards']} | `{c['opened']}` | {c['banks']} | "
                    f"{c['bank_bytes']:,} | {'yes' if c['identical'] else '**NO**'} |")
    ok = sum(c["identical"] for c in d["cases"])
    return "\n".join([f"{ok} of {len(d['cases'])} loads byte-identical to FreeToken's loader "
                      "(every bank byte, pad rows included; layer tags and row tails equal).",
                      "", *rows])


def pr_tests(d: dict) -> str:
    def line(r: dict) -> str:
        return ", ".join(f"{n} {k}" for k, n in r["outcomes"].items()) or "nothing collected"
    return "\n".join([
        f"`{' '.join(d['command'])}` against FreeToken {d['freetoken']}, "
        f"{_machine(d['machine'])}:", "",
        f"- unpatched 0.2.1: {line(d['before'])}",
        f"- with this change: {line(d['after'])}",
        f"- `git apply --check` of the diff on 0.2.1's files: "
        f"{'applies' if d['diff_applies'] else 'DOES NOT APPLY'}"])


def fill_threads(d: dict) -> str:
    counts = sorted({r["threads"] for r in d["runs"]})
    rows = ["| page cache | " + " | ".join(f"{n} thread{'s' * (n > 1)}" for n in counts) + " |",
            "|---" * (len(counts) + 1) + "|"]
    nbytes = d["runs"][0]["bank_bytes"]
    for cache in dict.fromkeys(r["cache"] for r in d["runs"]):
        cells, base = [], None
        for n in counts:
            s = [r["seconds"] for r in d["runs"] if r["cache"] == cache and r["threads"] == n]
            med = statistics.median(s)
            base = base or med
            cells.append(f"{med:.2f} s ({min(s):.2f}-{max(s):.2f}, n={len(s)}; "
                         f"{nbytes / med / 1e9:.2f} GB/s; {base / med:.2f}x)")
        rows.append(f"| {cache} | " + " | ".join(cells) + " |")
    return "\n".join([
        f"`{d['model']}`: {d['file_bytes'] / 2**30:.2f} GiB, {d['layers']} MoE layers, "
        f"{nbytes / 2**30:.2f} GiB of expert banks. Machine: {_machine(d['machine'])}.", "",
        *rows, "", f"Median (min-max), speed-up over one thread. Method: {d['method']}."])


RENDERERS = {"bank_load": bank_load, "parity": parity, "pr_tests": pr_tests,
             "fill_threads": fill_threads}


def render(path: Path) -> str:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CLIError(f"{path}: evidence missing or unreadable ({e}); run the tool that "
                       "writes it (see the PR folder's README)") from None
    fn = RENDERERS.get(d.get("kind"))
    if fn is None:
        raise CLIError(f"{path}: unknown evidence kind {d.get('kind')!r} "
                       f"(known: {', '.join(RENDERERS)})")
    return fn(d)


def render_pr(pr) -> str:
    """PR.md with every {{evidence:NAME}} replaced by its rendering."""
    from .prbuild import EVIDENCE_RE
    text = (pr.folder / "PR.md").read_text()
    return EVIDENCE_RE.sub(lambda m: render(pr.folder / "evidence" / f"{m.group(1)}.json"), text)
