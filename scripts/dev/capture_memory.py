"""Dev measurement on a GPU: torch's memory around each decode-graph capture (one per attention
bucket of 256 positions), to size the decode headroom from data.

    python scripts/dev/capture_memory.py MODEL [--vram 8GiB] [--steps 600]
"""
import argparse

import torch

from freetoken_patch.cli.model_args import size_arg
from loaders import open_model
from moe_offload import open_runtime

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--vram", type=size_arg, default="8GiB")
ap.add_argument("--steps", type=int, default=600)
args = ap.parse_args()
MiB = 1 << 20
loaded = open_model(args.model)
c = loaded.config
rt = open_runtime(loaded, args.vram)
orig = rt._capture


def capture(tokens, state):
    torch.cuda.synchronize()
    before, alloc = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g = orig(tokens, state)
    torch.cuda.synchronize()
    print(f"capture at position {state.n_past}: reserved {before / MiB:.0f} -> "
          f"{torch.cuda.memory_reserved() / MiB:.0f} MiB (peak {torch.cuda.max_memory_reserved() / MiB:.0f}), "
          f"allocated {alloc / MiB:.0f} -> {torch.cuda.memory_allocated() / MiB:.0f}; "
          f"cache {rt.cache.nbytes / MiB:.0f} MiB, smi {(rt.smi.sample() or 0) / MiB:.0f} MiB")
    return g


rt._capture = capture
st = rt.new_state(1)
tok = rt.prefill(torch.randint(0, c.n_vocab, (1, 16)).cuda(), st).argmax(-1)
for _ in range(args.steps):
    tok = rt.decode(tok, st).argmax(-1)
torch.cuda.synchronize()
p = rt.vram_peaks()
print(f"after {args.steps} steps: smi {(rt.smi.sample() or 0) / MiB:.0f} MiB, peak "
      f"{(p['nvidia_smi_peak'] or 0) / MiB:.0f} (cap {args.vram / MiB:.0f}); torch reserved "
      f"{torch.cuda.memory_reserved() / MiB:.0f}; cache {rt.cache.nbytes / MiB:.0f}; slots "
      f"{min(rt.cache.slots)}-{max(rt.cache.slots)}; outside budget {rt.vram.outside / MiB:.0f}")
rt.close()
