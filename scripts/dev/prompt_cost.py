"""What a short prompt costs under a VRAM cap, and the decode step after it: the time to first
token of a chat turn or a server request.

    python scripts/dev/prompt_cost.py MODEL [--vram 8GiB] [--tokens 8,16,42,64,128,512] [--reps 3]
        [--short-prompt 0,64] [--verify 1,2,4,8]

Each row is a new conversation after a decoded one (so the cache holds a decode working set, as
in a server): the prompt's prefill (synced), the first decode step after it, then the mean of
the next 8 steps; experts streamed by the prefill and the cache's slots a layer before and
after. Sizes (and each --short-prompt setting: OffloadPolicy.short_prompt, prompts up to that
many tokens as decode steps) are interleaved across repetitions; medians are printed.
--verify: a decode step of T tokens of one sequence as a captured graph (rt.verify), timed over
8 steps after its capture, for each T. A profile of one prompt: `profiler.py prefill MODEL
--tokens N --decode-first 48 --short-prompt S`. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("model")
    ap.add_argument("--vram", default="8GiB")
    ap.add_argument("--tokens", default="8,16,42,64,128,512", help="prompt sizes, comma list")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-first", type=int, default=48,
                    help="decode steps of the conversation before each prompt")
    ap.add_argument("--short-prompt", help="comma list of OffloadPolicy.short_prompt to A/B")
    ap.add_argument("--verify", default="", help="comma list of verify-step sizes T to time")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.tokens.split(",")]
    import torch

    from moe_offload import open_runtime
    rt = open_runtime(args.model, args.vram)
    c, dev = rt.config, rt.device

    def synced(f):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        out = f()
        torch.cuda.synchronize(dev)
        return out, time.perf_counter() - t

    def converse() -> None:
        st = rt.new_state(1)
        tok = rt.prefill(torch.randint(0, c.n_vocab, (1, 16), device=dev), st).argmax(-1)
        for _ in range(args.decode_first):
            tok = rt.decode(tok, st).argmax(-1)

    def once(n: int) -> dict:
        converse()
        st = rt.new_state(1)
        slots0 = rt.cache.slots[0]
        streamed0 = rt.stats().prefill_streamed
        caps0 = rt.captures
        toks = torch.randint(0, c.n_vocab, (1, n), device=dev)
        logits, t_pre = synced(lambda: rt.prefill(toks, st))
        slots1 = rt.cache.slots[0]
        tok, t_first = synced(lambda: rt.decode(logits.argmax(-1), st).argmax(-1))
        t = time.perf_counter()
        for _ in range(8):
            tok = rt.decode(tok, st).argmax(-1)
        torch.cuda.synchronize(dev)
        step_ms = (time.perf_counter() - t) / 8 * 1e3
        return {"prefill_ms": t_pre * 1e3, "first_step_ms": t_first * 1e3, "step_ms": step_ms,
                "streamed": rt.stats().prefill_streamed - streamed0,
                "slots": f"{slots0}->{slots1}->{rt.cache.slots[0]}", "captures": rt.captures - caps0}

    settings = ([int(x) for x in args.short_prompt.split(",")] if args.short_prompt
                else [rt.policy.short_prompt])
    base = rt.policy
    once(16)   # kernels loaded, graphs of the first buckets captured
    rows: dict[tuple, list] = {(sp, n): [] for sp in settings for n in sizes}
    for _ in range(args.reps):
        for sp in settings:
            rt.policy = base.with_(short_prompt=sp)
            for n in sizes:
                rows[sp, n].append(once(n))
    rt.policy = base
    print(f"cap {args.vram}, decode-first {args.decode_first}; medians of {args.reps}")
    print(f"{'short':>5} {'tokens':>6} {'prefill ms':>10} {'tok/s':>7} {'1st step':>9} {'step':>6} "
          f"{'streamed':>8}  slots (before->after prompt->after 9 steps), captures")
    for (sp, n), rs in rows.items():
        def med(k):
            return statistics.median(r[k] for r in rs)
        print(f"{sp:>5} {n:>6} {med('prefill_ms'):>10.1f} {n / med('prefill_ms') * 1e3:>7.0f} "
              f"{med('first_step_ms'):>9.1f} {med('step_ms'):>6.2f} {med('streamed'):>8.0f}  "
              f"{[r['slots'] for r in rs]} {[r['captures'] for r in rs]}")
    for T in [int(x) for x in args.verify.split(",") if x]:
        converse()
        st = rt.new_state(1)
        rt.prefill(torch.randint(0, c.n_vocab, (1, 16), device=dev), st)
        caps = rt.captures
        tok = torch.randint(0, c.n_vocab, (1, T), device=dev)
        _, t_cap = synced(lambda: rt.verify(tok, st))
        times = [synced(lambda: rt.verify(tok, st))[1] * 1e3 for _ in range(8)]
        print(f"verify T={T}: first call {t_cap * 1e3:.0f} ms ({rt.captures - caps} captures), then "
              f"median {statistics.median(times):.1f} ms a step ({min(times):.1f}-{max(times):.1f}), "
              f"{T / statistics.median(times) * 1e3:.0f} tok/s")
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
