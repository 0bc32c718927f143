"""A prompt's chunks under a VRAM cap: the policy's fixed chunk against the runtime's own choice
(the fewest even chunks whose workspace fits the one the plan reserves), on an agent-like
conversation, with each prefill's workspace estimate beside what torch used.

    python scripts/dev/prompt_chunks.py MODEL [--vram 8GiB] [--ctx 53248] [--first 17657]
        [--turns 1800,2323,2323,2323,1900] [--alone 3000,10000,6000] [--fixed 2048]

First, each --alone size as the first prompt of a fresh sequence (one large chunk where the
context it attends over is short: the workspace estimate's hardest case). Then the conversation
(a --first prompt, then one prompt per --turns size appended to the same sequence) twice, with
--fixed chunks and with the runtime's own, each prompt's prefill time synced, and the two runs'
last-position logits compared: chunk boundaries change the float sums, so compare the
difference with the one between two fixed sizes (--fixed 2048 against --fixed 1024). Random
token ids, seeded. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("model")
    ap.add_argument("--vram", default="8GiB")
    ap.add_argument("--ctx", type=int, default=53248, help="context (what --ctx auto picks at 8 GiB)")
    ap.add_argument("--first", type=int, default=17657, help="the conversation's first prompt")
    ap.add_argument("--turns", default="1800,2323,2323,2323,1900",
                    help="tokens each follow-up appends, comma list")
    ap.add_argument("--alone", default="3000,10000,6000",
                    help="first prompts of fresh sequences, comma list (memory check)")
    ap.add_argument("--fixed", type=int, default=2048, help="the fixed chunk to compare with")
    ap.add_argument("--json", help="write times and every prefill's memory here")
    args = ap.parse_args(argv)
    import torch

    from moe_offload import open_runtime
    rt = open_runtime(args.model, args.vram, ctx=args.ctx)
    V, dev = rt.config.n_vocab, rt.device
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(1000, V - 1000, (1, n), generator=g)

    def memory() -> str:
        m = rt.prefill_memory[-1]
        return f"estimate {m['estimate'] / 2**20:,.0f} MiB, used {m['used'] / 2**20:,.0f} MiB"

    for n in (int(x) for x in args.alone.split(",") if x):
        st = rt.new_state(1, args.ctx)
        rt.prefill(ids(n).to(dev), st)
        rt.release(st)
        print(f"first prompt of {n:,} tokens: {memory()}", flush=True)

    prompts = [ids(args.first)] + [ids(int(x)) for x in args.turns.split(",") if x]
    runs = {}
    for name, chunk in [(f"chunks of {args.fixed}", args.fixed), ("own chunks", None)]:
        st, times, logits = rt.new_state(1, args.ctx), [], []
        for t in prompts:
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            logits.append(rt.prefill(t.to(dev), st, chunk).float().cpu())
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
            print(f"  {name}: {t.shape[1]:,} tokens (to {st.n_past:,}): {times[-1]:.2f} s, {memory()}",
                  flush=True)
        rt.release(st)
        runs[name] = (times, logits)
        print(f"{name}: " + ", ".join(f"{x:.2f}" for x in times) + " s", flush=True)
    (ta, la), (tb, lb) = runs.values()
    for i, (x, y) in enumerate(zip(la, lb)):
        print(f"prompt {i}: max |logit difference| {(x - y).abs().max().item():.3f} "
              f"(largest |logit| {x.abs().max().item():.2f}), argmax {x.argmax().item()} / "
              f"{y.argmax().item()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fixed_s": ta, "own_s": tb, "memory": rt.prefill_memory}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
