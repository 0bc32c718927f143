"""Routing traces with stated locality, for benchmarks of the realistic-routing regime.

Random weights route almost uniformly: the worst case for any cache. Trained MoEs do not:
measured on Qwen3-30B-A3B-class models, ~45% of a token's experts repeat at the next token,
~80% within 8 tokens, and the top ~10% of experts take ~50% of lookups. A trace draws each
token's top-k per layer from (a) the experts of the recent window with probability `repeat`
(weighted towards the latest tokens) and (b) otherwise a Zipf popularity over experts with
exponent `skew`. Its measured statistics are reported next to every result that uses it.

Legend: N tokens, L layers, E experts, K top-k.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class TraceParams:
    repeat: float = 0.73      # chance a slot reuses an expert of the recent window
    window: int = 8           # tokens of history it draws from
    recency: float = 0.65     # weight of the previous token vs older ones (geometric)
    skew: float = 0.92        # Zipf exponent of expert popularity (0: uniform)
    seed: int = 0

    def label(self) -> str:
        return (f"trace(repeat={self.repeat}, window={self.window}, recency={self.recency}, "
                f"skew={self.skew}, seed={self.seed})")


def make_trace(n_tokens: int, n_layer: int, n_expert: int, top_k: int,
               p: TraceParams = TraceParams()) -> np.ndarray:
    """[N, L, K] int32 expert ids, distinct within each (token, layer).

    Per token and layer: Binomial(K, repeat) slots reuse experts of the last `window` tokens,
    drawn without replacement with weight recency^age (Gumbel top-k); the rest come from the
    layer's Zipf popularity, also without replacement.
    """
    rng = np.random.default_rng(p.seed)
    out = np.zeros((n_tokens, n_layer, top_k), dtype=np.int32)
    base = np.arange(1, n_expert + 1, dtype=np.float64) ** -p.skew
    log_pop = np.log(np.stack([base[rng.permutation(n_expert)] for _ in range(n_layer)]))
    log_age = np.log(p.recency) * np.arange(p.window)
    layers = np.arange(n_layer)[:, None]
    for t in range(n_tokens):
        hist = out[max(0, t - p.window):t][::-1]                 # [w, L, K], latest first
        w = len(hist)
        n_rep = rng.binomial(top_k, p.repeat, size=n_layer) if w else np.zeros(n_layer, int)
        keys = np.full((n_layer, n_expert), -np.inf)
        if w:
            cand = hist.transpose(1, 0, 2).reshape(n_layer, w * top_k)
            k = np.repeat(log_age[:w], top_k)[None, :] + rng.gumbel(size=cand.shape)
            np.maximum.at(keys, (layers, cand), k)                # an expert's best age wins
        pop = log_pop + rng.gumbel(size=log_pop.shape)
        for L in range(n_layer):
            chosen = [int(e) for e in np.argsort(-keys[L])[:n_rep[L]] if keys[L, e] > -np.inf]
            pop[L, chosen] = -np.inf
            need = top_k - len(chosen)
            rest = np.argpartition(-pop[L], need)[:need] if need else []
            out[t, L, :len(chosen)] = chosen
            out[t, L, len(chosen):] = rest
    return out


@dataclass(frozen=True)
class TraceStats:
    repeat_next: float    # share of a token's experts that were used by the previous token
    repeat_within8: float # ... by any of the previous 8 tokens
    top10_share: float    # share of lookups taken by the 10% most used experts (per layer)

    def as_dict(self) -> dict:
        return {k: round(v, 4) for k, v in asdict(self).items()}


def trace_stats(trace: np.ndarray, n_expert: int) -> TraceStats:
    N, L, K = trace.shape
    nxt = w8 = tot = 0
    for t in range(1, N):
        for layer in range(L):
            cur = trace[t, layer]
            nxt += np.isin(cur, trace[t - 1, layer]).sum()
            w8 += np.isin(cur, trace[max(0, t - 8):t, layer]).sum()
            tot += K
    shares = []
    for layer in range(L):
        counts = np.bincount(trace[:, layer].reshape(-1), minlength=n_expert)
        top = np.sort(counts)[::-1][:max(1, n_expert // 10)]
        shares.append(top.sum() / counts.sum())
    return TraceStats(nxt / max(tot, 1), w8 / max(tot, 1), float(np.mean(shares)))


def routing_stats(ids: np.ndarray, n_expert: int) -> TraceStats:
    """The same statistics for routing observed from a model: ids [N, L, K]."""
    return trace_stats(ids, n_expert)
