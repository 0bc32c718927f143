"""qwen35moe (Qwen3.5 / 3.6 MoE) forward pass, written in terms of what the GGUF stores
(shared/docs/qwen35moe.md §4). Gated delta-net and gated full-attention mixers, routed + shared
experts. Ignorant of offload and quantization: every matmul weight is a `QTensor` that carries
its own type, and the routed experts are an injected callable per layer (see `weights.py`).

Legend: B batch, T new tokens, N = B*T, H hidden, E experts, K top-k, V vocab,
Hq/Hkv attention heads, d head dim, Hk/Hv delta-net key/value heads, dk/dv their dims.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from native import ops
from native.ops import QTensor

from ..errors import OffloadError
from ..state import State
from .layers import (attention, causal_conv, delta_rule_chunked, delta_rule_recurrent,
                     gated_rms_norm, l2_norm, rms_norm, rope_neox, route_topk, swiglu)
from .weights import Experts

DELTA_CHUNK = 64


def _mm(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out] through native.ops."""
    return ops.matmul(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])


class Qwen35Moe:
    """The model: config + {GGUF name: weight} + experts[layer](x, ids, weights) -> y."""

    def __init__(self, config, tensors: Mapping[str, QTensor | torch.Tensor],
                 experts: Sequence[Experts]):
        self.config = c = config
        self.experts = list(experts)
        if len(self.experts) != c.n_layer:
            raise OffloadError(f"{len(self.experts)} expert sets for {c.n_layer} layers")
        self.embd: QTensor = tensors["token_embd.weight"]
        self.head: QTensor = tensors.get("output.weight", self.embd)  # tied when absent
        self.out_norm: torch.Tensor = tensors["output_norm.weight"]
        self.blk = [{k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}
                    for p in (f"blk.{i}." for i in range(c.n_layer))]
        self.device = self.out_norm.device

    def new_state(self, batch: int = 1, n_ctx: int | None = None,
                  kv_dtype: torch.dtype = torch.float32, attn_bucket: int = 1) -> State:
        return State(self.config, batch, n_ctx, self.device, kv_dtype, attn_bucket)

    # -- entry points -------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, state: State, last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] int64 on the model's device -> logits [B, T or 1, V]; advances state."""
        c = self.config
        B, T = tokens.shape
        if B != state.batch:
            raise OffloadError(f"a batch of {B} sequences was given to a state of {state.batch}")
        state.check_room(T)
        pos = state.pos + torch.arange(T, device=self.device)               # [T]
        n_attn = state.attn_len(T)
        x = ops.dequantize(self.embd.data[tokens.reshape(-1)], self.embd.qtype,
                           (B * T, c.n_embd)).view(B, T, c.n_embd)          # [B, T, H]
        for i, L in enumerate(self.blk):
            a = rms_norm(x, L["attn_norm.weight"], c.rms_eps)
            if c.recurrent[i]:
                x = x + self._delta_net(L, a, state.conv[i], state.ssm[i])
            else:
                x = x + self._attention(L, a, state.k[i], state.v[i], pos, n_attn)
            f = rms_norm(x, L["post_attention_norm.weight"], c.rms_eps)
            x = x + self._moe(L, self.experts[i], f.view(B * T, c.n_embd)).view(B, T, c.n_embd)
        state.advance(T)
        if last_only:
            x = x[:, -1:]
        return _mm(rms_norm(x, self.out_norm, c.rms_eps), self.head)

    def prefill(self, tokens: torch.Tensor, state: State, chunk: int = 512,
                all_logits: bool = False) -> torch.Tensor:
        """A long prompt in chunks of `chunk` tokens -> last logits [B, V] (or all [B, T, V])."""
        state.check_room(tokens.shape[1])
        outs = [self.forward(tokens[:, s:s + chunk], state, last_only=not all_logits)
                for s in range(0, tokens.shape[1], chunk)]
        return torch.cat(outs, dim=1) if all_logits else outs[-1][:, 0]

    def decode(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """One token per sequence: tokens [B] -> logits [B, V]. No host syncs."""
        return self.forward(tokens[:, None], state)[:, 0]

    # -- mixers -------------------------------------------------------------------------------------

    def _attention(self, L, a, k_cache, v_cache, pos, n_attn) -> torch.Tensor:
        """Gated full attention (doc §4.3). a [B, T, H]; caches [B, n_ctx, Hkv, d]."""
        c = self.config
        B, T, _ = a.shape
        hq, hkv, d = c.n_head, c.n_head_kv, c.head_dim
        if "attn_qkv.weight" in L:  # fused variant: rows [q|gate interleaved, k, v]
            qg, k, v = _mm(a, L["attn_qkv.weight"]).split([2 * hq * d, hkv * d, hkv * d], -1)
        else:
            qg, k, v = (_mm(a, L[f"attn_{n}.weight"]) for n in "qkv")
        qg = qg.view(B, T, hq, 2, d)                       # per head: d query rows, d gate rows
        q, gate = qg[..., 0, :], qg[..., 1, :]
        q = rope_neox(rms_norm(q, L["attn_q_norm.weight"], c.rms_eps), pos, c.n_rot, c.rope_base)
        k = rope_neox(rms_norm(k.view(B, T, hkv, d), L["attn_k_norm.weight"], c.rms_eps), pos,
                      c.n_rot, c.rope_base)
        k_cache.index_copy_(1, pos, k.to(k_cache.dtype))
        v_cache.index_copy_(1, pos, v.view(B, T, hkv, d).to(v_cache.dtype))
        k_pos = torch.arange(n_attn, device=a.device)
        o = attention(q, k_cache[:, :n_attn].float(), v_cache[:, :n_attn].float(), pos, k_pos)
        o = o.reshape(B, T, hq * d) * torch.sigmoid(gate.reshape(B, T, hq * d))
        return _mm(o, L["attn_output.weight"])

    def _delta_net(self, L, a, conv_state, ssm_state) -> torch.Tensor:
        """Gated delta-net (doc §4.4). a [B, T, H]; value head j reads q/k head j mod Hk."""
        c = self.config
        B, T, _ = a.shape
        hk, hv, dk, dv = c.ssm_n_k_heads, c.ssm_n_v_heads, c.ssm_d_state, c.ssm_head_v_dim
        mix = _mm(a, L["attn_qkv.weight"])                                    # [B, T, conv_dim]
        z = _mm(a, L["attn_gate.weight"]).view(B, T, hv, dv)
        beta = torch.sigmoid(_mm(a, L["ssm_beta.weight"]))                    # [B, T, Hv]
        g = L["ssm_a"] * F.softplus(_mm(a, L["ssm_alpha.weight"]) + L["ssm_dt.bias"])
        y = F.silu(causal_conv(mix, conv_state, L["ssm_conv1d.weight"]))
        q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
        r = hv // hk                                                          # tile, not interleave
        q = l2_norm(q.reshape(B, T, hk, dk), c.rms_eps).repeat(1, 1, r, 1) * dk ** -0.5
        k = l2_norm(k.reshape(B, T, hk, dk), c.rms_eps).repeat(1, 1, r, 1)
        rule = delta_rule_recurrent if T == 1 else delta_rule_chunked
        o = rule(q, k, v.reshape(B, T, hv, dv), g, beta, ssm_state)           # [B, T, Hv, dv]
        o = gated_rms_norm(o, z, L["ssm_norm.weight"], c.rms_eps)
        return _mm(o.reshape(B, T, hv * dv), L["ssm_out.weight"])

    # -- experts ------------------------------------------------------------------------------------

    def _moe(self, L, experts: Experts, f: torch.Tensor) -> torch.Tensor:
        """Routed top-k experts + sigmoid-gated shared expert (doc §4.5). f [N, H] -> [N, H]."""
        ids, w = route_topk(_mm(f, L["ffn_gate_inp.weight"]), self.config.n_expert_used)
        y = experts(f, ids, w)
        if "ffn_gate_shexp.weight" in L:
            s = torch.sigmoid(_mm(f, L["ffn_gate_inp_shexp.weight"]))          # [N, 1]
            h = swiglu(_mm(f, L["ffn_gate_shexp.weight"]), _mm(f, L["ffn_up_shexp.weight"]))
            y = y + s * _mm(h, L["ffn_down_shexp.weight"])
        return y
