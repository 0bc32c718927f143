"""Decode tokens per second of B sequences at different positions: one at a time (B decode calls a
step) against one `decode_many` step, on the plain model (CPU or one GPU).

  python scripts/dev/decode_many_bench.py [MODEL] [--device cpu] [--batches 1,2,4,8] [--steps 16]
                                          [--threads N]

MODEL defaults to the embedded tiny model. Each figure is the best of 3 runs of --steps steps,
after prompts of 20, 27, 34, ... tokens. Rates are given against wall time and, on the CPU,
against the process's CPU time (all threads): on a machine shared with other jobs the CPU-time
rate is the steadier measure of the work a token costs.
"""
from __future__ import annotations

import argparse
import time


def rate(model, batch: int, together: bool, steps: int, clock) -> float:
    import torch
    dev = model.device
    states = [model.new_state(1, 256) for _ in range(batch)]
    for b, st in enumerate(states):
        model.prefill(torch.tensor([list(range(10, 30 + 7 * b))], device=dev), st)
    toks = torch.full((batch,), 5, device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = clock()
    for _ in range(steps):
        if together:
            logits = model.decode_many(toks, states)
        else:
            logits = torch.stack([model.decode(toks[b:b + 1], st)[0] for b, st in enumerate(states)])
        toks = logits.argmax(-1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return batch * steps / (clock() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = p.parse_args()
    import torch

    from loaders import open_model
    from loaders.synth import default_model_path, ensure_default_model
    from moe_offload import build_model
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        ensure_default_model()
    path = args.model or default_model_path()
    model = build_model(open_model(path), args.device)
    clocks = {"wall": time.perf_counter}
    if model.device.type == "cpu":
        clocks["cpu"] = time.process_time
    print(f"{path} on {args.device}, torch threads {torch.get_num_threads()}")
    for b in (int(x) for x in args.batches.split(",")):
        cells = []
        for name, clock in clocks.items():
            alone, many = (max(rate(model, b, t, args.steps, clock) for _ in range(3))
                           for t in (False, True))
            cells.append(f"{name}: {alone:7.1f} one at a time, {many:7.1f} decode_many "
                         f"({many / alone:.2f}x)")
        print(f"B={b}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
