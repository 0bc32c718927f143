"""qwen35moe (Qwen3.5 / 3.6 MoE): config keys, tensor schema, converter transforms.

Facts from shared/docs/qwen35moe.md (§1 keys, §2 tensors, §3 transforms). Shapes are torch order.
Legend: H hidden, E experts, K top-k, Fe expert ff, Fs shared ff, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..errors import GGUFError
from ..registry import Architecture, TensorSpec, register

ARCH = "qwen35moe"


@dataclass(frozen=True)
class Qwen35MoeConfig:
    n_layer: int                 # trunk layers = block_count - nextn_predict_layers
    n_nextn: int                 # MTP layers stored after the trunk (kept aside)
    n_embd: int                  # H
    n_vocab: int                 # V (rows of token_embd)
    n_ctx_train: int
    n_expert: int                # E
    n_expert_used: int           # K
    n_ff_exp: int                # Fe
    n_ff_shexp: int              # Fs (0: no shared expert)
    n_head: int
    n_head_kv: int
    head_dim: int                # key_length == value_length
    n_rot: int                   # rotated dims per head (partial NEOX RoPE)
    rope_base: float
    rope_sections: tuple[int, ...]
    rms_eps: float
    ssm_d_conv: int              # conv kernel (4)
    ssm_d_inner: int             # value_dim = H_v * d_v
    ssm_d_state: int             # d_k (= d_v)
    ssm_n_v_heads: int           # H_v (time_step_rank)
    ssm_n_k_heads: int           # H_k (group_count)
    recurrent: tuple[bool, ...]  # per trunk layer: gated delta-net (True) or full attention
    tied_output: bool            # output.weight absent: the head reuses token_embd

    @property
    def ssm_head_v_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_n_v_heads

    @property
    def ssm_key_dim(self) -> int:
        return self.ssm_n_k_heads * self.ssm_d_state

    @property
    def ssm_conv_dim(self) -> int:
        return 2 * self.ssm_key_dim + self.ssm_d_inner

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.recurrent) if not r]

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.recurrent) if r]


# -- config -------------------------------------------------------------------------------------

def _scalar(md: Mapping[str, Any], key: str, default: Any = None, required: bool = False,
            what: str = "") -> Any:
    full = f"{ARCH}.{key}"
    if full not in md:
        if required:
            raise GGUFError(f"metadata key {full!r} is missing{what}; the file was not converted "
                            "as qwen35moe by llama.cpp, or is damaged")
        return default
    v = md[full]
    if isinstance(v, (list, np.ndarray)):  # per-layer array: we run uniform layers only
        vals = {int(x) if not isinstance(x, float) else x for x in np.asarray(v).tolist()}
        if len(vals) != 1:
            raise GGUFError(f"metadata {full!r} varies per layer ({sorted(vals)[:4]}...); "
                            "per-layer values are not supported")
        v = vals.pop()
    return v


def parse_config(md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Qwen35MoeConfig:
    """Metadata (+ tensor shapes for the vocabulary) -> config; required keys fail by name."""
    block_count = int(_scalar(md, "block_count", required=True))
    n_nextn = int(_scalar(md, "nextn_predict_layers", 0))
    n_layer = block_count - n_nextn
    if n_layer <= 0:
        raise GGUFError(f"{ARCH}.block_count={block_count} leaves no trunk layers after "
                        f"{n_nextn} MTP layers")
    n_embd = int(_scalar(md, "embedding_length", required=True))
    n_head = int(_scalar(md, "attention.head_count", required=True))
    head_dim = int(_scalar(md, "attention.key_length", n_embd // n_head))
    v_len = int(_scalar(md, "attention.value_length", head_dim))
    if v_len != head_dim:
        raise GGUFError(f"{ARCH}: attention key_length {head_dim} != value_length {v_len}")
    n_expert_used = int(_scalar(md, "expert_used_count", 0))
    n_ff = _scalar(md, "feed_forward_length", None)
    n_ff_exp = _scalar(md, "expert_feed_forward_length", None)
    if n_ff_exp is None:
        if n_ff is None or not n_expert_used:
            raise GGUFError(f"metadata key '{ARCH}.expert_feed_forward_length' is missing "
                            "(and no feed_forward_length to derive it from)")
        n_ff_exp = int(n_ff) // n_expert_used
    n_ff_shexp = _scalar(md, "expert_shared_feed_forward_length", n_ff if n_ff is not None else 0)
    rec = md.get(f"{ARCH}.attention.recurrent_layers")
    if rec is not None:
        rec = [bool(x) for x in np.asarray(rec).tolist()]
        if len(rec) < n_layer:
            raise GGUFError(f"{ARCH}.attention.recurrent_layers has {len(rec)} entries, "
                            f"expected {block_count}")
        recurrent = tuple(rec[:n_layer])
    else:
        interval = int(_scalar(md, "full_attention_interval", 4))
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    sections = md.get(f"{ARCH}.rope.dimension_sections")
    if sections is None:
        raise GGUFError(f"metadata key '{ARCH}.rope.dimension_sections' is missing")
    embd = shapes.get("token_embd.weight")
    if embd is None:
        raise GGUFError("tensor 'token_embd.weight' is missing")
    n_vocab = int(embd[0])
    req = dict(required=True)
    return Qwen35MoeConfig(
        n_layer=n_layer, n_nextn=n_nextn, n_embd=n_embd, n_vocab=n_vocab,
        n_ctx_train=int(_scalar(md, "context_length", **req)),
        n_expert=int(_scalar(md, "expert_count", 0)), n_expert_used=n_expert_used,
        n_ff_exp=int(n_ff_exp), n_ff_shexp=int(n_ff_shexp),
        n_head=n_head, n_head_kv=int(_scalar(md, "attention.head_count_kv", n_head)),
        head_dim=head_dim, n_rot=int(_scalar(md, "rope.dimension_count", head_dim)),
        rope_base=float(_scalar(md, "rope.freq_base", 10000.0)),
        rope_sections=tuple(int(x) for x in np.asarray(sections).tolist()),
        rms_eps=float(_scalar(md, "attention.layer_norm_rms_epsilon", **req)),
        ssm_d_conv=int(_scalar(md, "ssm.conv_kernel", **req)),
        ssm_d_inner=int(_scalar(md, "ssm.inner_size", **req)),
        ssm_d_state=int(_scalar(md, "ssm.state_size", **req)),
        ssm_n_v_heads=int(_scalar(md, "ssm.time_step_rank", **req)),
        ssm_n_k_heads=int(_scalar(md, "ssm.group_count", **req)),
        recurrent=recurrent, tied_output="output.weight" not in shapes,
    )


# -- tensor schema --------------------------------------------------------------------------------

def tensor_schema(c: Qwen35MoeConfig) -> list[TensorSpec]:
    """Every trunk tensor, with alternatives (fused gate_up experts, fused attention qkv)."""
    H, E, Fe, Fs, V = c.n_embd, c.n_expert, c.n_ff_exp, c.n_ff_shexp, c.n_vocab
    hd = c.head_dim
    qg, kv = 2 * c.n_head * hd, c.n_head_kv * hd  # q rows interleave [q | gate] per head
    T = TensorSpec
    specs = [T("token_embd.weight", ((V, H),), "embed"),
             T("output_norm.weight", ((H,),), "norm", matrix=False)]
    if not c.tied_output:
        specs.append(T("output.weight", ((V, H),), "output"))
    for i in range(c.n_layer):
        b = f"blk.{i}."
        specs += [T(b + "attn_norm.weight", ((H,),), "norm", matrix=False),
                  T(b + "post_attention_norm.weight", ((H,),), "norm", matrix=False),
                  T(b + "ffn_gate_inp.weight", ((E, H),), "router"),
                  T(b + "ffn_gate_exps.weight", ((E, Fe, H),), "experts", group="split", slot=b + "gate_up"),
                  T(b + "ffn_up_exps.weight", ((E, Fe, H),), "experts", group="split", slot=b + "gate_up"),
                  T(b + "ffn_gate_up_exps.weight", ((E, 2 * Fe, H),), "experts", group="fused", slot=b + "gate_up"),
                  T(b + "ffn_down_exps.weight", ((E, H, Fe),), "experts")]
        if Fs:
            specs += [T(b + "ffn_gate_inp_shexp.weight", ((H,), (1, H)), "router", matrix=False),
                      T(b + "ffn_gate_shexp.weight", ((Fs, H),), "shared_expert"),
                      T(b + "ffn_up_shexp.weight", ((Fs, H),), "shared_expert"),
                      T(b + "ffn_down_shexp.weight", ((H, Fs),), "shared_expert")]
        if c.recurrent[i]:
            Hv, dv = c.ssm_n_v_heads, c.ssm_head_v_dim
            specs += [T(b + "attn_qkv.weight", ((c.ssm_conv_dim, H),), "ssm"),
                      T(b + "attn_gate.weight", ((c.ssm_d_inner, H),), "ssm"),
                      T(b + "ssm_beta.weight", ((Hv, H),), "ssm"),
                      T(b + "ssm_alpha.weight", ((Hv, H),), "ssm"),
                      T(b + "ssm_conv1d.weight", ((c.ssm_conv_dim, c.ssm_d_conv),), "ssm"),
                      T(b + "ssm_dt.bias", ((Hv,),), "ssm", matrix=False),
                      T(b + "ssm_a", ((Hv,),), "ssm", matrix=False),
                      T(b + "ssm_norm.weight", ((dv,),), "norm", matrix=False),
                      T(b + "ssm_out.weight", ((H, c.ssm_d_inner),), "ssm")]
        else:
            specs += [T(b + "attn_q.weight", ((qg, H),), "attn", group="split", slot=b + "qkv"),
                      T(b + "attn_k.weight", ((kv, H),), "attn", group="split", slot=b + "qkv"),
                      T(b + "attn_v.weight", ((kv, H),), "attn", group="split", slot=b + "qkv"),
                      T(b + "attn_qkv.weight", ((qg + 2 * kv, H),), "attn", group="fused", slot=b + "qkv"),
                      T(b + "attn_output.weight", ((H, c.n_head * hd),), "attn"),
                      T(b + "attn_q_norm.weight", ((hd,),), "norm", matrix=False),
                      T(b + "attn_k_norm.weight", ((hd,),), "norm", matrix=False)]
    return specs


def extra_prefixes(c: Qwen35MoeConfig) -> tuple[str, ...]:
    """The MTP / NextN block (blk.{n_layer}..): recognised, loaded, not run in the main pass."""
    return tuple(f"blk.{c.n_layer + j}." for j in range(c.n_nextn))


# What the converter did to HF tensors (shared/docs/qwen35moe.md §3), for the HF oracle and
# anyone mapping weights back. Keys are GGUF name suffixes.
CONVERTER_TRANSFORMS = {
    "norm_plus_one": ("attn_norm.weight", "post_attention_norm.weight", "output_norm.weight",
                      "attn_q_norm.weight", "attn_k_norm.weight"),  # stored w+1 (not ssm_norm)
    "a_log_to_ssm_a": "ssm_a",                 # stored -exp(A_log)
    "v_heads_tiled": ("attn_qkv.weight[v rows]", "attn_gate.weight", "ssm_beta.weight",
                      "ssm_alpha.weight", "ssm_conv1d.weight[v channels]", "ssm_dt.bias",
                      "ssm_a", "ssm_out.weight[columns]"),  # GGUF head j = HF (j%Hk)*r + j//Hk
    "q_gate_interleaved": "attn_q.weight",     # per head: 256 query rows then 256 gate rows
}

ARCHITECTURE = register(Architecture(ARCH, parse_config, tensor_schema, extra_prefixes))
