"""Speculative decoding on the CPU: plain vs speculative greedy tok/s, acceptance and tokens a
step on tiny synthetic models whose MTP head agrees at chosen rates, and the verify step's cost
by T. Usage: python scripts/dev/spec_cpu.py [--rates 0.5,0.9] [--gen 48] [--json OUT]"""
import argparse
import json
import tempfile
from pathlib import Path

import torch

from freetoken_patch.cli.bench_spec import measure_verify_cost, speculative_tg
from loaders import open_model
from loaders.synth import SynthOptions, synthesize
from moe_offload.models import build_model
from moe_offload.models.mtp import MtpHead

ap = argparse.ArgumentParser()
ap.add_argument("--rates", default="0.5,0.9")
ap.add_argument("--drafts", default="1,3,auto")
ap.add_argument("--gen", type=int, default=48)
ap.add_argument("--reps", type=int, default=2)
ap.add_argument("--phases", action="store_true", help="one more run with per-phase timings")
ap.add_argument("--json")
a = ap.parse_args()
out = {"threads": torch.get_num_threads(), "runs": []}
with tempfile.TemporaryDirectory() as tmp:
    for rate in map(float, a.rates.split(",")):
        path = Path(tmp) / f"agree{rate}.gguf"
        synthesize(path, SynthOptions(mtp_agree=rate, type="Q4_K", seed=1))
        loaded = open_model(path)
        model = build_model(loaded, "cpu")
        head = MtpHead.load(loaded, model)
        if "verify" not in out:
            out["verify"] = measure_verify_cost(model, lambda: model.new_state(1, 512),
                                                loaded.config.n_vocab)
            print("verify cost by T:", out["verify"]["relative"])
        for k in a.drafts.split(","):
            res = speculative_tg(model, head, k if k == "auto" else int(k), gen=a.gen, reps=a.reps,
                                 n_vocab=loaded.config.n_vocab,
                                 new_state=lambda: model.new_state(1, 512), phases=a.phases)
            res["rate"] = rate
            out["runs"].append(res)
            print(f"rate {rate} k {k}: {res['speculative_tps']['median']:.1f} vs "
                  f"{res['plain_tps']['median']:.1f} tok/s ({res['speedup']}x), acceptance "
                  f"{res['acceptance']:.2f}, {res['tokens_per_step']:.2f} tok/step, by_k "
                  f"{res['by_k']}, same {res['same_tokens']}"
                  + (f", ms/step {res['phases_ms']}" if "phases_ms" in res else ""))
if a.json:
    Path(a.json).write_text(json.dumps(out, indent=1))
