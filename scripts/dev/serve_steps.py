"""Where a batched server's step time goes, without HTTP: the serve engine on a model under a
VRAM cap, `--clients` clients each sending `--requests` short prompts (random ids) one after
another, timed inside the engine thread.

  python scripts/dev/serve_steps.py MODEL --vram 8GiB [--parallel 4] [--clients 4]
      [--requests 4] [--prompt 40] [--max-tokens 128]

Prints one JSON object: the inter-token gaps as the engine emitted them (p50/p90/p99/max: no
HTTP, no event loop in between), the steps by what they held (a prompt piece, the decode batch
size, a prompt that completed, sequences that left) with their wall times, and for the gaps
above 3x the median the steps that ran inside them (`--vram none --device cpu`: the plain
model, a smoke test).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("model")
    p.add_argument("--vram", default="8GiB", help="the cap (none: the plain model on --device)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=4, help="requests a client, one after another")
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens a request")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ctx", type=int, default=4096)
    return p


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    import numpy as np

    from freetoken_patch.server.batcher import Batcher
    from freetoken_patch.server.engine import Engine
    from freetoken_patch.server.jobs import Job
    from loaders import open_model
    from loaders.tokenizer import Tokenizer
    from moe_offload import SERVING, DoneEvent, SamplingParams, TokenEvent, open_backend

    loaded = open_model(args.model)
    tok = Tokenizer.from_metadata(loaded.metadata, args.model)
    capped = args.vram != "none"
    be = open_backend(loaded, device=args.device, vram=args.vram if capped else None,
                      n_ctx=args.ctx, **({"max_sequences": args.parallel} if capped else {}))
    t0 = time.perf_counter()
    eng = Engine(be, tok, args.ctx, parallel=args.parallel,
                 prefill_chunk=SERVING.prefill_chunk_under_cap)
    start_s = time.perf_counter() - t0
    steps, emitted = [], {}
    step, put = Batcher.step, Job.put

    def timed_step(self, ring):
        fed, n_ring = eng.prefilled_tokens, len(ring)
        done0 = sum(1 for s in ring if s.done)
        a = time.perf_counter()
        step(self, ring)
        b = time.perf_counter()
        steps.append({"t0": a, "t1": b, "B": eng.batch_size, "piece": eng.prefilled_tokens - fed,
                      "left": n_ring - len(ring), "ended": done0})

    def timed_put(self, event):   # in the engine thread, as each token's event goes out
        if isinstance(event, TokenEvent):
            emitted.setdefault(id(self), []).append(time.perf_counter())
        put(self, event)

    Batcher.step, Job.put = timed_step, timed_put
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eog=True)

    async def client(c: int):
        for r in range(args.requests):
            ids = rng.integers(10, loaded.config.n_vocab - 10, args.prompt).tolist()
            job = Job(ids, params)
            eng.submit(job)
            while not isinstance(await job.events.get(), DoneEvent):
                pass

    async def run():
        eng.start()
        await asyncio.gather(*(client(c) for c in range(args.clients)))
        eng.shutdown()

    t_run = time.perf_counter()
    asyncio.run(run())
    wall = time.perf_counter() - t_run
    gaps = []   # (gap seconds, start, end)
    for ts in emitted.values():
        gaps += [(b - a, a, b) for a, b in zip(ts[1:], ts[2:])]   # after the first token
    g = [x[0] for x in gaps]
    med = statistics.median(g)
    kinds: dict[str, list[float]] = {}
    for s in steps:
        k = (f"B{s['B']}" + (f"+piece{s['piece']}" if s["piece"] else "")
             + ("+left" if s["left"] else ""))
        kinds.setdefault(k, []).append(s["t1"] - s["t0"])
    big = sorted((x for x in gaps if x[0] > 3 * med), reverse=True)
    inside = []
    for gap, a, b in big[:40]:
        held = [f"B{s['B']}" + (f"+piece{s['piece']}" if s["piece"] else "")
                + ("+left" if s["left"] else "") + f":{1e3 * (s['t1'] - s['t0']):.1f}"
                for s in steps if s["t1"] > a and s["t0"] < b]
        inside.append({"gap_ms": round(1e3 * gap, 1), "steps": held})
    tokens = sum(len(ts) for ts in emitted.values())
    out = {"start_s": round(start_s, 2), "captures": be.captures, "wall_s": round(wall, 3),
           "tokens": tokens, "tok_s": round(tokens / wall, 1),
           "itl_ms": {q: round(1e3 * pct(g, q), 1) for q in (50, 90, 99)} | {
               "max": round(1e3 * max(g), 1), "n": len(g), "over_3x": len(big)},
           "steps": {k: {"n": len(v), "median_ms": round(1e3 * statistics.median(v), 1),
                         "max_ms": round(1e3 * max(v), 1)} for k, v in sorted(kinds.items())},
           "big_gaps": inside}
    print(json.dumps(out, indent=1))
    be.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
