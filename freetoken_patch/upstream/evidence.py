"""Evidence for the pull-request text: JSON our tools wrote, rendered as Markdown. A PR's `PR.md`
names it as `{{evidence:NAME}}` (the file `evidence/NAME.json`); numbers are never typed in."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from ..errors import CLIError


def _machine(m: dict) -> str:
    return (f"{m.get('cpu') or 'unknown CPU'}, {m.get('cores')} cores, {m.get('ram_gib')} GiB RAM, "
            f"Python {m.get('python')}")


LOADER_NAMES = {"freetoken": "FreeToken 0.2.1", "pr": "parallel fill (a PR build)",
                "patched": "ftpatch's parallel fill"}


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
    env = "".join(f"{k}={v} " for k, v in d.get("test_env", {}).items())
    out = [f"`{env}{' '.join(d['command'])}` against FreeToken {d['freetoken']}'s files at the "
           f"repository's paths, {_machine(d['machine'])}:", "",
           f"- `git am` of the series ({', '.join(d['patches'])}) onto 0.2.1: "
           f"{'applies' if d['series_applies'] else 'DOES NOT APPLY'}",
           f"- 0.2.1 with only the test file added: {line(d['before'])}"]
    out += [f"  - `{f['test'].split('::')[-1]}`: {_tmp(f['message'])}" for f in d["before"]["failures"]]
    out.append(f"- with this change: {line(d['after'])}")
    out += [f"  - `{f['test'].split('::')[-1]}` skipped: {f['skipped']}"
            for f in d["after"].get("skipped", ())]
    return "\n".join(out)


def _tmp(text: str) -> str:
    """pytest's temporary folders as <tmp>: the machine's paths say nothing to a reader."""
    return re.sub(r"/\S*?/pytest-\d+/[^/\s.]+", "<tmp>", text)


READER_NAMES = {"freetoken": "0.2.1 (gguf-py)", "pr": "this PR", "patched": "ftpatch's runtime patch"}


def _cell(s: list[float], base: float | None) -> str:
    med = statistics.median(s)
    speed = f"; {base / med:.0f}x" if base else ""
    return f"{_secs(med)} ({_num(min(s))}-{_num(max(s))}, n={len(s)}{speed})"


def _num(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.1f}"


def _secs(x: float) -> str:
    return _num(x) + " s"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


ARRAY_NAMES = {"tokenizer.ggml.tokens": "tokens", "tokenizer.ggml.merges": "merges",
               "tokenizer.ggml.scores": "scores", "tokenizer.ggml.token_type": "token types"}


def header(d: dict) -> str:
    readers = [k for k in READER_NAMES if any(r["reader"] == k for r in d["runs"])]
    tasks = list(dict.fromkeys(r["task"] for r in d["runs"]))
    rows = ["| task | " + " | ".join(READER_NAMES[k] for k in readers) + " |",
            "|---" * (len(readers) + 1) + "|"]
    med: dict[tuple[str, str], float] = {}
    for t in tasks:
        cells = []
        base = None
        for k in readers:
            s = [r["seconds"] for r in d["runs"] if r["task"] == t and r["reader"] == k]
            med[t, k] = statistics.median(s)
            cells.append(_cell(s, None if k == "freetoken" else base))
            base = base or med[t, k]
        rows.append(f"| `{t}` | " + " | ".join(cells) + " |")
    startup = [t for t in ("parse_args", "tokenizer", "scheduler") if t in tasks]
    if len(startup) > 1:
        sums = [sum(med[t, k] for t in startup) for k in readers]
        rows.append(f"| GPU-free start-up ({' + '.join(startup)}) | " + " | ".join(
            f"{_secs(x)}" + ("" if i == 0 else f"; {sums[0] / x:.0f}x")
            for i, x in enumerate(sums)) + " |")
    same = []
    for key, what in (("metadata_sha256", "metadata dict"), ("tensor_index_sha256", "tensor index"),
                      ("tokenizer_sha256", "tokenizer (vocabulary, stop ids, one encoded text)")):
        got = {r[key] for r in d["runs"] if key in r}
        if got:
            same.append(f"{what}: {'identical' if len(got) == 1 else 'DIFFERENT'} in all "
                        f"{sum(key in r for r in d['runs'])} runs"
                        + (f" (sha256 {next(iter(got))[:12]})" if len(got) == 1 else ""))
    arrays = ", ".join(f"{n:,} {ARRAY_NAMES.get(k, k)}" for k, n in d["arrays"].items())
    imports = statistics.median(r["import_seconds"] for r in d["runs"])
    v = d["versions"]
    return "\n".join([
        f"`{d['model']}`: {_size(d['file_bytes'])} in {d['files']} file(s), "
        f"{d['architecture']}, {d['tensors']} tensors, {d['keys']} keys ({arrays}); its header "
        f"is {d['header_bytes'] / 2**20:.1f} MiB. Machine: {_machine(d['machine'])}; "
        f"FreeToken {v['freetoken']}, transformers {v['transformers']}, tokenizers "
        f"{v['tokenizers']}, numpy {v['numpy']}, torch {v['torch']}.", "",
        *rows, "",
        "Median (min-max, runs) wall time of each task, and the speed-up over 0.2.1. "
        + " ".join(f"`{t}`: {d['tasks'][t]}." for t in tasks), "",
        f"Method: {d['method']}. The imports before each task (median {imports:.1f} s) are "
        "outside these times.", "",
        "Same results: " + "; ".join(same) + "."])


def checklist(pr, tests: dict | None) -> str:
    """The CONTRIBUTING checklist of a pull request (or what a review suggestion stands on)."""
    meta = pr.meta
    title_ok = bool(re.fullmatch(r"(feat|fix|perf|refactor|build|ci|docs|test|chore)"
                                 r"(\([\w.-]+\))?!?: [a-z].*[^.]", pr.title))
    before_ok = bool(tests and tests["series_applies"] and tests.get("before_behavioural")
                     and tests["after"]["returncode"] == 0)
    tested_on = (f"{_machine(tests['machine'])}, no GPU; FreeToken {tests['freetoken']}"
                 if tests else "not recorded")
    box = {True: "x", False: " "}
    items = [
        (True, f"Base: {meta['base']}."),
        (bool(meta.get("issue")), f"Issue: {meta['issue']}" if meta.get("issue") else
         "Issue: none upstream yet. CONTRIBUTING asks a change that is not on the Roadmap to "
         "start as an issue: open the issue below first and link it here."),
        (True, f"One change: {meta['scope']}" if meta.get("scope") else "One change."),
        (before_ok, "A test that fails before and passes after, for the behaviour: "
                    + ("see How it was tested." if before_ok else "NOT SHOWN (see the record).")),
        (bool(meta.get("ab")), "A/B on the same files and machine, 0.2.1 against this branch: "
                               + ("see A/B." if meta.get("ab") else "none (no performance claim).")),
        (True, f"Tested on: {tested_on}; the checkpoints are named under A/B."),
        (title_ok, "Title is a Conventional Commit (the squash-merge subject)."),
        (False, "Run and read by the person who opens it, on their own hardware (CONTRIBUTING's "
                "AI policy: no agent-only pull requests). Not done yet."),
    ]
    return "\n".join(f"- [{box[ok]}] {text}" for ok, text in items)


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
             "fill_threads": fill_threads, "header": header}


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
    """PR.md with every {{evidence:NAME}} replaced by its rendering and {{checklist}} by the
    checklist (from pr.toml and evidence/tests.json)."""
    from .prbuild import EVIDENCE_RE
    text = (pr.folder / "PR.md").read_text()
    if "{{checklist}}" in text:
        tests_json = pr.folder / "evidence" / "tests.json"
        tests = json.loads(tests_json.read_text()) if tests_json.is_file() else None
        text = text.replace("{{checklist}}", checklist(pr, tests))
    return EVIDENCE_RE.sub(lambda m: render(pr.folder / "evidence" / f"{m.group(1)}.json"), text)
