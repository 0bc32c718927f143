"""Offline: replay recorded routing (scripts/dev/routing_dump.py) through the cache policy's numpy
reference (offload_native.plan_reference / prefetch_reference, the kernels' twins) with a choice
of guesser, and report per token the experts fetched on demand, guessed, guessed wrongly, the
bytes over PCIe, and a predicted token time from a simple timeline (one link shared in order of
arrival; per-layer compute calibrated on the all-resident decode).

usage: guess_sim.py DIR [--slots 116] [--warm 64] [--variants NAME ...]"""
import argparse
import os

import numpy as np

from moe_offload.config import OffloadPolicy
from native.offload_native import (LayerTablesRef, plan_reference, prefetch_reference,
                                   score_decay_table)

DECAY = score_decay_table(OffloadPolicy().score_decay)

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--slots", type=int, nargs="+", default=[116])
ap.add_argument("--warm", type=int, default=64, help="tokens before counting")
ap.add_argument("--tokens", type=int, default=0, help="tokens to replay (0: all)")
# the timeline model's two free numbers, fitted to the H200 host at 8 GiB (BENCHMARKS.md: it ranks
# 4 / 6 / 8 guesses as measured, and overstates the cost of no guesses)
ap.add_argument("--link", type=float, default=42e9, help="bytes/s of the link beside compute")
ap.add_argument("--lat", type=float, default=50.0, help="us from a layer's plan to its first "
                "demand byte (launches, events, PCIe round trip)")
ap.add_argument("--variants", nargs="*", default=None)
ap.add_argument("--trace", action="store_true", help="replay the bench's trace regime (no guesses)")
ap.add_argument("--policy", default="kernels", choices=["kernels", "lru", "lfu"],
                help="eviction order: the kernels' (offload_native.plan_reference: decayed score, "
                     "then recency), least recently used first, or least often chosen first")
args = ap.parse_args()

ids = np.load(os.path.join(args.dir, "ids.npy")).astype(np.int64)
if args.trace:   # the bench's realistic-locality trace instead of the recorded routing
    from moe_offload.instrument.trace import make_trace
    ids = make_trace(len(ids), ids.shape[1], 256, ids.shape[2]).astype(np.int64)
if args.tokens:
    ids = ids[:args.tokens]
N, nL, K = ids.shape
E = 256
lg = {k: np.load(os.path.join(args.dir, f"{k}.npz"))["logits"][:N].astype(np.float32)
      for k in ("f1", "f2", "out1")}
EB = 1351680
# per-layer compute (us), calibrated so that 40 layers + the head give the all-resident 3.93 ms
PRE, ROW0, ROW1, HEAD, ROUTER = 55.0, 30.0, 8.0, 130.0, 6.0
XFER = EB / args.link * 1e6   # us per expert over the link


def softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def topk_guess(src, k):
    def g(t, L):
        return list(np.argsort(-lg[src][t, L], kind="stable")[:k])
    return g


def prob_guess(src, tau, kmax=8, kmin=0):
    """experts whose softmax probability (over all E) is at least tau, best first, kmin..kmax."""
    def g(t, L):
        p = softmax(lg[src][t, L])
        order = np.argsort(-p, kind="stable")[:kmax]
        return [e for i, e in enumerate(order) if i < kmin or p[e] >= tau]
    return g


def margin_guess(src, gap, kmax=8, kmin=0):
    """top candidates whose logit is within `gap` of ... above the 9th logit (router margin)."""
    def g(t, L):
        x = lg[src][t, L]
        order = np.argsort(-x, kind="stable")
        ref = x[order[K]]
        return [e for i, e in enumerate(order[:kmax]) if i < kmin or x[e] - ref >= gap]
    return g


class RecencyFirst(LayerTablesRef):
    """The eviction order before scores: least recently used first, then least often chosen."""

    def victim_key(self, s: int, e: int, step: int) -> int:
        return (int(self.slot_last_use[s]) << 32) | int(self.expert_freq[e])


class FrequencyFirst(LayerTablesRef):
    """Least often chosen (since the start) first, then least recently used."""

    def victim_key(self, s: int, e: int, step: int) -> int:
        return (int(self.expert_freq[e]) << 32) | int(self.slot_last_use[s])


def simulate(slots: int, guess, when: str = "early", late=None):
    """guess(t, L) -> experts guessed for layer L at token t (made during layer L-1: 'early' =
    as L-1's demand copies end (f1), 'late' = after L-1's experts (out1))."""
    tabs = []
    for _ in range(nL):
        t = {"lfu": FrequencyFirst, "lru": RecencyFirst}.get(args.policy, LayerTablesRef)(np.full(E, -1, np.int64), np.full(slots, -1, np.int64),
                           np.zeros(slots, np.int64), np.zeros(slots, np.int64),
                           np.zeros(E, np.int64), slots, decay=DECAY)
        t.expert_of_slot[:] = np.arange(slots)     # warm start: experts 0, 1, 2, ...
        t.slot_of_expert[:slots] = np.arange(slots)
        tabs.append(t)
    D = G = W = 0
    times = []
    for tok in range(N):
        step = tok + 1
        count = tok >= args.warm
        clock, link_free = 0.0, 0.0
        pending = [0.0] * (nL + 1)   # when layer L's guessed bytes have all landed
        for L in range(nL):
            sel = [int(e) for e in ids[tok, L]]
            start = clock
            plan_t = start + PRE
            r = plan_reference(tabs[L], sel, step, (1.0, 64.0))
            d = len(r["fetch"])
            s = max(plan_t + (args.lat if d else 0.0), link_free)
            link_free = s + d * XFER
            demand_done = link_free if d else plan_t
            row0_done = plan_t + ROW0
            # guesses for L+1, made during L
            if guess is not None and L + 1 < nL:
                gl = guess(tok, L + 1)
                lst = prefetch_reference(tabs[L + 1], [int(e) for e in gl], K, step)
                nxt = set(int(e) for e in ids[tok, L + 1])
                if count:
                    G += len(lst)
                    W += sum(e not in nxt for e, _ in lst)
                if when == "early":
                    at = demand_done
                else:
                    at = max(demand_done, row0_done) + ROW1 + ROUTER
                if lst:
                    s2 = max(at, link_free)
                    link_free = s2 + len(lst) * XFER
                    pending[L + 1] = link_free
                if late is not None:   # more guesses once layer L's experts are done
                    lst2 = prefetch_reference(tabs[L + 1], [int(e) for e in late(tok, L + 1)], K, step)
                    if count:
                        G += len(lst2)
                        W += sum(e not in nxt for e, _ in lst2)
                    if lst2:
                        at2 = max(demand_done, row0_done) + ROW1 + ROUTER
                        link_free = max(at2, link_free) + len(lst2) * XFER
                        pending[L + 1] = link_free
            end = max(row0_done, demand_done, pending[L]) + ROW1
            clock = end
            if count:
                D += d
        clock += HEAD
        if count:
            times.append(clock)
    n = N - args.warm
    ms = np.mean(times) / 1e3
    return {"demand": D / n, "guessed": G / n, "wrong": W / n, "MB": (D + G) / n * EB / 1e6,
            "ms": ms, "tok_s": 1e3 / ms, "precision": 1 - W / max(G, 1)}


variants = {
    "none": (None, "early"),
    "f1-k4": (topk_guess("f1", 4), "early"),
    "f1-k6": (topk_guess("f1", 6), "early"),
    "f1-k8": (topk_guess("f1", 8), "early"),
    "out1-k6": (topk_guess("out1", 6), "late"),
    "out1-k8": (topk_guess("out1", 8), "late"),
    "f1-k5": (topk_guess("f1", 5), "early"),
    "f1-k7": (topk_guess("f1", 7), "early"),
    "f1k4+out1k6": (topk_guess("f1", 4), "early", topk_guess("out1", 6)),
    "f1k4+out1k8": (topk_guess("f1", 4), "early", topk_guess("out1", 8)),
    "f1k6+out1k8": (topk_guess("f1", 6), "early", topk_guess("out1", 8)),
    "f1k5+out1k7": (topk_guess("f1", 5), "early", topk_guess("out1", 7)),
    "f1-p.01": (prob_guess("f1", 0.01), "early"),
    "f1-p.01k4": (prob_guess("f1", 0.01, 10, 4), "early"),
    "f1-p.015k4": (prob_guess("f1", 0.015, 10, 4), "early"),
    "f1-p.02": (prob_guess("f1", 0.02), "early"),
    "f1-p.03": (prob_guess("f1", 0.03), "early"),
    "f1-p.05": (prob_guess("f1", 0.05), "early"),
    "f1-m0.5": (margin_guess("f1", 0.5), "early"),
    "f1-m1.0": (margin_guess("f1", 1.0), "early"),
    "f1-m1.5": (margin_guess("f1", 1.5), "early"),
}
names = args.variants or list(variants)
for slots in args.slots:
    for name in names:
        r = simulate(slots, *variants[name])
        print(f"slots {slots:3d} {name:9s} demand {r['demand']:5.1f} guessed {r['guessed']:5.1f} "
              f"wrong {r['wrong']:5.1f} (precision {r['precision']:.2f})  {r['MB']:5.1f} MB  "
              f"model {r['ms']:.2f} ms = {r['tok_s']:.1f} tok/s", flush=True)
