"""Same-process A/B of the guesses made while the MTP head drafts (OffloadPolicy.draft_guess_layers).

    python scripts/dev/draft_guess_ab.py MODEL [--vram 8GiB] [--rounds 2] [--layers 1,0]
        [--drafts 1,3] [--trace]

Opens the runtime once (an MTP file, e.g. `ftpatch synth --preset 35b-a3b --type IQ3_S
--mtp-agree 0.8`), then for each round and each setting of draft_guess_layers (the order
reversed every other round) runs bench's plain/speculative pair (`bench_spec.speculative_tg`, 128
tokens, 2 timed repetitions) for each k, and prints the ratio, the acceptance, layer 0's guessed
copies and how many its plans used, and the cache's counts.
"""
from __future__ import annotations

import argparse

import torch


def open_mtp_runtime(model: str, vram: str, trace: bool):
    """The runtime with the file's MTP head, routing by the realistic trace by position (as
    `bench --trace --draft`) when `trace` -> (runtime, config)."""
    from loaders import open_model
    from moe_offload import open_runtime
    loaded = open_model(model)
    c = loaded.config
    rt = open_runtime(loaded, vram, ctx=4096, mtp=True)
    if trace:
        from moe_offload.instrument.trace import TraceParams, make_trace
        rt.replay(make_trace(160, c.n_layer, c.n_expert, c.n_expert_used, TraceParams()),
                  by_position=True)
    return rt, c


def main() -> None:
    from freetoken_patch.cli.bench import draft_guess_stats
    from freetoken_patch.cli.bench_spec import speculative_tg
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--vram", default="8GiB")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", default="1,0")
    p.add_argument("--drafts", default="1,3")
    p.add_argument("--trace", action="store_true", help="replayed routing (guesses are then off)")
    args = p.parse_args()
    rt, c = open_mtp_runtime(args.model, args.vram, args.trace)
    r = rt.scheduler.rates
    print(f"guessing {rt.prefetching}, link {r.link_bytes_per_s / 1e9:.1f} GB/s, CPU "
          f"{r.cpu_bytes_per_s / 1e9:.1f} GB/s, q {rt.scheduler.q():.3f}, {rt.cache.slots[0]} slots")
    settings = [int(x) for x in args.layers.split(",")]
    for rnd in range(args.rounds):
        for layers in (settings if rnd % 2 == 0 else settings[::-1]):
            rt.policy = rt.policy.with_(draft_guess_layers=layers)
            for k in (int(x) for x in args.drafts.split(",")):
                rt.reset_stats()
                res = speculative_tg(rt, rt.mtp, k, gen=128, reps=2, n_vocab=c.n_vocab,
                                     new_state=lambda: rt.new_state(1, 4096),
                                     sync=torch.cuda.synchronize)
                g, s = draft_guess_stats(rt), rt.stats()
                print(f"round {rnd} layers {layers} k {k}: {res['speculative_tps']['median']:.1f} "
                      f"vs {res['plain_tps']['median']:.1f} plain, x{res['speedup']:.3f}, acceptance "
                      f"{res['acceptance']:.2f}, same {res['same_tokens']}; layer 0 guessed "
                      f"{g['layer0_guessed']}, used {g['layer0_hits']}; hit {s.hit_rate:.3f}, "
                      f"fetched {s.fetched}, guessed {s.prefetched}, CPU {s.cpu}; guessing changes "
                      f"{rt.guessing_changes}", flush=True)
    rt.close()


if __name__ == "__main__":
    main()
