"""The qwen35moe forward pass against an independent oracle: Hugging Face's Qwen3_5MoeForCausalLM
built from the same (dequantized, converter-undone) weights of a tiny synthetic GGUF.

Tolerance: logits (|logit| up to ~2) agree within ATOL = 1e-4 absolute in float32; observed
differences are a few 1e-6. Kernels are forced to the reference path (see conftest) so this
checks the model's math; kernel accuracy has its own tests in tests/native.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_oracle import build_hf_model, hf_logits
from helpers import rewrite
from loaders import open_model
from moe_offload.errors import OffloadError
from moe_offload.models import Qwen35Moe, ResidentExperts, build_model, upload_weights
from moe_offload.models.qwen35moe import FUSED_PROJECTIONS
from moe_offload.models.layers import delta_rule_chunked, delta_rule_recurrent

pytestmark = pytest.mark.usefixtures("reference_kernels")

ATOL = 1e-4
N_TOKENS = 70  # two delta-net chunks of 64, the second padded
QUANTS = {
    "IQ3_S": dict(type="IQ3_S"),
    "Q4_K": dict(type="Q4_K"),
    "mixed": dict(type="Q4_K", expert_type="IQ3_S", down_type="Q6_K", output_type="Q8_0"),
}
_CACHE: dict = {}


def _tokens(n_vocab: int, shape, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, n_vocab, shape, generator=torch.Generator().manual_seed(seed))


def _setup(path, device="cpu"):
    """(our model, HF logits of the fixed prompt, prompt), built once per file and device."""
    key = (str(path), device)
    if key not in _CACHE:
        loaded = open_model(path)
        toks = _tokens(loaded.config.n_vocab, (1, N_TOKENS))
        ref = hf_logits(build_hf_model(loaded, device), toks.to(device)).cpu()
        _CACHE[key] = (build_model(loaded, device), ref, toks)
    return _CACHE[key]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu() - b.cpu()).abs().max())


def _decode_all(model, toks: torch.Tensor) -> torch.Tensor:
    state = model.new_state(batch=toks.shape[0])
    return torch.stack([model.decode(toks[:, t], state) for t in range(toks.shape[1])], dim=1)


# ---- against the HF oracle -----------------------------------------------------------------------

@pytest.mark.parametrize("quant", list(QUANTS))
def test_prefill_matches_hf(synth_model, quant):
    model, ref, toks = _setup(synth_model(**QUANTS[quant]))
    ours = model.forward(toks, model.new_state())
    assert ours.shape == ref.shape
    assert _max_diff(ours, ref) < ATOL


@pytest.mark.parametrize("quant", list(QUANTS))
def test_token_by_token_decode_matches_hf(synth_model, quant):
    model, ref, toks = _setup(synth_model(**QUANTS[quant]))
    assert _max_diff(_decode_all(model, toks), ref) < ATOL


def test_tied_head_and_fused_tensors_match_hf(synth_model, tmp_path):
    """A file with fused gate_up experts, fused attention qkv and no output.weight (tied head)."""
    src = synth_model(type="Q4_K")
    m = open_model(src)
    c, add, drop = m.config, {}, ["output.weight"]
    for i in range(c.n_layer):
        b = f"blk.{i}."
        parts = [b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"]
        g, u = (m.weights[n] for n in parts)
        E, F, H = g.shape
        data = np.concatenate([g.data.reshape(E, F, -1), u.data.reshape(E, F, -1)], axis=1)
        add[b + "ffn_gate_up_exps.weight"] = ((H, 2 * F, E), g.qtype.type_id, data.tobytes())
        drop += parts
        if not c.recurrent[i]:
            parts = [b + f"attn_{x}.weight" for x in "qkv"]
            ws = [m.weights[n] for n in parts]
            rows = sum(w.shape[0] for w in ws)
            add[b + "attn_qkv.weight"] = ((H, rows), ws[0].qtype.type_id,
                                          np.concatenate([w.data for w in ws]).tobytes())
            drop += parts
    path = rewrite(src, tmp_path / "fused.gguf", drop=drop, add=add)
    fused = open_model(path)
    assert fused.config.tied_output and "blk.0.ffn_gate_up_exps.weight" in fused.weights
    model, ref, toks = _setup(path)
    assert _max_diff(model.forward(toks, model.new_state()), ref) < ATOL


@pytest.mark.parametrize("quant", ["IQ3_S", "mixed"])
def test_fused_projections_match_hf(synth_model, quant):
    """Projections of one input uploaded as one weight (what GPUs get) give the same logits."""
    path = synth_model(**QUANTS[quant])
    _, ref, toks = _setup(path)
    loaded = open_model(path)
    tensors, experts = upload_weights(loaded, "cpu", fuse=FUSED_PROJECTIONS)
    names = set(tensors)
    for i, recurrent in enumerate(loaded.config.recurrent):
        group = "attn_qkv.weight+attn_gate.weight+ssm_beta.weight+ssm_alpha.weight" if recurrent \
            else "attn_q.weight+attn_k.weight+attn_v.weight"
        assert f"blk.{i}.{group}" in names and f"blk.{i}.ffn_gate_shexp.weight" not in names
        router = tensors[f"blk.{i}.ffn_gate_inp.weight+ffn_gate_inp_shexp.weight"]
        assert router.parts == (loaded.config.n_expert, 1)
    model = Qwen35Moe(loaded.config, tensors, experts)
    assert _max_diff(model.forward(toks, model.new_state()), ref) < ATOL
    assert _max_diff(_decode_all(model, toks), ref) < ATOL


def test_projections_of_different_types_stay_apart(synth_model):
    path = synth_model(type="Q4_K", tensor_types=((r"attn_gate\.weight", "Q8_0"),
                                                  (r"ffn_up_shexp", "Q6_K")))
    _, ref, toks = _setup(path)
    loaded = open_model(path)
    tensors, experts = upload_weights(loaded, "cpu", fuse=FUSED_PROJECTIONS)
    assert "blk.0.attn_gate.weight" in tensors and "blk.0.ffn_up_shexp.weight" in tensors
    assert "blk.3.attn_q.weight+attn_k.weight+attn_v.weight" in tensors  # attention: all Q4_K
    model = Qwen35Moe(loaded.config, tensors, experts)
    assert _max_diff(model.forward(toks, model.new_state()), ref) < ATOL


# ---- the two forms of the delta rule -------------------------------------------------------------

@pytest.mark.parametrize("chunk", [64, 128])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_chunked_delta_rule_equals_recurrent(dtype, tol, chunk):
    g = torch.Generator().manual_seed(1)
    B, T, H, dk, dv = 2, 150, 3, 16, 8
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    q = torch.nn.functional.normalize(rnd(B, T, H, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(rnd(B, T, H, dk), dim=-1)
    v, beta = rnd(B, T, H, dv), torch.rand(B, T, H, generator=g, dtype=dtype)
    decay = -torch.rand(B, T, H, generator=g, dtype=dtype) * 2
    S0 = rnd(B, H, dk, dv)
    s_rec, s_chunk = S0.clone(), S0.clone()
    o_rec = delta_rule_recurrent(q, k, v, decay, beta, s_rec)
    o_chunk = delta_rule_chunked(q, k, v, decay, beta, s_chunk, chunk=chunk)
    assert o_chunk.shape == (B, T, H, dv)
    assert _max_diff(o_rec, o_chunk) < tol * max(1.0, float(o_rec.abs().max()))
    assert _max_diff(s_rec, s_chunk) < tol * max(1.0, float(s_rec.abs().max()))


# ---- state: pieces, batches, rewinds -----------------------------------------------------------

def test_prefill_then_decode_equals_one_long_prefill(synth_model):
    model, ref, toks = _setup(synth_model(**QUANTS["IQ3_S"]))
    state = model.new_state()
    parts = [model.prefill(toks[:, :45], state, chunk=32, all_logits=True)]
    parts += [model.decode(toks[:, t], state)[:, None] for t in range(45, 55)]
    parts.append(model.forward(toks[:, 55:], state))
    assert state.n_past == N_TOKENS
    assert _max_diff(torch.cat(parts, dim=1), ref) < ATOL
    last = model.prefill(toks, model.new_state(), chunk=16)
    assert _max_diff(last, ref[:, -1]) < ATOL


def test_batch_of_two_equals_each_alone(synth_model):
    model, _, _ = _setup(synth_model(**QUANTS["mixed"]))
    toks = _tokens(model.config.n_vocab, (2, 48), seed=3)
    state = model.new_state(batch=2)
    both = torch.cat([model.forward(toks[:, :40], state),
                      *(model.decode(toks[:, t], state)[:, None] for t in range(40, 48))], dim=1)
    for b in range(2):
        alone = model.forward(toks[b:b + 1], model.new_state())
        assert _max_diff(both[b:b + 1], alone) < ATOL


def test_reset_snapshot_restore(synth_model):
    model, ref, toks = _setup(synth_model(**QUANTS["IQ3_S"]))
    state = model.new_state()
    model.forward(toks[:, :30], state)
    snap = state.snapshot()
    a = model.forward(toks[:, 30:40], state)
    state.restore(snap)
    assert state.n_past == 30
    b = model.forward(toks[:, 30:40], state)
    assert torch.equal(a, b)
    state.reset()
    assert state.n_past == 0 and int(state.pos) == 0
    assert _max_diff(model.forward(toks, state), ref) < ATOL


def test_f16_kv_cache_is_close(synth_model):
    model, ref, toks = _setup(synth_model(**QUANTS["IQ3_S"]))
    state = model.new_state(kv_type="f16")
    assert state.k[3].dtype == torch.float16
    assert _max_diff(model.forward(toks, state), ref) < 1e-2


def test_attention_bucket_pads_without_changing_results(synth_model):
    model, ref, toks = _setup(synth_model(**QUANTS["IQ3_S"]))
    state = model.new_state(attn_bucket=64)
    model.prefill(toks[:, :60], state)
    assert state.attn_len(1) == 64
    out = torch.stack([model.decode(toks[:, t], state) for t in range(60, N_TOKENS)], dim=1)
    assert _max_diff(out, ref[:, 60:]) < ATOL


def test_prompt_longer_than_context_is_a_clear_error(synth_model):
    model, _, toks = _setup(synth_model(**QUANTS["IQ3_S"]))
    state = model.new_state(n_ctx=32)
    with pytest.raises(OffloadError, match=r"70 tokens do not fit the context of 32"):
        model.prefill(toks, state)
    assert state.n_past == 0
    model.forward(toks[:, :32], state)
    with pytest.raises(OffloadError, match="33 tokens do not fit"):
        model.decode(toks[:, 0], state)


# ---- the experts interface -----------------------------------------------------------------------

def test_experts_are_injectable(synth_model):
    """The offload runtime swaps experts[layer]; the model only calls experts(x, ids, weights)."""
    model, ref, toks = _setup(synth_model(**QUANTS["IQ3_S"]))
    calls = []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, x, ids, weights):
            calls.append((tuple(x.shape), tuple(ids.shape), ids.dtype, weights.dtype))
            return self.inner(x, ids, weights)

    resident = model.experts
    assert all(isinstance(e, ResidentExperts) for e in resident)
    model.experts = [Recording(e) for e in resident]
    try:
        out = model.forward(toks, model.new_state())
    finally:
        model.experts = resident
    c = model.config
    assert len(calls) == c.n_layer
    assert calls[0] == ((N_TOKENS, c.n_embd), (N_TOKENS, c.n_expert_used), torch.int64,
                        torch.float32)
    assert _max_diff(out, ref) < ATOL


# ---- the same on CUDA (the lead runs these on an H200) -------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["IQ3_S", "mixed"])
@pytest.mark.parametrize("experts_device", [None, "cpu"])
def test_cuda_prefill_and_decode_match_hf(synth_model, monkeypatch, quant, experts_device):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # HF's conv1d: exact f32
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    from moe_offload.instrument import switches     # the model's math: prompts' attention in
    monkeypatch.setattr(switches, "ATTENTION_TF32", False)   # f32 too (TF32: test_layers_gpu)
    path = synth_model(**QUANTS[quant])
    _, ref, toks = _setup(path, "cuda")
    model = build_model(open_model(path), "cuda", experts_device=experts_device)
    toks = toks.to("cuda")
    assert _max_diff(model.forward(toks, model.new_state()), ref) < ATOL
    assert _max_diff(_decode_all(model, toks), ref) < ATOL
