"""qwen35moe (Qwen3.5 / 3.6 MoE): config keys, tensor schema, converter transforms.

The metadata keys, the tensors per layer kind and the converter's transforms of the qwen35moe
GGUF (llama.cpp's converter and loader are the reference). Shapes are torch order.
Legend: H hidden, E experts, K top-k, Fe expert ff, Fs shared ff, V vocab.
"""
from __future__ import annotations

import math
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

MAX_LAYERS = 4096      # real models have 40-60; bounds the schema built from the count
MAX_DIM = (1 << 31) - 1


def _type_name(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (list, np.ndarray)):
        return "array"
    return {str: "string", float: "float", int: "integer"}.get(type(v), type(v).__name__)


def _missing(full: str) -> GGUFError:
    return GGUFError(f"metadata key {full!r} is missing; the file was not converted as "
                     "qwen35moe by llama.cpp, or is damaged")


def _int(md: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False,
         lo: int = 1, hi: int = MAX_DIM, n_layers: int | None = None) -> Any:
    """An integer key in [lo, hi]; with n_layers, also a per-layer array of that length whose
    entries agree (we run uniform layers only)."""
    full = f"{ARCH}.{key}"
    if full not in md:
        if required:
            raise _missing(full)
        return default
    v = md[full]
    if isinstance(v, (list, np.ndarray)):
        arr = np.asarray(v) if isinstance(v, np.ndarray) else None
        if n_layers is None or arr is None or arr.dtype.kind not in "iu":
            raise GGUFError(f"{full} is an {'array of ' + _elem_name(v)}, expected one integer")
        if len(arr) != n_layers:
            raise GGUFError(f"{full} has {len(arr)} per-layer entries, expected "
                            f"{ARCH}.block_count = {n_layers}")
        vals = sorted(set(arr.tolist()))
        if len(vals) != 1:
            raise GGUFError(f"{full} varies per layer ({vals[:4]}...); per-layer values are "
                            "not supported")
        v = vals[0]
    if not isinstance(v, int) or isinstance(v, bool):
        raise GGUFError(f"{full} = {v!r:.40} is a {_type_name(v)}, expected an integer")
    if not lo <= v <= hi:
        raise GGUFError(f"{full} = {v} is out of range (expected {lo}..{hi})")
    return v


def _elem_name(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return str(v.dtype)
    return "strings" if v and isinstance(v[0], str) else "arrays"


def _float(md: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False,
           lo: float = 0.0, hi: float = float("inf")) -> float:
    full = f"{ARCH}.{key}"
    if full not in md:
        if required:
            raise _missing(full)
        return default
    v = md[full]
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise GGUFError(f"{full} = {v!r:.40} is a {_type_name(v)}, expected a number")
    if not (math.isfinite(v) and lo <= v <= hi):
        raise GGUFError(f"{full} = {v} is out of range (expected a finite number in "
                        f"{lo:g}..{hi:g})")
    return float(v)


def _int_array(md: Mapping[str, Any], key: str, *, kinds: str = "iu") -> np.ndarray | None:
    full = f"{ARCH}.{key}"
    v = md.get(full)
    if v is None:
        return None
    if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype.kind not in kinds:
        what = f"an array of {_elem_name(v)}" if isinstance(v, (list, np.ndarray)) \
            else f"a {_type_name(v)}"
        raise GGUFError(f"{full} is {what}, expected an array of integers")
    return v


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise GGUFError(msg)


def parse_config(md: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Qwen35MoeConfig:
    """Metadata (+ tensor shapes for the vocabulary) -> config. Every key is checked for its
    type and range and against the keys it must agree with; errors name the key."""
    A = ARCH + "."
    block_count = _int(md, "block_count", required=True, hi=MAX_LAYERS)
    per_layer = dict(n_layers=block_count)
    n_nextn = _int(md, "nextn_predict_layers", 0, lo=0, hi=MAX_LAYERS)
    n_layer = block_count - n_nextn
    _require(n_layer > 0, f"{A}block_count = {block_count} leaves no trunk layers after "
                          f"{A}nextn_predict_layers = {n_nextn} MTP layers")
    n_embd = _int(md, "embedding_length", required=True)
    n_head = _int(md, "attention.head_count", required=True, **per_layer)
    n_head_kv = _int(md, "attention.head_count_kv", n_head, **per_layer)
    _require(n_head % n_head_kv == 0, f"{A}attention.head_count = {n_head} is not a multiple "
                                      f"of {A}attention.head_count_kv = {n_head_kv}")
    head_dim = _int(md, "attention.key_length", n_embd // n_head)
    _require(head_dim > 0, f"{A}attention.key_length is missing and {A}embedding_length = "
                           f"{n_embd} / head_count = {n_head} gives 0")
    v_len = _int(md, "attention.value_length", head_dim)
    _require(v_len == head_dim, f"{A}attention.key_length = {head_dim} differs from "
                                f"{A}attention.value_length = {v_len}")
    n_expert = _int(md, "expert_count", required=True, **per_layer)
    n_expert_used = _int(md, "expert_used_count", required=True, **per_layer)
    _require(n_expert_used <= n_expert, f"{A}expert_used_count = {n_expert_used} exceeds "
                                        f"{A}expert_count = {n_expert}")
    n_ff = _int(md, "feed_forward_length", None, **per_layer)
    n_ff_exp = _int(md, "expert_feed_forward_length", None, **per_layer)
    if n_ff_exp is None:
        if n_ff is None:
            raise GGUFError(f"metadata key '{A}expert_feed_forward_length' is missing "
                            "(and no feed_forward_length to derive it from)")
        n_ff_exp = n_ff // n_expert_used
        _require(n_ff_exp > 0, f"{A}feed_forward_length = {n_ff} / expert_used_count = "
                               f"{n_expert_used} gives experts no width")
    n_ff_shexp = _int(md, "expert_shared_feed_forward_length", n_ff if n_ff is not None else 0,
                      lo=0, **per_layer)
    rec = _int_array(md, "attention.recurrent_layers", kinds="biu")
    if rec is not None:
        _require(len(rec) == block_count, f"{A}attention.recurrent_layers has {len(rec)} "
                                          f"entries, expected {A}block_count = {block_count}")
        recurrent = tuple(bool(x) for x in rec[:n_layer].tolist())
    else:
        interval = _int(md, "full_attention_interval", 4)
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    n_rot = _int(md, "rope.dimension_count", head_dim, lo=0)
    _require(n_rot <= head_dim and n_rot % 2 == 0,
             f"{A}rope.dimension_count = {n_rot} must be even and at most "
             f"{A}attention.key_length = {head_dim}")
    sections = _int_array(md, "rope.dimension_sections")
    if sections is None:
        raise _missing(f"{A}rope.dimension_sections")
    sec = sections.tolist()
    _require(1 <= len(sec) <= 4 and min(sec) >= 0 and sum(sec) <= n_rot // 2,
             f"{A}rope.dimension_sections = {sec[:6]} must be 1-4 non-negative pair counts "
             f"adding up to at most {A}rope.dimension_count / 2 = {n_rot // 2}")
    ssm_d_inner = _int(md, "ssm.inner_size", required=True)
    ssm_d_state = _int(md, "ssm.state_size", required=True)
    n_v_heads = _int(md, "ssm.time_step_rank", required=True)
    n_k_heads = _int(md, "ssm.group_count", required=True)
    _require(ssm_d_inner % n_v_heads == 0, f"{A}ssm.inner_size = {ssm_d_inner} is not a "
                                           f"multiple of {A}ssm.time_step_rank = {n_v_heads}")
    _require(n_v_heads % n_k_heads == 0, f"{A}ssm.time_step_rank = {n_v_heads} is not a "
                                         f"multiple of {A}ssm.group_count = {n_k_heads}")
    embd = shapes.get("token_embd.weight")
    if embd is None:
        raise GGUFError("tensor 'token_embd.weight' is missing")
    _require(len(embd) == 2 and embd[0] > 0, f"tensor 'token_embd.weight' has shape "
                                             f"{list(embd)}, expected [n_vocab, {n_embd}]")
    return Qwen35MoeConfig(
        n_layer=n_layer, n_nextn=n_nextn, n_embd=n_embd, n_vocab=int(embd[0]),
        n_ctx_train=_int(md, "context_length", required=True),
        n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp,
        n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_rot=n_rot,
        rope_base=_float(md, "rope.freq_base", 10000.0, lo=1e-30),
        rope_sections=tuple(sec),
        rms_eps=_float(md, "attention.layer_norm_rms_epsilon", required=True, hi=1.0),
        ssm_d_conv=_int(md, "ssm.conv_kernel", required=True, hi=1 << 16),
        ssm_d_inner=ssm_d_inner, ssm_d_state=ssm_d_state,
        ssm_n_v_heads=n_v_heads, ssm_n_k_heads=n_k_heads,
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


def mtp_schema(c: Qwen35MoeConfig) -> list[TensorSpec]:
    """The first MTP / NextN block (blk.{n_layer}): a full-attention layer with its MoE
    (§2.2-2.3 shapes) and the NextN projections; embed_tokens and shared_head_head are optional
    (their absence means token_embd and the trunk's head)."""
    from dataclasses import replace
    full = replace(c, n_layer=c.n_layer + 1, recurrent=(True,) * c.n_layer + (False,))
    b = f"blk.{c.n_layer}."
    H, T = c.n_embd, TensorSpec
    return [s for s in tensor_schema(full) if s.name.startswith(b)] + [
        T(b + "nextn.eh_proj.weight", ((H, 2 * H),), "mtp"),
        T(b + "nextn.enorm.weight", ((H,),), "norm", matrix=False),
        T(b + "nextn.hnorm.weight", ((H,),), "norm", matrix=False),
        T(b + "nextn.shared_head_norm.weight", ((H,),), "norm", matrix=False)]


MTP_OPTIONAL = ("nextn.shared_head_norm.weight", "nextn.embed_tokens.weight",
                "nextn.shared_head_head.weight")   # suffixes a NextN block may lack


def extra_prefixes(c: Qwen35MoeConfig) -> tuple[str, ...]:
    """The MTP / NextN block (blk.{n_layer}..): recognised, loaded, not run in the main pass."""
    return tuple(f"blk.{c.n_layer + j}." for j in range(c.n_nextn))


# What the converter did to HF tensors, for the HF oracle and
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

ARCHITECTURE = register(Architecture(ARCH, parse_config, tensor_schema, extra_prefixes, mtp_schema))
