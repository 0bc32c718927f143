"""`bench --draft N|auto`: decode with and without speculative decoding (the MTP head), on
the same model and prompts: tok/s of each, acceptance, tokens a step, the k chosen.

Greedy, so both runs produce the same tokens (checked: a difference is reported, not hidden).
Used by `ftpatch bench` (the offload runtime) and by scripts/dev/spec_cpu.py (a CPU model).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np
import torch


def parse_draft(text: str) -> int | str:
    """'0'..'3' or 'auto' (argparse type of --draft)."""
    import argparse
    from moe_offload import DRAFT
    K_MAX = DRAFT.k_max
    if text == "auto":
        return "auto"
    try:
        k = int(text)
    except ValueError:
        k = -1
    if not 0 <= k <= K_MAX:
        raise argparse.ArgumentTypeError(f"give 0..{K_MAX} draft tokens a step, or auto")
    return k


def parse_drafts(text: str) -> list:
    """'1', 'auto', '1,2,auto' -> the list (argparse type of bench's --draft: several values
    run one after another on one loaded model)."""
    return [parse_draft(part.strip()) for part in text.split(",") if part.strip()] or \
        [parse_draft(text)]


def speculative_tg(backend, draft: int | str, *, gen: int, reps: int, n_vocab: int,
                   new_state: Callable[[], object], sync: Callable[[], None] = lambda: None,
                   prompt_len: int = 16, seed: int = 0, phases: bool = False) -> dict:
    """Plain and speculative greedy decoding of `gen` tokens after random prompts (one warm-up,
    then `reps` timed; the same prompts for both, each pair in the other order than the last: an
    even `reps` cancels the cache's favour to the second run) -> bench's "speculative" object.
    phases: one more speculative run after the timed ones with the device synchronised between
    the phases of each step (SpecStats.phases), so that the timed rates stay unsynchronised.
    `backend`: a moe_offload Backend opened with its MTP head."""
    from moe_offload import SamplingParams, SpeculativeDecoder, generate
    model = backend
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=gen + 1, ignore_eog=True)
    prompts = [rng.integers(0, n_vocab, prompt_len).tolist() for _ in range(reps + 1)]
    dec = SpeculativeDecoder(backend, draft=draft)
    plain_tps, spec_tps, diffs = [], [], []
    # graph captures inside the timed runs (a new k, T or attention bucket captures a step:
    # ~0.1 s each, which a 128-token run does not amortise): counted apart so a slow rate says why
    captured = {False: [0, 0.0], True: [0, 0.0]}

    def run(prompt, d):
        st = new_state()
        sync()
        done = None
        for ev in generate(model, st, prompt, params, draft=d):
            done = ev
        sync()
        return done

    for r, prompt in enumerate(prompts):
        outs = {}
        # the second run of a pair finds the experts the first one used still cached (same
        # prompt, greedy): alternate which goes first, so that neither side gets that for free
        for d in ((None, dec) if r % 2 else (dec, None)):
            if d is not None and r == 1:
                d.reset_stats()            # statistics of the timed repetitions
            n0, s0 = backend.captures, backend.capture_s
            done = run(prompt, d)
            if r:
                (plain_tps if d is None else spec_tps).append(done.timings.decode_tps)
                cap = captured[d is not None]
                cap[0] += backend.captures - n0
                cap[1] += backend.capture_s - s0
            outs[d is not None] = list(done.tokens)
        if outs[False] != outs[True]:
            diffs.append(_divergence(model, new_state, prompt, outs[False], outs[True]))
    st = dec.stats
    out = {"draft": draft, "gen": gen, "reps": reps,
           "plain_tps": _spread(plain_tps), "speculative_tps": _spread(spec_tps),
           "speedup": round(statistics.median(spec_tps) / statistics.median(plain_tps), 3),
           "same_tokens": not diffs, **st.as_dict(),
           "timed_captures": {side: {"graphs": n, "seconds": round(sec, 3)}
                              for side, (n, sec) in (("plain", captured[False]),
                                                     ("speculative", captured[True]))},
           "policy": {"acceptance_ema": round(dec.policy.a, 3),
                      "step_cost_s": {str(k): round(v, 5) for k, v in
                                      sorted(dec.policy.cost.items())}}}
    if diffs:
        out["divergence"] = diffs
    if phases:   # the breakdown, from a run of its own (its syncs slow it down)
        timed = SpeculativeDecoder(backend, draft=draft, policy=dec.policy, phases=True)
        run(prompts[-1], timed)
        out["phases_ms"] = timed.stats.phases_ms()
    return out


def _divergence(model, new_state, prompt: list[int], plain: list[int], spec: list[int]) -> dict:
    """Where greedy speculative output left plain greedy, and how close the trunk's top two
    choices were there (logits of the prompt and the common tokens, by one prefill): a margin
    of a few ulps of the logits says rounding, a large one a bug."""
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    res = {"index": i, "plain": plain[i:i + 3], "speculative": spec[i:i + 3]}
    if i < len(plain) and i < len(spec):
        st = new_state()
        dev = model.device
        logits = model.prefill(torch.tensor([prompt + plain[:i]], device=dev), st)[0].float()
        top = logits.topk(2)
        res.update({"top2_logits": [round(float(v), 6) for v in top.values],
                    "margin": float(top.values[0] - top.values[1]),
                    "relative_margin": float((top.values[0] - top.values[1]) /
                                             top.values[0].abs().clamp(min=1e-30)),
                    "spec_token_logit_gap": float(logits[plain[i]] - logits[spec[i]])})
    return res


def summary(res: dict) -> str:
    line = (f"speculative (--draft {res['draft']}): {res['speculative_tps']['median']:.1f} tok/s "
            f"vs {res['plain_tps']['median']:.1f} plain ({res['speedup']:.2f}x); acceptance "
            f"{res['acceptance']:.1%} ({res['judged_acceptance']:.1%} of judged drafts), "
            f"{res['tokens_per_step']:.2f} tokens a step, k {res['by_k']}")
    if not res["same_tokens"]:
        d = res["divergence"][0]
        line += (f"; TOKENS DIFFER from plain greedy (first at {d['index']}"
                 + (f", top-2 margin {d['margin']:.3g}" if "margin" in d else "") + ")")
    caps = res.get("timed_captures", {}).get("speculative", {})
    if caps.get("graphs"):
        line += f"; {caps['graphs']} graph captures in the timed runs ({caps['seconds']:.2f} s)"
    guesses = res.get("draft_guesses") or {}
    if guesses.get("layer0_guessed"):
        line += (f"; guessed while drafting: {guesses['layer0_guessed']} layer-0 experts, "
                 f"{guesses['layer0_precision']:.0%} used")
    if "phases_ms" in res:
        line += "; ms/step " + ", ".join(f"{k} {v['ms']:.2f}" for k, v in res["phases_ms"].items())
    return line


def _spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3)}


def measure_verify_cost(backend, new_state, n_vocab: int, max_t: int = 4, reps: int = 5,
                        sync: Callable[[], None] = lambda: None) -> dict:
    """Wall time of one trunk forward of T = 1..max_t tokens (the verify step) relative to T = 1,
    and of the alternative rollback (recompute the kept tokens from a snapshot) -> JSON."""
    model = backend
    st = new_state()
    rng = np.random.default_rng(1)
    dev = model.device
    prompt = torch.tensor([rng.integers(0, n_vocab, 16).tolist()], device=dev)
    model.prefill(prompt, st)
    model.keep_steps(st, max_t - 1)
    fwd = model.verify
    times: dict[int, list[float]] = {T: [] for T in range(1, max_t + 1)}
    for _ in range(reps + 1):
        for T in times:
            toks = torch.tensor([rng.integers(0, n_vocab, T).tolist()], device=dev)
            sync()
            t = time.perf_counter()
            fwd(toks, st)
            sync()
            times[T].append(time.perf_counter() - t)
            st.rewind(T - 1)
            st.n_past -= 1
            st.pos.sub_(1)
    med = {T: statistics.median(v[1:]) for T, v in times.items()}
    return {"verify_s": {str(T): round(v, 5) for T, v in med.items()},
            "relative": {str(T): round(v / med[1], 3) for T, v in med.items()}}
