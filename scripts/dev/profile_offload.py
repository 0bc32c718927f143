"""Dev profile on a GPU: where prefill and decode time goes in the offload runtime.
usage: profile_offload.py MODEL.gguf [VRAM]"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from loaders import open_model
from loaders.synth import parse_size
from moe_offload import OffloadPolicy, open_runtime

path = sys.argv[1]
vram = parse_size(sys.argv[2] if len(sys.argv) > 2 else "8GiB")
loaded = open_model(path)
c = loaded.config


def table(prof, n=18):
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=n, max_name_column_width=60))


for label, opts in (("eager", dict(use_graphs=False)),):
    rt = open_runtime(loaded, vram, ctx=4096, **opts)
    toks = torch.randint(0, c.n_vocab, (1, 2048)).cuda()
    st = rt.new_state()
    rt.prefill(toks[:, :256], st)
    torch.cuda.synchronize()
    st = rt.new_state()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        rt.prefill(toks, st)
        torch.cuda.synchronize()
        print(f"prefill 2048: {time.perf_counter() - t:.2f} s")
    table(prof)
    nxt = torch.tensor([1], device="cuda")
    for _ in range(4):
        nxt = rt.decode(nxt, st).argmax(-1)
    torch.cuda.synchronize()
    busy0 = sum(rt.engine.worker.busy_ns())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(16):
            nxt = rt.decode(nxt, st).argmax(-1)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    print(f"decode eager: {16 / dt:.1f} tok/s, CPU worker busy {(sum(rt.engine.worker.busy_ns()) - busy0) / 16 / 1e6:.2f} ms/token")
    table(prof, 14)
    rt.close()
    del rt

for q in (None, 0.0, 1.0):
    rt = open_runtime(loaded, vram, ctx=1024, policy=OffloadPolicy(fetch_fraction=q))
    st = rt.new_state()
    nxt = rt.prefill(torch.randint(0, c.n_vocab, (1, 16)).cuda(), st).argmax(-1)
    for _ in range(8):
        nxt = rt.decode(nxt, st).argmax(-1)
    torch.cuda.synchronize()
    busy0, ex0 = sum(rt.engine.worker.busy_ns()), sum(rt.engine.worker.experts())
    rt.reset_stats()
    t = time.perf_counter()
    for _ in range(64):
        nxt = rt.decode(nxt, st).argmax(-1)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    s = rt.stats().as_dict()
    print(f"graphs, fetch fraction {q}: {64 / dt:.1f} tok/s ({dt / 64 * 1e3:.2f} ms/token), hit {s['hit_rate']:.1%}, "
          f"fetched/tok {s['fetched'] / 64:.1f}, cpu/tok {s['cpu'] / 64:.1f}, CPU busy "
          f"{(sum(rt.engine.worker.busy_ns()) - busy0) / 64 / 1e6:.2f} ms/tok for "
          f"{(sum(rt.engine.worker.experts()) - ex0) / 64:.1f} experts, rates {s['rates']}")
    rt.close()
    del rt
    torch.cuda.empty_cache()

# the ceiling: everything resident (no cap)
from moe_offload.models import build_model
torch.cuda.set_per_process_memory_fraction(1.0)
m = build_model(loaded, "cuda")
st = m.new_state(1, 1024, torch.float16, attn_bucket=256)
nxt = m.prefill(torch.randint(0, c.n_vocab, (1, 16)).cuda(), st).argmax(-1)
g = torch.cuda.CUDAGraph()
tok = nxt.clone()
m.decode(tok, st)
with torch.cuda.graph(g):
    out = m.decode(tok, st)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(64):
    g.replay()
torch.cuda.synchronize()
print(f"all resident (no cap), graphs: {64 / (time.perf_counter() - t):.1f} tok/s")
