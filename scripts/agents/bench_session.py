"""A Claude-Code-shaped session against the server's /v1/messages, and its time to first token.

Turn 1 is Claude Code's own recorded first request (tests/fixtures/claude_code/: its system
prompt, tools, a mid-conversation system message) with filler text added to its last user
message until the prompt is about --first-tokens tokens (the server's count_tokens says);
each follow-up appends the reply it got and a user message of tool output (filler) of a size
drawn from --append (seeded), as an agent's loop does. Every request is streamed; TTFT =
request sent -> first content delta. Prints one line a turn (prompt and cached tokens, TTFT)
and the medians of the follow-ups; --json FILE keeps them.

Without --url it starts `ftpatch serve` with the flags after `--` on a free port.

  PYTHONPATH=. python scripts/agents/bench_session.py --first-tokens 18000 --turns 6 \\
      -- MODEL --vram 8GiB
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_structured import serving  # noqa: E402

FIXTURE = Path(__file__).parents[2] / "tests/fixtures/claude_code/first_request.json"
WORDS = ("the parser reads each block of the file and checks its offsets against the header "
         "before the tensors are mapped into memory so a broken file fails early").split()


def filler(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def count(client, body: dict) -> int:
    keys = ("model", "messages", "system", "tools")
    return client.messages.count_tokens(**{k: body[k] for k in keys if k in body}).input_tokens


def turn(client, body: dict, extra: dict) -> dict:
    t0 = time.perf_counter()
    ttft = None
    with client.messages.stream(**body, extra_body=extra) as s:
        for ev in s:
            if ttft is None and ev.type == "content_block_delta":
                ttft = time.perf_counter() - t0
        msg = s.get_final_message()
    u = msg.usage
    text = "".join(b.text for b in msg.content if b.type == "text")
    return {"prompt_tokens": u.input_tokens + (u.cache_read_input_tokens or 0),
            "cached_tokens": u.cache_read_input_tokens or 0, "ttft_s": ttft,
            "total_s": time.perf_counter() - t0, "reply": text or "(no text)"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url")
    ap.add_argument("--first-tokens", type=int, default=18000)
    ap.add_argument("--turns", type=int, default=6, help="follow-ups after the first request")
    ap.add_argument("--append", default="1000-3000", help="tokens a follow-up adds, LO-HI")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.append.split("-"))
    import anthropic
    rec = json.loads(FIXTURE.read_text())
    body = copy.deepcopy(rec["body"])
    known = {"model", "messages", "system", "tools", "max_tokens", "thinking", "metadata"}
    extra = {k: v for k, v in body.items() if k not in known | {"stream"}}
    body = {k: v for k, v in body.items() if k in known}
    body.update(model="default", max_tokens=args.max_tokens, thinking={"type": "disabled"})
    rows = []
    with serving(args.url, serve) as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", timeout=3600, max_retries=0,
                                     default_headers={"anthropic-beta":
                                                      rec["headers"]["anthropic-beta"]})
        rng = random.Random(args.seed)
        base = count(client, body)
        per_word = (count(client, {**body, "messages": body["messages"] + [
            {"role": "user", "content": filler(random.Random(1), 200)}]}) - base) / 200
        need = max(0, args.first_tokens - base)
        if need:
            body["messages"].append({"role": "user",
                                     "content": filler(rng, int(need / per_word))})
        for i in range(args.turns + 1):
            r = turn(client, body, extra)
            r["turn"] = i
            rows.append(r)
            print(f"turn {i}: prompt {r['prompt_tokens']} tokens, cached {r['cached_tokens']}, "
                  f"TTFT {r['ttft_s']:.2f} s, whole {r['total_s']:.2f} s", flush=True)
            add = rng.randint(lo, hi)
            body["messages"] += [{"role": "assistant", "content": r["reply"]},
                                 {"role": "user", "content": filler(rng, int(add / per_word))}]
    follow = [r["ttft_s"] for r in rows[1:] if r["ttft_s"] is not None]
    if follow:
        print(f"first request TTFT {rows[0]['ttft_s']:.2f} s; follow-ups: median "
              f"{statistics.median(follow):.2f} s, max {max(follow):.2f} s ({len(follow)} turns)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
