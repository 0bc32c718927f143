"""`auto`'s gain against the best fixed k, simulated: DraftPolicy driven by step costs measured on
the H200 (8 GiB cap, synthetic 35B-A3B IQ3_S; docs/BENCHMARKS.md, "Speculative decoding") and on
the CPU, and a head whose drafts are kept at a given rate, with the noise seen there.

    python scripts/dev/spec_policy_sim.py [--steps 250] [--seeds 20] [--slow-start 1.1]
        [--policy "{'min_gain': 0.02}"]

Each step's cost is its regime's cost for k times U(0.95, 1.05); --outliers (default 0.03) of the
times the policy is told are 0.05x or 2.2x the real one (a drained queue, a step beside a
capture); --slow-start makes a k's first 8 steps that much dearer (a cold cache for its pattern,
new graphs). Prints, per regime, the best fixed k's gain over plain decoding and auto's mean and
worst over the seeds (gain = plain decoding's time a token / the run's). Used to choose
DraftPolicy's defaults; the tests in tests/moe_offload/test_mtp_spec.py hold the decisive cases.
"""
from __future__ import annotations

import argparse
import ast
import random

from moe_offload.spec import DraftPolicy

# ms a step by k (the H200 runs' policy estimates and fixed-k runs) and the first-draft acceptance
REGIMES = {
    "model routing, 0.78": ({0: 6.5, 1: 11.6, 2: 16.3, 3: 20.5}, 0.78),
    "trace, 0.78": ({0: 4.53, 1: 6.73, 2: 8.53, 3: 9.98}, 0.78),
    "trace (older code), 0.72": ({0: 5.2, 1: 8.34, 2: 11.27, 3: 14.7}, 0.72),
    "trace, 0.30": ({0: 4.53, 1: 6.73, 2: 8.53, 3: 9.98}, 0.30),
    "model routing, 0.30": ({0: 6.5, 1: 11.6, 2: 16.3, 3: 20.5}, 0.30),
    # the 2-core development VM, the 35B-A3B cut to 8 layers: drafting loses at any acceptance
    "CPU (8 layers), 0.74": ({0: 29.0, 1: 67.0, 2: 115.0, 3: 160.0}, 0.74),
}


def expected_tokens(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a)


def run(cost: dict, rate: float, steps: int, seed: int, outliers: float, slow_start: float,
        policy: dict) -> float:
    rng, pol = random.Random(seed), DraftPolicy(None, **policy)
    spent = tokens = 0.0
    used: dict[int, int] = {}
    for _ in range(steps):
        k = pol.choose()
        accepted = next((j for j in range(k) if rng.random() >= rate), k)
        c = cost[k] * rng.uniform(0.95, 1.05) * (slow_start if k and used.get(k, 0) < 8 else 1.0)
        told = c * rng.choice([0.05, 2.2]) if rng.random() < outliers else c
        pol.observe(k, accepted, told)
        spent, tokens = spent + c, tokens + accepted + 1
        used[k] = used.get(k, 0) + 1
    return tokens / spent * cost[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=250, help="steps a run (bench: ~250 at -n 128)")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--outliers", type=float, default=0.03)
    p.add_argument("--slow-start", type=float, default=1.0)
    p.add_argument("--policy", default="{}", help="DraftPolicy keyword arguments, a dict")
    args = p.parse_args()
    policy = ast.literal_eval(args.policy)
    for name, (cost, a) in REGIMES.items():
        best = max((expected_tokens(a, k) / cost[k] * cost[0], k) for k in cost)
        gains = [run(cost, a, args.steps, s, args.outliers, args.slow_start, policy)
                 for s in range(args.seeds)]
        print(f"{name:26s} best fixed k = {best[1]}: {best[0]:.3f}x   auto: mean "
              f"{sum(gains) / len(gains):.3f}x, worst {min(gains):.3f}x")


if __name__ == "__main__":
    main()
