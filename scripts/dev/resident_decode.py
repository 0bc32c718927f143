"""The ceiling the offload runtime is compared with: every weight resident on the GPU (no cap).

    python scripts/dev/resident_decode.py MODEL.gguf [--ab]

Prefill of 2048 tokens in one chunk and decode as a captured CUDA graph (128 replays), each the
median of 3 after a warm-up; then a kernel profile of 8 decode replays (kernels a step, GPU time
by kernel). --ab first: prefill without the fused projections (Qwen35Moe.FUSED_PROJECTIONS) and
with the step kernels off (instrument.switches.STEP_KERNELS), against the model as built.
Needs a CUDA GPU with room for the whole model.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def prefill_rates(m, st, n_vocab: int) -> list[float]:
    import torch
    out = []
    for r in range(4):
        st.reset()
        toks = torch.randint(0, n_vocab, (1, 2048), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        m.prefill(toks, st, chunk=2048)
        torch.cuda.synchronize()
        if r:
            out.append(2048 / (time.perf_counter() - t))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("model")
    p.add_argument("--ab", action="store_true",
                   help="prefill without fused projections, and with torch's step ops, first")
    args = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from loaders import open_model
    from moe_offload.instrument import switches
    from moe_offload.models import Qwen35Moe, build_model, upload_weights
    loaded = open_model(args.model)
    c = loaded.config
    if args.ab:
        m = Qwen35Moe(c, *upload_weights(loaded, "cuda"))
        pp = prefill_rates(m, m.new_state(1, 4096, torch.float16), c.n_vocab)
        print(f"A/B unfused projections: pp2048 {statistics.median(pp):.0f} tok/s")
        del m
        m = build_model(loaded, "cuda")
        switches.STEP_KERNELS = False
        try:
            pp = prefill_rates(m, m.new_state(1, 4096, torch.float16), c.n_vocab)
        finally:
            switches.STEP_KERNELS = True
        print(f"A/B fused, torch step ops: pp2048 {statistics.median(pp):.0f} tok/s")
        del m
        torch.cuda.empty_cache()
    m = build_model(loaded, "cuda")
    st = m.new_state(1, 4096, torch.float16, attn_bucket=256)
    pp = prefill_rates(m, st, c.n_vocab)
    st.reset()
    tok = m.prefill(torch.randint(0, c.n_vocab, (1, 16), device="cuda"), st).argmax(-1).clone()
    m.decode(tok, st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = m.decode(tok, st)
    tg = []
    for r in range(4):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(128):
            g.replay()
            tok.copy_(out.argmax(-1))
        torch.cuda.synchronize()
        if r:
            tg.append(128 / (time.perf_counter() - t))
    print(f"all resident (no cap): pp2048 {statistics.median(pp):.0f} tok/s {[round(x) for x in pp]}, "
          f"tg128 (graph) {statistics.median(tg):.1f} tok/s {[round(x, 1) for x in tg]}, "
          f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            g.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    n_kernels = sum(e.count for e in events) / 8
    gpu_us = sum(e.self_device_time_total for e in events) / 8
    print(f"decode step: {n_kernels:.0f} kernels, {gpu_us / 1e3:.2f} ms of kernel time per token")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"  {e.self_device_time_total / 8:9.1f} us/token  {e.count / 8:6.0f}x  {e.key[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
