"""Decode speed of structured output against plain text, through the server: streamed chat
completions of the same prompt, in turn, one plain and one under a json_schema response_format
(a mask over the vocabulary at every token), each request's decode tok/s from its stream
(tokens after the first over the time from the first chunk to the last). Prints the median of
each and their ratio; --json writes every request's figures.

Without --url it starts `ftpatch serve` with the flags after `--` (default: the embedded tiny
model) on a free port and stops it at the end. Greedy, with max_tokens tokens each: the schema
(an array of at least 10,000 strings) cannot close before max_tokens, and a plain reply that
ends early is reported with its own count.

  PYTHONPATH=. python scripts/agents/bench_structured.py --requests 10 -- MODEL --vram 8GiB
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import urllib.request

LONG = {"type": "array", "minItems": 10000, "items": {"type": "string", "maxLength": 40}}
PROMPT = "List many short phrases about the sea."


@contextlib.contextmanager
def serving(url: str | None, serve: list[str], extra: tuple[str, ...] = ()):
    """The server to measure: the running one at `url` once it answers, or `ftpatch serve
    SERVE EXTRA` started for the run (bench serve's child_server: our import path, SIGINT at
    the end), its output on ours."""
    if url is None:
        from freetoken_patch.cli.bench_serve import child_server
        with child_server(serve, extra, capture=False) as (own, *_):
            yield own
        return
    t0 = time.monotonic()
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            if time.monotonic() - t0 > 900:
                raise SystemExit(f"{url} did not answer in time") from None
            time.sleep(0.5)
    yield url


def one(client, structured: bool, max_tokens: int) -> dict:
    kw = {}
    if structured:
        kw["response_format"] = {"type": "json_schema",
                                 "json_schema": {"name": "phrases", "schema": LONG}}
    t0 = time.perf_counter()
    first = last = None
    usage = None
    for ch in client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": PROMPT}], stream=True,
            temperature=0, max_tokens=max_tokens, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices and (ch.choices[0].delta.content or ch.choices[0].finish_reason):
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
    n = usage.completion_tokens if usage else 0
    return {"structured": structured, "tokens": n, "ttft_s": (first or t0) - t0,
            "decode_tps": (n - 1) / (last - first) if n > 1 and last > first else 0.0}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (else one is started with the flags after --)")
    ap.add_argument("--requests", type=int, default=6, help="pairs of requests (plain, structured)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    from openai import OpenAI
    with serving(args.url, serve, ("--log-format", "off")) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=3600, max_retries=0)
        one(client, False, 8)               # warm-up: graphs, the grammar library's index
        one(client, True, 8)
        rows = []
        for _ in range(args.requests):
            rows += [one(client, False, args.max_tokens), one(client, True, args.max_tokens)]
    plain = [r["decode_tps"] for r in rows if not r["structured"]]
    constrained = [r["decode_tps"] for r in rows if r["structured"]]
    p, c = statistics.median(plain), statistics.median(constrained)
    print(f"{args.requests} pairs, max_tokens {args.max_tokens}, greedy")
    print(f"plain:      decode median {p:.1f} tok/s (min {min(plain):.1f}, max {max(plain):.1f}; "
          f"tokens {sorted({r['tokens'] for r in rows if not r['structured']})})")
    print(f"json_schema decode median {c:.1f} tok/s (min {min(constrained):.1f}, max "
          f"{max(constrained):.1f}); {100 * (c / p - 1):+.1f}% against plain")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "plain_median": p, "structured_median": c}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
