"""Dev measurement on a GPU: the model with every weight resident (no cap), CUDA-graph decode and
chunked prefill, median of 3 -- the ceiling the offload runtime is compared with. Then a kernel
profile of 8 decode graph replays (kernels per step, GPU time by kernel).
usage: resident_decode.py MODEL.gguf"""
import statistics
import sys
import time

import torch

from loaders import open_model
from moe_offload.models import Qwen35Moe, build_model, layers, upload_weights

loaded = open_model(sys.argv[1])
c = loaded.config


def prefill_rate(m, st) -> list[float]:
    out = []
    for r in range(4):
        st.reset()
        toks = torch.randint(0, c.n_vocab, (1, 2048)).cuda()
        torch.cuda.synchronize()
        t = time.perf_counter()
        m.prefill(toks, st, chunk=2048)
        torch.cuda.synchronize()
        if r:
            out.append(2048 / (time.perf_counter() - t))
    return out


if "--ab" in sys.argv:  # prefill without the fused projections / without the step kernels
    m = Qwen35Moe(c, *upload_weights(loaded, "cuda"))
    print(f"A/B unfused projections: pp2048 {statistics.median(prefill_rate(m, m.new_state(1, 4096, torch.float16))):.0f}")
    del m
    m = build_model(loaded, "cuda")
    layers.STEP_KERNELS = False
    print(f"A/B fused, torch step ops: pp2048 {statistics.median(prefill_rate(m, m.new_state(1, 4096, torch.float16))):.0f}")
    layers.STEP_KERNELS = True
    del m
    torch.cuda.empty_cache()
m = build_model(loaded, "cuda")
st = m.new_state(1, 4096, torch.float16, attn_bucket=256)
pp = prefill_rate(m, st)
st.reset()
nxt = m.prefill(torch.randint(0, c.n_vocab, (1, 16)).cuda(), st).argmax(-1)
tok = nxt.clone()
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

from torch.profiler import ProfilerActivity, profile  # noqa: E402

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
