"""Dev check on a GPU: every matmul/moe of a synthetic model, CUDA kernels vs the reference.
Prints the worst relative error per weight and per op so a wrong kernel path stands out."""
import sys
import tempfile

import torch

from loaders import open_model
from loaders.synth import SynthOptions, synthesize
from native import ops
from native.ops import QTensor

qtype = sys.argv[1] if len(sys.argv) > 1 else "IQ3_S"
path = synthesize(tempfile.mktemp(suffix=".gguf"), SynthOptions(type=qtype))[0]
m = open_model(path)
torch.manual_seed(0)
worst = []
for name, w in m.weights.items():
    if len(w.shape) != 2 or w.qtype.family == "float" or name.startswith("token_embd"):
        continue
    q = QTensor.from_weight(w)
    qc = q.to("cuda")
    for T in (1, 3, 8, 70):
        x = torch.randn(T, w.shape[1])
        ref = ops.matmul_ref(x, q)
        got = ops.matmul(x.cuda(), qc).cpu()
        err = float((got - ref).abs().max() / ref.abs().max())
        worst.append((err, name, T))
worst.sort(reverse=True)
print(f"{qtype} matmul: worst relative errors (of {len(worst)})")
for e, n, T in worst[:8]:
    print(f"  {e:.2e}  {n}  T={T}")
for L in (0, 3):
    b = f"blk.{L}."
    g, u, d = (QTensor.from_weight(m.weights[b + f"ffn_{p}_exps.weight"]) for p in ("gate", "up", "down"))
    for T in (1, 5, 70):
        x = torch.randn(T, m.config.n_embd)
        ids = torch.stack([torch.randperm(m.config.n_expert)[:m.config.n_expert_used] for _ in range(T)])
        w = torch.softmax(torch.randn(T, m.config.n_expert_used), -1)
        ref = ops.moe_ffn_ref(x, g, u, d, ids, w)
        got = ops.moe_ffn(x.cuda(), g.to("cuda"), u.to("cuda"), d.to("cuda"), ids.cuda(), w.cuda()).cpu()
        print(f"moe layer {L} T={T}: rel err {float((got - ref).abs().max() / ref.abs().max()):.2e}")
