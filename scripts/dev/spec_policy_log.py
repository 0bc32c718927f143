"""`auto`'s choices step by step: bench's speculative run with DraftPolicy's every observation logged.

    python scripts/dev/spec_policy_log.py MODEL OUT.json [--vram 8GiB] [--trace]

One `bench_spec.speculative_tg(draft="auto")` (128 tokens, 2 timed repetitions after one
untimed) on the offload runtime; each step's k, drafts kept, the seconds the policy saw (None:
not a sample), the acceptance estimate, the cost estimates by k (ms), the probe gap and the
runtime's graph captures so far go to OUT.json beside bench's result; the plain steps, the first
few and those that captured a graph are printed. Used to find why `auto` drafted where it
should not, and where its runs lost time (docs/BENCHMARKS.md, "Speculative decoding").
"""
from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    from draft_guess_ab import open_mtp_runtime   # beside this script
    from freetoken_patch.cli.bench_spec import speculative_tg
    from moe_offload.spec import decoder as spec
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--vram", default="8GiB")
    p.add_argument("--trace", action="store_true", help="the trace regime, by position as bench")
    args = p.parse_args()
    log, opened = [], {}
    observe = spec.DraftPolicy.observe

    def logged(self, k, accepted, seconds):
        observe(self, k, accepted, seconds)
        log.append({"k": k, "accepted": accepted,
                    "ms": None if seconds is None else round(seconds * 1e3, 3),
                    "a": round(self.a, 3), "cost_ms": {j: round(v * 1e3, 3) for j, v in self.cost.items()},
                    "probe_gap": self._probe_gap, "captures": opened["rt"].captures,
                    "capture_s": round(opened["rt"].capture_s, 3)})
    spec.DraftPolicy.observe = logged
    rt, c = open_mtp_runtime(args.model, args.vram, args.trace)
    opened["rt"] = rt
    res = speculative_tg(rt, rt.mtp, "auto", gen=128, reps=2, n_vocab=c.n_vocab,
                         new_state=lambda: rt.new_state(1, 4096), sync=torch.cuda.synchronize)
    print(f"x{res['speedup']}, k {res['by_k']}, acceptance {res['acceptance']}, "
          f"{res['speculative_tps']['median']} vs {res['plain_tps']['median']} plain")
    with open(args.out, "w") as f:
        json.dump({"result": res, "steps": log}, f)
    last = 0
    for i, e in enumerate(log):
        if e["k"] == 0 or i < 8 or e["captures"] != last:
            print(i, e)
        last = e["captures"]
    rt.close()


if __name__ == "__main__":
    main()
