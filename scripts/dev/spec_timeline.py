"""Where a speculative step leaves the GPU idle: one profiled greedy generation with fixed k,
the device's idle gaps and the host's Python calls that fill them.

    python scripts/dev/spec_timeline.py MODEL [--draft 3] [--trace] [--vram 8GiB] [--gen 64]

Opens the runtime with the file's MTP head (as `bench --draft`), runs one untimed generation,
then profiles one more (torch.profiler: CPU with the Python tracer, CUDA). The GPU's busy time is
the union of its kernels and copies; a gap is a stretch of more than --min-gap us with none. For
the gaps the host's Python functions overlapping them are summed by name (a caller and its
callees both count). Prints the step count, the busy and idle time a step, and the top names.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import sys
import tempfile

import numpy as np
import torch


def main() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from draft_guess_ab import open_mtp_runtime   # beside this script
    from moe_offload.gen import SamplingParams, generate
    from moe_offload.spec import SpeculativeDecoder
    from torch.profiler import ProfilerActivity, profile
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--vram", default="8GiB")
    p.add_argument("--draft", default="3")
    p.add_argument("--trace", action="store_true")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--min-gap", type=float, default=5.0)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json")
    args = p.parse_args()
    rt, c = open_mtp_runtime(args.model, args.vram, args.trace)
    params = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eog=True)
    rng = np.random.default_rng(0)
    dec = SpeculativeDecoder(rt, rt.mtp, args.draft, phases=False)

    def run():
        st = rt.new_state(1, 4096)
        torch.cuda.synchronize()
        for _ in generate(rt, st, rng.integers(0, c.n_vocab, 16).tolist(), params, draft=dec):
            pass
        torch.cuda.synchronize()
        rt.release(st)

    run()
    run()
    dec.reset_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        run()
    steps = dec.stats.steps
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, gaps = 0.0, []
    cur_s, cur_e = gpu[0]
    for s, e in gpu[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            if s - cur_e > args.min_gap:
                gaps.append((cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    idle = sum(b - a for a, b in gaps)
    span = gpu[-1][1] - gpu[0][0]
    print(f"{steps} steps, {dec.stats.tokens} tokens: span {span / 1e3:.2f} ms, GPU busy "
          f"{busy / 1e3:.2f} ms, idle gaps > {args.min_gap} us {idle / 1e3:.2f} ms "
          f"({len(gaps)} gaps); a step: busy {busy / steps / 1e3:.3f} ms, idle {idle / steps / 1e3:.3f} ms")
    sizes = sorted(b - a for a, b in gaps)
    if sizes:
        print("gap us: median %.0f, p90 %.0f, max %.0f" % (sizes[len(sizes) // 2],
              sizes[int(len(sizes) * 0.9)], sizes[-1]))
    host = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op")]
    by = collections.Counter()
    gaps.sort()
    starts = [a for a, _ in gaps]
    for e in host:
        s, t = e["ts"], e["ts"] + e["dur"]
        i = max(0, bisect.bisect_right(starts, s) - 1)
        ov = 0.0
        while i < len(gaps) and gaps[i][0] < t:
            a, b = gaps[i]
            ov += max(0.0, min(b, t) - max(a, s))
            i += 1
        if ov > 0:
            by[e["name"][:110]] += ov
    print(f"host calls overlapping the gaps (us a step, inclusive of callees):")
    for name, us in by.most_common(args.top):
        print(f"  {us / steps:8.1f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": steps, "busy_ms": busy / 1e3, "idle_ms": idle / 1e3,
                       "gaps_us": sizes, "host_us_per_step": {k: v / steps for k, v in by.most_common(200)}}, f)


if __name__ == "__main__":
    main()
