"""The MTP (NextN) head against a reference written apart from the runtime: eh_proj and the
NextN norms in plain torch on dequantized weights (the block's formula, read afresh from models/mtp.py's docstring),
the block's attention + MoE by Hugging Face's own full-attention decoder layer (a one-layer
`Qwen3_5MoeTextModel` loaded like hf_oracle loads the trunk), the head as a plain matmul."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from loaders import GGUFError, dequantize_reference, open_model
from loaders.model import mtp_weights
from moe_offload.models import build_model
from moe_offload.models.mtp import MtpHead

import hf_oracle

pytestmark = pytest.mark.usefixtures("reference_kernels")


def _deq(w) -> torch.Tensor:
    return torch.from_numpy(np.array(dequantize_reference(w.data, w.qtype, w.shape), np.float32))


def reference_mtp(loaded, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Draft logits [T, V] of MTP rows 0..T-1 in one pass without a cache: row t reads the
    trunk's final-normed hidden[t] and token next_tokens[t] (the token after t)."""
    c = loaded.config
    ws = {n: _deq(w) for n, w in mtp_weights(loaded).items()}
    b = f"blk.{c.n_layer}."
    glob = {n: _deq(w) for n, w in loaded.weights.items() if not n.startswith("blk.")}
    emb_table = ws.get(b + "nextn.embed_tokens.weight", glob["token_embd.weight"])
    head = ws.get(b + "nextn.shared_head_head.weight",
                  glob.get("output.weight", glob["token_embd.weight"]))
    out_norm = ws.get(b + "nextn.shared_head_norm.weight", glob["output_norm.weight"])
    eps = c.rms_eps

    def norm(v, w):   # GGUF norm weights carry the +1 already
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    e = emb_table[next_tokens]
    x = torch.cat([norm(e, ws[b + "nextn.enorm.weight"]), norm(hidden, ws[b + "nextn.hnorm.weight"])],
                  -1) @ ws[b + "nextn.eh_proj.weight"].T
    # the block and the head's norm = a one-layer full-attention HF text model
    c1 = replace(c, n_layer=1, recurrent=(False,))
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextModel
    torch.manual_seed(0)
    hf = Qwen3_5MoeTextModel(hf_oracle.hf_config(c1)).float().eval()
    sd = {}
    for name, t in ws.items():
        suffix = name[len(b):]
        if suffix.startswith("nextn.") or suffix in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            continue
        t = hf_oracle._undo("blk.0." + suffix, t, c1)
        if suffix == "ffn_gate_inp_shexp.weight":
            t = t.reshape(1, -1)
        sd["layers.0." + hf_oracle._LAYER_NAMES[suffix]] = t
    if b + "ffn_gate_exps.weight" in ws:
        sd["layers.0.mlp.experts.gate_up_proj"] = torch.cat(
            [ws[b + "ffn_gate_exps.weight"], ws[b + "ffn_up_exps.weight"]], 1)
    sd["norm.weight"] = out_norm - 1.0        # HF's norms scale by (1 + w)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and missing == ["embed_tokens.weight"], (missing, unexpected)
    with torch.no_grad():
        g = hf(inputs_embeds=x[None], use_cache=False).last_hidden_state[0]
    return g @ head.T


@pytest.fixture(scope="module")
def mtp_model(synth_model):
    loaded = open_model(synth_model(mtp=True, type="Q4_K", seed=3))
    model = build_model(loaded, "cpu")
    return loaded, model, MtpHead.load(loaded, model)


def test_mtp_block_is_found_and_checked(mtp_model, synth_model):
    loaded, _, head = mtp_model
    assert head is not None and loaded.config.n_nextn == 1
    assert mtp_weights(open_model(synth_model())) == {}                 # no block: no head
    ws = mtp_weights(loaded)
    assert f"blk.{loaded.config.n_layer}.nextn.eh_proj.weight" in ws
    broken = replace(loaded, aside={n: w for n, w in loaded.aside.items() if "eh_proj" not in n})
    with pytest.raises(GGUFError, match="eh_proj"):
        mtp_weights(broken)


def test_mtp_logits_match_the_reference(mtp_model):
    loaded, model, head = mtp_model
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, loaded.config.n_vocab, (1, 13), generator=g)
    st = model.new_state(1, 64)
    _, hidden = model.prefill(toks[:, :12], st, hidden=True)            # positions 0..11
    # MTP rows 0..11: (h_t, token t+1); written in two calls to go through its KV cache
    first, _ = head.forward(hidden[:, :7], toks[:, 1:8], st)
    second, g_out = head.forward(hidden[:, 7:], toks[:, 8:13], st)
    ours = torch.cat([first, second], 1)[0]
    ref = reference_mtp(loaded, hidden[0], toks[0, 1:13])
    assert st.mtp_past == 12 and g_out.shape == (1, 5, loaded.config.n_embd)
    err = float((ours - ref).abs().max())
    assert err <= 2e-3 * float(ref.abs().max()), err
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_drafts_tell_the_ids_known_before_the_last_draft(mtp_model, k):
    """known(ids) gets the verify step's ids known while the last draft is computed -- t_n and
    the drafts before the last -- and the drafts are those made without it."""
    from moe_offload.models.mtp import greedy_drafts
    loaded, model, head = mtp_model
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, loaded.config.n_vocab, (1, 9), generator=g)
    st = model.new_state(1, 64)
    _, hidden = model.prefill(toks[:, :8], st, hidden=True)
    plain = greedy_drafts(head, hidden, toks[:, 1:9], st, k)
    assert st.mtp_past == 8
    st.mtp_past, seen = 0, []
    got = greedy_drafts(head, hidden, toks[:, 1:9], st, k, known=seen.append)
    assert got.tolist() == plain.tolist() and st.mtp_past == 8
    assert len(seen) == 1 and seen[0].tolist() == [int(toks[0, 8])] + plain[:k - 1].tolist()


def test_embedding_stand_ins_route_as_the_trunk_where_the_embedding_dominates(synth_model):
    """The stand-in of layer 0's MoE input (the embedding, normed by that layer's norm) through
    layer 0's router picks the experts the trunk picks, on a model whose residual stream is its
    embedding (the synthetic agreeing trunk); a wrong norm or layer would not."""
    from moe_offload.models.layers import route_topk
    loaded = open_model(synth_model(mtp_agree=0.8, type="Q4_K"))
    model, c = build_model(loaded, "cpu"), loaded.config
    toks = torch.randint(0, c.n_vocab, (1, 24), generator=torch.Generator().manual_seed(2))
    routed, inner = [], model.experts[0]

    def spy(x, ids, w):
        routed.append(ids.clone())
        return inner(x, ids, w)
    model.experts[0] = spy
    try:
        model.forward(toks, model.new_state(1, 64))
    finally:
        model.experts[0] = inner
    stand_ins = model.embedding_moe_inputs(toks[0], 2)
    assert len(stand_ins) == 2 and stand_ins[0].shape == (24, c.n_embd)
    guess, _ = route_topk(model.router_logits(0, stand_ins[0]), c.n_expert_used)
    same = [set(a.tolist()) == set(b.tolist()) for a, b in zip(guess, routed[0])]
    assert sum(same) >= 0.9 * len(same), sum(same)
    other, _ = route_topk(model.router_logits(1, stand_ins[0]), c.n_expert_used)
    assert sum(set(a.tolist()) == set(b.tolist()) for a, b in zip(other, routed[0])) < 0.5 * len(same)
