"""Dev measurement on a GPU: the model with every weight resident (no cap), CUDA-graph decode and
chunked prefill, median of 3 -- the ceiling the offload runtime is compared with."""
import statistics
import sys
import time

import torch

from loaders import open_model
from moe_offload.models import build_model

loaded = open_model(sys.argv[1])
c = loaded.config
m = build_model(loaded, "cuda")
st = m.new_state(1, 4096, torch.float16, attn_bucket=256)
pp = []
for r in range(4):
    st.reset()
    toks = torch.randint(0, c.n_vocab, (1, 2048)).cuda()
    torch.cuda.synchronize()
    t = time.perf_counter()
    m.prefill(toks, st, chunk=2048)
    torch.cuda.synchronize()
    if r:
        pp.append(2048 / (time.perf_counter() - t))
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
