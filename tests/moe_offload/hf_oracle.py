"""An independent oracle: Hugging Face's `Qwen3_5MoeForCausalLM` built from a GGUF's weights.

Every tensor is dequantized with `loaders.quants.dequantize_reference`, mapped back to HF's
names and undone through `loaders.archs.qwen35moe.CONVERTER_TRANSFORMS` (the one table of what
the converter did): norms lose their folded +1, `A_log = log(-ssm_a)`, and the value-head
tiling is reversed (GGUF v-head j == HF v-head (j mod Hk)*r + j // Hk).
"""
from __future__ import annotations

import re

import numpy as np
import torch

from loaders import LoadedModel, dequantize_reference
from loaders.archs.qwen35moe import CONVERTER_TRANSFORMS, Qwen35MoeConfig

# GGUF suffix -> HF suffix (under model.layers.N.)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    # gated delta-net layers
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    # full-attention layers
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def hf_config(c: Qwen35MoeConfig):
    """Our config -> HF `Qwen3_5MoeTextConfig` (eager attention, float32)."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=c.n_vocab, hidden_size=c.n_embd, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_head_kv, head_dim=c.head_dim,
        linear_conv_kernel_dim=c.ssm_d_conv, linear_key_head_dim=c.ssm_d_state,
        linear_value_head_dim=c.ssm_head_v_dim, linear_num_key_heads=c.ssm_n_k_heads,
        linear_num_value_heads=c.ssm_n_v_heads, moe_intermediate_size=c.n_ff_exp,
        shared_expert_intermediate_size=c.n_ff_shexp, num_experts=c.n_expert,
        num_experts_per_tok=c.n_expert_used, rms_norm_eps=c.rms_eps,
        max_position_embeddings=c.n_ctx_train, tie_word_embeddings=c.tied_output,
        layer_types=["linear_attention" if r else "full_attention" for r in c.recurrent],
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base,
                         "partial_rotary_factor": c.n_rot / c.head_dim,
                         "mrope_section": list(c.rope_sections[:3]), "mrope_interleaved": True})
    cfg._attn_implementation = "eager"
    return cfg


def _untile(t: torch.Tensor, dim: int, start: int, c: Qwen35MoeConfig) -> torch.Tensor:
    """Reverse the converter's V-head reorder on t[start:] along `dim` (loaders/archs/qwen35moe.py's TRANSFORMS)."""
    hk, hv = c.ssm_n_k_heads, c.ssm_n_v_heads
    r = hv // hk
    j = np.arange(hv)
    inv = np.empty(hv, np.int64)
    inv[(j % hk) * r + j // hk] = j                      # HF head m holds GGUF head inv[m]
    span = t.narrow(dim, start, t.shape[dim] - start)
    blocks = span.unflatten(dim, (hv, -1)).index_select(dim, torch.from_numpy(inv))
    return torch.cat([t.narrow(dim, 0, start), blocks.flatten(dim, dim + 1)], dim=dim)


def _undo(name: str, t: torch.Tensor, c: Qwen35MoeConfig) -> torch.Tensor:
    """Undo every converter transform of the table that names this tensor."""
    suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
    recurrent = name.startswith("blk.") and c.recurrent[int(name.split(".")[1])]
    if suffix in CONVERTER_TRANSFORMS["norm_plus_one"]:
        t = t - 1.0
    if suffix == CONVERTER_TRANSFORMS["a_log_to_ssm_a"]:
        t = torch.log(-t)
    if recurrent:
        for entry in CONVERTER_TRANSFORMS["v_heads_tiled"]:
            m = re.fullmatch(r"([^\[]+)(?:\[(.*)\])?", entry)
            if m.group(1) != suffix:
                continue
            where = m.group(2) or "rows"
            dim = 1 if where == "columns" else 0
            start = 2 * c.ssm_key_dim if where in ("v rows", "v channels") else 0
            t = _untile(t, dim, start, c)
    return t


def hf_state_dict(model: LoadedModel) -> dict[str, torch.Tensor]:
    """Every trunk tensor of a GGUF as the float32 HF state dict of Qwen3_5MoeForCausalLM."""
    c = model.config
    deq = {n: torch.from_numpy(np.array(dequantize_reference(w.data, w.qtype, w.shape),
                                        dtype=np.float32)) for n, w in model.weights.items()}
    sd: dict[str, torch.Tensor] = {}
    for name, t in deq.items():
        t = _undo(name, t, c)
        if not name.startswith("blk."):
            sd[_GLOBAL_NAMES[name]] = t
            continue
        _, layer, suffix = name.split(".", 2)
        pre = f"model.layers.{layer}."
        if suffix in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            continue  # joined below
        if suffix == "attn_qkv.weight" and not c.recurrent[int(layer)]:  # fused full-attn qkv
            qg, kv = 2 * c.n_head * c.head_dim, c.n_head_kv * c.head_dim
            for part, x in zip("qkv", t.split([qg, kv, kv])):
                sd[pre + f"self_attn.{part}_proj.weight"] = x
            continue
        if suffix == "ssm_conv1d.weight":
            t = t.unsqueeze(1)                                 # [C, K] -> [C, 1, K]
        if suffix == "ffn_gate_inp_shexp.weight":
            t = t.reshape(1, -1)
        sd[pre + _LAYER_NAMES[suffix]] = t
        if suffix == "ffn_down_exps.weight" and f"blk.{layer}.ffn_gate_exps.weight" in deq:
            sd[pre + "mlp.experts.gate_up_proj"] = torch.cat(
                [deq[f"blk.{layer}.ffn_gate_exps.weight"], deq[f"blk.{layer}.ffn_up_exps.weight"]], 1)
    if c.tied_output:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def build_hf_model(model: LoadedModel, device: str | torch.device = "cpu"):
    """HF's Qwen3_5MoeForCausalLM with the GGUF's weights, float32, eager attention, eval mode."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(hf_config(model.config)).to(torch.float32)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tied_output)]
    assert not missing and not unexpected, (missing, unexpected)
    return hf.eval().to(device)


@torch.no_grad()
def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    """Logits for every position of tokens [B, T] in one pass without cache -> [B, T, V]."""
    return hf(input_ids=tokens, use_cache=False).logits.float()
