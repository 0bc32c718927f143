"""Dev measurement on a GPU: decode greedily with every weight resident and record, per token and
MoE layer, the experts the router chose and what several guessers would have predicted for them.
The offload policy can then be simulated offline on real routing (scripts/dev/guess_sim.py).

Guessers of layer L's router logits, each available at a different time of the step:
  f1    router_L(f_{L-1})        layer L-1's MoE input (what the runtime guesses from now)
  f2    router_L(f_{L-2})        two layers back
  out1  router_L(norm(x) * w)    the residual after layer L-1's experts, normed with L's
                                 post-attention weight (available one MoE later than f1)
  emb   router_0(norm(e) * w)    layer 0 from the token's embedding (known once it is sampled)

usage: routing_dump.py MODEL.gguf [--tokens N] [--out DIR]"""
import argparse
import os
import time

import numpy as np
import torch

from loaders import open_model
from moe_offload.models import build_model, layers
from moe_offload.models import qwen35moe as q

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--tokens", type=int, default=384)
ap.add_argument("--prompt", type=int, default=16)
ap.add_argument("--out", default="routing", help="folder: ids.npy and one LOGITS.npz per guesser")
args = ap.parse_args()

loaded = open_model(args.model)
c = loaded.config
dev = "cuda" if torch.cuda.is_available() else "cpu"
m = build_model(loaded, dev)
nL, E, K = c.n_layer, c.n_expert, c.n_expert_used
st = m.new_state(1, args.prompt + args.tokens + 8, torch.float16)

resid: list[torch.Tensor] = []   # x after each residual add (2 a layer + the final norm)
moe_in: list[torch.Tensor] = []
chosen: list[torch.Tensor] = []
original_norm = q.residual_rms_norm


def recording_norm(x, w, eps, *rest):
    out = original_norm(x, w, eps, *rest)
    resid.append(x[-1].detach().float().clone())
    return out


class Recorder:
    def __init__(self, inner):
        self.inner = inner

    def __call__(self, x, ids, w):
        moe_in.append(x[-1].detach().clone())
        chosen.append(ids[-1].detach().to(torch.int16).clone())
        return self.inner(x, ids, w)


m.experts = [Recorder(e) for e in m.experts]
post_w = [m.blk[L]["post_attention_norm.weight"] for L in range(nL)]

tok = m.prefill(torch.randint(0, c.n_vocab, (1, args.prompt)).to(dev), st).argmax(-1)
ids_out = np.zeros((args.tokens, nL, K), np.int16)
logits = {k: np.zeros((args.tokens, nL, E), np.float16) for k in ("f1", "f2", "out1", "emb")}
t0 = time.perf_counter()
q.residual_rms_norm = recording_norm
with torch.no_grad():
    for n in range(args.tokens):
        resid.clear(), moe_in.clear(), chosen.clear()
        out = m.decode(tok, st)
        tok = out.argmax(-1)
        assert len(moe_in) == nL and len(resid) == 2 * nL + 1, (len(moe_in), len(resid))
        ids_out[n] = torch.stack(chosen).cpu().numpy()
        rows = {"f1": [], "f2": [], "out1": [], "emb": []}
        for L in range(nL):
            zero = torch.zeros(E, device=dev)
            rows["f1"].append(m.router_logits(L, moe_in[L - 1][None])[0] if L >= 1 else zero)
            rows["f2"].append(m.router_logits(L, moe_in[L - 2][None])[0] if L >= 2 else zero)
            # resid[2L] is x before layer L's attention: the residual after layer L-1's experts
            normed = layers.rms_norm(resid[2 * L][None], post_w[L], c.rms_eps)
            rows["out1"].append(m.router_logits(L, normed)[0] if L >= 1 else zero)
            rows["emb"].append(m.router_logits(0, normed)[0] if L == 0 else zero)
        for k, v in rows.items():
            logits[k][n] = torch.stack(v).float().cpu().numpy()
q.residual_rms_norm = original_norm
print(f"{args.tokens} tokens in {time.perf_counter() - t0:.1f} s; distinct next tokens "
      f"{len(set(ids_out[:, 0, 0].tolist()))}")
os.makedirs(args.out, exist_ok=True)   # one file per guesser: each stays a few MB
np.save(os.path.join(args.out, "ids.npy"), ids_out)
for k, v in logits.items():
    np.savez_compressed(os.path.join(args.out, f"{k}.npz"), logits=v)
# quick look: how often each guesser's top-k contains the chosen experts
for k in ("f1", "f2", "out1", "emb"):
    lo = 0 if k == "emb" else (2 if k == "f2" else 1)
    hi = 1 if k == "emb" else nL
    for top in (4, 6, 8, 12):
        hit = tot = 0
        for L in range(lo, hi):
            guess = np.argsort(-logits[k][:, L].astype(np.float32), axis=1)[:, :top]
            for n in range(args.tokens):
                s = set(ids_out[n, L].tolist())
                hit += len(s & set(guess[n].tolist()))
                tot += top
        print(f"{k:5s} top{top:2d}: precision {hit / tot:.3f}  recall {hit / ((hi - lo) * args.tokens * K):.3f}")
