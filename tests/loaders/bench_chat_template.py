"""What the chat-template worker and render_prompt cost: a worker's start, a Qwen3.5-style
template's compile, and one request's prompt (24 tools, an ~18K-token conversation) by each path.

    PYTHONPATH=. python tests/loaders/bench_chat_template.py [--reps 50] [--json]

Times are wall-clock milliseconds, median and 90th percentile of --reps runs after one warm-up.
The per-request paths run in turn within each repetition (so a busy machine slows them alike),
and "added" is the median of each repetition's difference to the old path (in-process render,
then encode with parse_special=True). The tokenizer is the vocabulary fixture's (Qwen2's
vocabulary, qwen35 pre-tokenizer)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chat_workload import QWEN35_STYLE, conversation, tools  # noqa: E402


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs), 2),
            "p90_ms": round(xs[max(0, int(0.9 * len(xs)) - 1)], 2), "reps": len(xs)}


def timed(fn, reps: int) -> dict:
    fn()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t0) * 1000)
    return summary(xs)


def interleaved(fns: dict, reps: int, base: str) -> dict:
    """Each function once per repetition, in turn; their times, and each one's difference to
    `base` in the same repetition."""
    for fn in fns.values():
        fn()
    xs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            xs[k].append((time.perf_counter() - t0) * 1000)
    out = {k: summary(v) for k, v in xs.items()}
    for k in fns:
        if k != base:
            out[k]["added_median_ms"] = round(statistics.median(
                a - b for a, b in zip(xs[k], xs[base])), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from loaders import ChatTemplate, Tokenizer, template_worker
    tok = Tokenizer.from_gguf(HERE.parent / "fixtures" / "ggml-vocab-qwen35.gguf")
    msgs, tls = conversation(), tools()
    here = ChatTemplate(QWEN35_STYLE, isolate=False)
    there = ChatTemplate(QWEN35_STYLE, isolate=True)
    text = here.render(msgs, tools=tls)
    ids = tok.encode(text, parse_special=True)
    assert there.render(msgs, tools=tls) == text
    assert there.render_prompt(msgs, tok, tools=tls).ids == ids

    def start_worker():
        w = template_worker._Worker(256 << 20)
        w.start()
        rss = int(Path(f"/proc/{w.proc.pid}/statm").read_text().split()[1]) * os.sysconf(
            "SC_PAGE_SIZE")
        w.kill()
        starts.append(rss)
    starts: list[int] = []
    res = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}",
        "prompt": {"chars": len(text), "tokens": len(ids), "messages": len(msgs),
                   "tools": len(tls), "template_chars": len(QWEN35_STYLE)},
        "worker_start": timed(start_worker, max(5, a.reps // 5)),
        "compile_here": timed(lambda: ChatTemplate(QWEN35_STYLE, isolate=False),
                              max(5, a.reps // 5)),
        # a fresh source each time, so the worker compiles it
        "compile_in_worker": timed(lambda: ChatTemplate(QWEN35_STYLE + f"{{# {time.time()} #}}"),
                                   max(5, a.reps // 5)),
    }
    res.update(interleaved({
        "before: render here + encode(parse_special)":
            lambda: tok.encode(here.render(msgs, tools=tls), parse_special=True),
        "render here": lambda: here.render(msgs, tools=tls),
        "render in worker": lambda: there.render(msgs, tools=tls),
        "encode(parse_special)": lambda: tok.encode(text, parse_special=True),
        "now: render_prompt in worker": lambda: there.render_prompt(msgs, tok, tools=tls),
        "render_prompt in worker, allow_special_in_content":
            lambda: there.render_prompt(msgs, tok, tools=tls, allow_special_in_content=True),
        "render_prompt here": lambda: here.render_prompt(msgs, tok, tools=tls),
    }, a.reps, "before: render here + encode(parse_special)"))
    res["worker_rss_mb"] = round(statistics.median(starts) / 2**20, 1)
    if a.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{res['machine']}; prompt: {res['prompt']}")
    print(f"worker RSS after start: {res['worker_rss_mb']} MB")
    for k, v in res.items():
        if isinstance(v, dict) and "median_ms" in v:
            added = f"   added {v['added_median_ms']:+6.2f} ms" if "added_median_ms" in v else ""
            print(f"  {k:52s} median {v['median_ms']:8.2f} ms   p90 {v['p90_ms']:8.2f} ms"
                  f"   ({v['reps']} runs){added}")


if __name__ == "__main__":
    main()
