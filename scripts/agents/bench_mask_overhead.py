"""The host cost per token of a constraint in the token stream (moe_offload's TokenStream, as
generate() and the server's batched step drive it), without a model: random logits over the
real vocabulary, each token drawn and taken with and without a JSON-schema GrammarConstraint
(the mask computed after each take, applied before each draw). Prints the median per token of
each, over --runs generations of up to --tokens tokens, in turn within each repetition.

  PYTHONPATH=. python scripts/agents/bench_mask_overhead.py [--vocab GGUF] [--n-vocab 248320]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="tests/fixtures/ggml-vocab-qwen35.gguf")
    ap.add_argument("--n-vocab", type=int, default=248320,
                    help="logits width (the 35B's; the tokenizer's own when smaller)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--temp", type=float, default=0.8)
    args = ap.parse_args(argv)
    import llguidance

    from loaders.tokenizer import Tokenizer
    from moe_offload import GrammarConstraint, SamplingParams, TokenStream
    sys.path.insert(0, "scripts/agents")
    from bench_constrained import TOOL_SCHEMA
    tok = Tokenizer.from_gguf(args.vocab)
    V = max(args.n_vocab, len(tok))
    g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(
        {**TOOL_SCHEMA, "x-guidance": {"whitespace_flexible": False}}))
    GrammarConstraint(g, tok, V)        # the tokenizer's index, built once, outside the clock
    torch.manual_seed(0)
    logits = [torch.randn(1, V) * 3 for _ in range(64)]
    per = {"plain": [], "constrained": []}
    for run in range(args.runs):
        for kind in ("plain", "constrained"):
            c = GrammarConstraint(g, tok, V) if kind == "constrained" else None
            s = TokenStream(SamplingParams(temperature=args.temp, seed=run, max_tokens=10 ** 6),
                            "cpu", None, [1], 1, eog_ids=tok.eog_ids, constraint=c)
            t0 = time.perf_counter()
            n = 0
            for i in range(args.tokens):
                s.push(logits[i % 64], 10 ** 6)
                n += 1
                if s.done:
                    break
            per[kind].append((time.perf_counter() - t0) / n)
    p, c = statistics.median(per["plain"]), statistics.median(per["constrained"])
    spread = lambda xs: f"{1e6 * min(xs):.0f}-{1e6 * max(xs):.0f}"   # noqa: E731
    print(f"vocabulary {len(tok)} tokens, logits {V} wide, temperature {args.temp}, "
          f"{args.runs} runs x <= {args.tokens} tokens (CPU, torch threads "
          f"{torch.get_num_threads()})")
    print(f"plain draw + take:       median {1e6 * p:.0f} us/token (runs {spread(per['plain'])})")
    print(f"constrained (JSON tool): median {1e6 * c:.0f} us/token (runs "
          f"{spread(per['constrained'])}); the constraint adds {1e6 * (c - p):.0f} us/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
