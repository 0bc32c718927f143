"""DraftPolicy's defaults against the best fixed k, simulated on measured step costs.

The adaptive policy (`--draft auto`) is driven by the step costs measured on the GPU machine (8
GiB cap, the synthetic 35B-A3B at IQ3_S; docs/BENCHMARKS.md, "Speculative decoding") and on the
2-core CPU, with a head whose drafts are kept at the regime's rate: each step costs its k's
cost times U(0.95, 1.05), and 3% of the times the policy is told are 0.05x or 2.2x the real one
(a drained queue, a step beside a graph capture). A run is 250 steps (bench's `-n 128`). The gain
of a run is plain decoding's time a token over the run's. These are the runs DraftPolicy's
defaults were chosen on: across the regimes, auto keeps close to the best fixed k on average and
never costs much where drafting does not pay. test_mtp_spec.py holds the single decisive cases.
"""
from __future__ import annotations

import random

import pytest

from moe_offload.spec import DraftPolicy

# ms a step by k (policy estimates and fixed-k runs) and the first draft's acceptance
REGIMES = {
    "model routing, 0.78": ({0: 6.5, 1: 11.6, 2: 16.3, 3: 20.5}, 0.78),
    "trace, 0.78": ({0: 4.53, 1: 6.73, 2: 8.53, 3: 9.98}, 0.78),
    "trace (older code), 0.72": ({0: 5.2, 1: 8.34, 2: 11.27, 3: 14.7}, 0.72),
    "trace, 0.30": ({0: 4.53, 1: 6.73, 2: 8.53, 3: 9.98}, 0.30),
    "model routing, 0.30": ({0: 6.5, 1: 11.6, 2: 16.3, 3: 20.5}, 0.30),
    # the 35B-A3B cut to 8 layers on 2 cores: drafting loses at any acceptance
    "CPU (8 layers), 0.74": ({0: 29.0, 1: 67.0, 2: 115.0, 3: 160.0}, 0.74),
}
STEPS, SEEDS, OUTLIERS = 250, 20, 0.03


def expected_tokens(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a)


def best_fixed(cost: dict, a: float) -> float:
    """The best fixed k's gain over plain decoding (in expectation)."""
    return max(expected_tokens(a, k) / cost[k] * cost[0] for k in cost)


def auto_gain(cost: dict, rate: float, seed: int, **policy) -> float:
    rng, pol = random.Random(seed), DraftPolicy(None, **policy)
    spent = tokens = 0.0
    for _ in range(STEPS):
        k = pol.choose()
        accepted = next((j for j in range(k) if rng.random() >= rate), k)
        c = cost[k] * rng.uniform(0.95, 1.05)
        told = c * rng.choice([0.05, 2.2]) if rng.random() < OUTLIERS else c
        pol.observe(k, accepted, told)
        spent, tokens = spent + c, tokens + accepted + 1
    return tokens / spent * cost[0]


def gains(**policy) -> dict[str, tuple[float, float, float]]:
    """regime -> (best fixed k's gain, auto's mean gain, auto's worst) over SEEDS runs."""
    out = {}
    for name, (cost, a) in REGIMES.items():
        g = [auto_gain(cost, a, s, **policy) for s in range(SEEDS)]
        out[name] = (best_fixed(cost, a), sum(g) / len(g), min(g))
    return out


def test_auto_keeps_close_to_the_best_fixed_k_in_every_measured_regime():
    """Measured: auto's mean within 4% of the best fixed k (the trace regime at 0.72, where k = 1
    gains 7%, is the closest call: 1.034 against 1.072), and no run below 0.95 of plain
    decoding (the probes where drafting does not pay)."""
    for name, (best, mean, worst) in gains().items():
        assert mean >= 0.96 * best, (name, best, mean)
        assert worst >= 0.95, (name, worst)


@pytest.mark.parametrize("change", [dict(accept_ema=0.3), dict(probe_every=2, probe_max=4)])
def test_the_simulation_tells_worse_settings_apart(change):
    """The bar above is not one any policy passes: a fast acceptance estimate (it dips below
    break-even by chance and stops drafting where k = 3 gains 30%: 1.115 on average) or probes
    every few steps (0.91 of plain decoding where drafting does not pay) fail it."""
    got = gains(**change)
    assert any(mean < 0.96 * best or worst < 0.95 for best, mean, worst in got.values()), got
