"""Speculative decoding on the CPU: plain against speculative greedy tok/s, acceptance and tokens
a step, on tiny synthetic models whose MTP head agrees with the trunk at chosen rates, and the
verify step's cost by T.

    python scripts/dev/spec_cpu.py [--rates 0.5,0.9] [--drafts 1,3,auto] [--gen 48] [--json OUT]

Each rate synthesizes a tiny qwen35moe (Q4_K) with `mtp_agree` set, opens it on the CPU with its
MTP head (moe_offload.open_backend) and runs `ftpatch bench`'s pair of plain and speculative
runs (bench_spec.speculative_tg) for each draft setting.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--rates", default="0.5,0.9", help="the heads' agreement rates, comma list")
    ap.add_argument("--drafts", default="1,3,auto", help="drafts a step (0..3 or auto), comma list")
    ap.add_argument("--gen", type=int, default=48, help="tokens a run")
    ap.add_argument("--reps", type=int, default=2, help="timed pairs of runs")
    ap.add_argument("--phases", action="store_true", help="one more run with per-phase timings")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import torch

    from freetoken_patch.cli.bench_spec import measure_verify_cost, parse_drafts, speculative_tg
    from loaders import open_model
    from loaders.synth import SynthOptions, synthesize
    from moe_offload import open_backend
    drafts = parse_drafts(a.drafts)
    out = {"threads": torch.get_num_threads(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rate in map(float, a.rates.split(",")):
            path = Path(tmp) / f"agree{rate}.gguf"
            synthesize(path, SynthOptions(mtp_agree=rate, type="Q4_K", seed=1))
            loaded = open_model(path)
            be = open_backend(loaded, device="cpu", n_ctx=512, mtp=True)
            n_vocab = loaded.config.n_vocab
            if "verify" not in out:
                out["verify"] = measure_verify_cost(be, lambda: be.new_state(1, 512), n_vocab)
                print("verify cost by T:", out["verify"]["relative"])
            for k in drafts:
                res = speculative_tg(be, k, gen=a.gen, reps=a.reps, n_vocab=n_vocab,
                                     new_state=lambda: be.new_state(1, 512), phases=a.phases)
                res["rate"] = rate
                out["runs"].append(res)
                print(f"rate {rate} k {k}: {res['speculative_tps']['median']:.1f} vs "
                      f"{res['plain_tps']['median']:.1f} tok/s ({res['speedup']}x), acceptance "
                      f"{res['acceptance']:.2f}, {res['tokens_per_step']:.2f} tok/step, by_k "
                      f"{res['by_k']}, same {res['same_tokens']}"
                      + (f", ms/step {res['phases_ms']}" if "phases_ms" in res else ""), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
