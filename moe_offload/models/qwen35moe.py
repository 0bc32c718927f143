"""qwen35moe (Qwen3.5 / 3.6 MoE) forward pass, written in terms of what the GGUF stores.
Gated delta-net and gated full-attention mixers, routed + shared experts. Ignorant of offload
and quantization: every matmul weight is a `QTensor` that carries its own type, the routed
experts are an injected callable per layer (see `weights.py`), and how the routed and shared
experts of a layer are ordered is an injected function (`moe_pair`; the offload runtime runs the
shared one on a side stream while the routed ones wait on PCIe).

One block stack (`blocks`) serves every entry point: a prompt or verify step of one State
(`forward`), one token of each of B States (`decode_many`) and the MTP head's block (mtp.py);
they differ only in the mixer each layer runs.

Legend: B batch, T new tokens, N = B*T, H hidden, E experts, K top-k, V vocab,
Hq/Hkv attention heads, d head dim, Hk/Hv delta-net key/value heads, dk/dv their dims.
"""
from __future__ import annotations

import functools
import weakref
from typing import Mapping, Sequence

import torch

from native import ops
from native.ops import QTensor

from ..config import PREFILL
from ..errors import OffloadError
from ..state import State, StateTable
from . import cpu_plan
from .attention import gated_attention, gated_attention_many
from .layers import (gated_delta_net, gated_delta_net_many, embed_rows, residual_rms_norm, rms_norm,
                     route_topk, swiglu)
from .names import ATTN_IN, FUSED_PROJECTIONS, ROUTER, SHEXP_IN, SSM_IN
from .weights import Experts


def _pool_held(fn):
    """On the CPU a forward keeps the kernel pool's threads awake between its few hundred calls
    (ops.cpu_threads_held); elsewhere it changes nothing."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        with ops.cpu_threads_held(self.device):
            return fn(self, *args, **kwargs)
    return run


def _mm(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out] through native.ops."""
    return ops.matmul(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])


def serial_pair(experts, f: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, shared):
    """A layer's routed experts, then its shared expert: (routed [N, H], shared [N, H])."""
    return experts(f, ids, w), shared()


class Qwen35Moe:
    """The model: config + {GGUF name: weight} + experts[layer](x, ids, weights) -> y."""

    FUSED_PROJECTIONS = FUSED_PROJECTIONS   # what weights.upload_weights may fuse on a GPU

    def __init__(self, config, tensors: Mapping[str, QTensor | torch.Tensor],
                 experts: Sequence[Experts], moe_pair=serial_pair):
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
        self.moe_pair = moe_pair   # (experts, f, ids, w, shared) -> (routed, shared): their order
        self._cpu_plans = weakref.WeakKeyDictionary()   # State -> its CPU plan (cpu_plan.py)

    def new_state(self, batch: int = 1, n_ctx: int | None = None,
                  kv_type="f32", attn_bucket: int = 1) -> State:
        return State(self.config, batch, n_ctx, self.device, kv_type, attn_bucket)

    # -- the block stack ----------------------------------------------------------------------------

    def blocks(self, x: torch.Tensor, layers, out_norm: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """The residual stream x [B*T, H] (updated in place) through `layers`, a sequence of
        (weights L, mixer(L, a [B, T, H]) -> [B, T, ...], experts); each layer: norm -> mixer ->
        norm -> routed + shared experts (their sum joins the stream at the next norm). Returns
        the final-normed hidden states [B*T, H]."""
        H, eps = self.config.n_embd, self.config.rms_eps
        moe_out: tuple = ()   # the previous layer's (routed, shared, shared gate), added by the next norm
        for L, mixer, experts in layers:
            a = residual_rms_norm(x, L["attn_norm.weight"], eps, *moe_out).view(B, T, H)
            m = mixer(L, a)
            f = residual_rms_norm(x, L["post_attention_norm.weight"], eps, m.reshape(B * T, H))
            moe_out = self._moe(L, experts, f)
        return residual_rms_norm(x, out_norm, eps, *moe_out)

    # -- entry points -------------------------------------------------------------------------------

    @_pool_held
    def forward(self, tokens: torch.Tensor, state: State, last_only: bool = False,
                hidden: bool = False, table: StateTable | None = None):
        """tokens [B, T] int64 on the model's device -> logits [B, T or 1, V]; advances state.
        hidden: -> (logits, the final-normed hidden states [B, T, H]: the MTP head's input).
        With state.keep_steps(D) and 1 < T <= D+1, the delta-net states after each token are
        kept (state.rewind). table (CUDA, B = 1, 1 <= T <= ops.DECODE_MAX_TOKENS, no kept
        steps): the state's buffers and position are reached through it (decode_many's)."""
        c = self.config
        B, T = tokens.shape
        if B != state.batch:
            raise OffloadError(f"a batch of {B} sequences was given to a state of {state.batch}")
        state.check_room(T)
        keep = bool(state.steps) and 1 < T <= next(iter(state.steps.values()))[0].shape[0] + 1
        if table is not None and (keep or B != 1 or T > ops.DECODE_MAX_TOKENS):
            raise OffloadError("a step through a state table takes 1..8 tokens of one sequence "
                               "that keeps no per-token states")
        plan = cpu_plan.plan_for(self, state) if 1 <= T <= cpu_plan.max_tokens() else None
        if plan is not None:   # the whole forward in one native call, the same bits
            logits, h = plan(tokens, state, keep, last_only, hidden)
            state.advance(T)
            state.steps_taken = T if keep else 0
            return (logits, h) if hidden else logits
        at = state.pos if table is None else table.positions()[0][0]
        pos = at + torch.arange(T, device=self.device)                      # [T]
        n_attn = state.attn_len(T)

        def mixer(i: int):
            if c.recurrent[i]:
                if table is not None:
                    return lambda L, a: self._delta_net(L, a, table.buffers("conv", i),
                                                        table.buffers("ssm", i))
                return lambda L, a: self._delta_net(L, a, state.conv[i], state.ssm[i],
                                                    state.steps[i] if keep else None)
            if table is not None:
                return lambda L, a: self._attention(L, a, table.buffers("k", i),
                                                    table.buffers("v", i), pos, n_attn)
            # a prompt's chunk (never captured) tells its attention where it starts
            first = state.n_past if T > ops.DECODE_MAX_TOKENS else None
            return lambda L, a: self._attention(L, a, state.k[i], state.v[i], pos, n_attn, first)

        x = embed_rows(self.embd, tokens)                                    # [B*T, H]
        h = self.blocks(x, [(L, mixer(i), self.experts[i]) for i, L in enumerate(self.blk)],
                        self.out_norm, B, T).view(B, T, c.n_embd)
        if table is None:
            state.advance(T)
        else:   # the device position is the caller's (the table may be a captured step's copy)
            state.n_past += T
        state.steps_taken = T if keep else 0
        logits = _mm(h[:, -1:] if last_only else h, self.head)
        return (logits, h) if hidden else logits

    def prefill(self, tokens: torch.Tensor, state: State, chunk: int = PREFILL.default_chunk,
                all_logits: bool = False, hidden: bool = False):
        """A long prompt in chunks of `chunk` tokens -> last logits [B, V] (or all [B, T, V]);
        hidden: -> (those logits, every position's final-normed hidden state [B, T, H])."""
        state.check_room(tokens.shape[1])
        outs = [self.forward(tokens[:, s:s + chunk], state, last_only=not all_logits, hidden=hidden)
                for s in range(0, tokens.shape[1], chunk)]
        if hidden:
            logits = torch.cat([o[0] for o in outs], dim=1) if all_logits else outs[-1][0][:, 0]
            return logits, torch.cat([o[1] for o in outs], dim=1)
        return torch.cat(outs, dim=1) if all_logits else outs[-1][:, 0]

    def decode_path(self, state: State) -> str:
        """How a decode token of `state` runs: "native loop" (one native call, cpu_plan.py)
        or "per-op" (a kernel call at a time from Python). decode_many takes the native loop
        when every one of its states does."""
        return "native loop" if cpu_plan.plan_for(self, state) is not None else "per-op"

    def decode(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """One token per sequence: tokens [B] -> logits [B, V]. No host syncs."""
        return self.forward(tokens[:, None], state)[:, 0]

    @_pool_held
    def decode_many(self, tokens: torch.Tensor, states: Sequence[State],
                    table: StateTable | None = None, prompt_tokens: int = 0) -> torch.Tensor:
        """One token for each of B single-sequence states, each at its own position: tokens [B]
        -> logits [B, V]; advances every state by one. Norms, projections, router and experts
        run on the [B, H] batch (a layer's experts read once for all B, grouped by expert);
        only the mixer's core runs per sequence, on that sequence's KV or conv/ssm state.
        table (CUDA): the states' buffers and positions are reached through it, so a graph
        captured on it runs any B states; the device positions are then the caller's to
        advance (the table may be the graph's copy).
        prompt_tokens P (with a table): the last state takes the last P ids of `tokens`, the
        next piece of its prompt, in the same step (its rows beside the others' through every
        layer, its mixer core over the P tokens in order) -> logits [B + 1, V], the last row
        its piece's last."""
        c = self.config
        P = int(prompt_tokens)
        B = len(states) - (1 if P else 0)   # the states decoding one token
        if tokens.shape[0] != B + P or any(st.batch != 1 for st in states) or B < 0 \
                or (P and (table is None or B < 1)):
            raise OffloadError(f"decode_many takes one single-sequence state per token (and, "
                               f"through a state table, one more state's prompt piece); got "
                               f"{tokens.shape[0]} tokens, {len(states)} states, {P} prompt tokens")
        for st in states[:B]:
            st.check_room(1)
        if P:
            states[B].check_room(P)
        plan = cpu_plan.plan_many_for(self, states) if table is None else None
        if plan is not None:   # on the CPU the whole step in one native call, the same bits
            logits = plan(tokens, states)
        else:
            one = torch.arange(1, device=self.device)
            pos = table.positions()[:B] if table is not None else [st.pos + one for st in states]
            n_attn = [st.attn_len(1) for st in states[:B]]
            entries = list(range(B))   # attention entries: a row of the table each
            if P:   # the prompt's tokens at its next P positions, each an entry on its cache
                at = table.rows[B, -1] + torch.arange(P, device=self.device)
                pos += [at[t:t + 1] for t in range(P)]
                n_attn.append(states[B].attn_len(P))
                entries += [B] * P

            def mixer(i: int):
                if c.recurrent[i]:
                    if table is not None:
                        piece = ((table.buffers("conv", i, [B]), table.buffers("ssm", i, [B]))
                                 if P else None)
                        return lambda L, a: self._delta_net_many(
                            L, a, table.buffers("conv", i, range(B)),
                            table.buffers("ssm", i, range(B)), piece)
                    return lambda L, a: self._delta_net_many(
                        L, a, [st.conv[i] for st in states], [st.ssm[i] for st in states])
                if table is not None:
                    return lambda L, a: self._attention_many(
                        L, a, table.buffers("k", i, entries), table.buffers("v", i, entries), pos,
                        n_attn, write_first=P > 0)
                return lambda L, a: self._attention_many(
                    L, a, [st.k[i] for st in states], [st.v[i] for st in states], pos, n_attn)

            x = embed_rows(self.embd, tokens)                                   # [B+P, H]
            h = self.blocks(x, [(L, mixer(i), self.experts[i]) for i, L in enumerate(self.blk)],
                            self.out_norm, B + P, 1)                            # [B+P, H]
            logits = _mm(torch.cat([h[:B], h[-1:]]) if P else h, self.head)
        for st, n in zip(states, [1] * B + ([P] if P else [])):
            if table is None:
                st.advance(n)
            else:
                st.n_past += n
            st.steps_taken = 0   # no per-token states kept: nothing to rewind into
        return logits

    # -- mixers -------------------------------------------------------------------------------------

    def _attention(self, L, a, k_cache, v_cache, pos, n_attn, first=None) -> torch.Tensor:
        """Gated full attention. a [B, T, H]; caches [B, n_ctx, Hkv, X]; first: the first
        position as a host int where the caller knows it (pos = first..first+T-1)."""
        c = self.config
        qg, k, v = self._attention_in(L, a)
        o = gated_attention(qg, k, v, L["attn_q_norm.weight"], L["attn_k_norm.weight"], c.rms_eps,
                            pos, c.n_rot, c.rope_base, k_cache, v_cache, n_attn, first)
        return _mm(o, L["attn_output.weight"])

    def _attention_many(self, L, a, k_caches, v_caches, pos, n_attn,
                        write_first: bool = False) -> torch.Tensor:
        """Gated full attention of one token of each of B sequences, each on its own cache
        (write_first: entries may share a cache, attention.gated_attention_many)."""
        c = self.config
        qg, k, v = self._attention_in(L, a)                                     # [B, 1, ...]
        o = gated_attention_many(qg, k, v, L["attn_q_norm.weight"], L["attn_k_norm.weight"],
                                 c.rms_eps, pos, c.n_rot, c.rope_base, k_caches, v_caches, n_attn,
                                 write_first)
        return _mm(o, L["attn_output.weight"])

    def _delta_net(self, L, a, conv_state, ssm_state, steps=None) -> torch.Tensor:
        """Gated delta-net. a [B, T, H]; value head j reads q/k head j mod Hk."""
        c = self.config
        mix, z, beta_raw, alpha_raw = self._proj(L, SSM_IN, a)  # [B, T, C | Hv*dv | Hv | Hv]
        o = gated_delta_net(mix, z, beta_raw, alpha_raw, conv_state, ssm_state,
                            L["ssm_conv1d.weight"], L["ssm_a"], L["ssm_dt.bias"],
                            L["ssm_norm.weight"], c.ssm_n_k_heads, c.rms_eps, PREFILL.delta_chunk,
                            steps)
        return _mm(o, L["ssm_out.weight"])

    def _delta_net_many(self, L, a, conv_states, ssm_states, piece=None) -> torch.Tensor:
        """The delta-net of one token of each of B sequences, each on its own conv/ssm state;
        piece (conv, ssm of one more sequence): the rows after the B are that sequence's next
        tokens, run in order as a verify step runs them."""
        c = self.config
        mix, z, beta, alpha = self._proj(L, SSM_IN, a)                          # [N, 1, ...]
        w = (L["ssm_conv1d.weight"], L["ssm_a"], L["ssm_dt.bias"], L["ssm_norm.weight"],
             c.ssm_n_k_heads, c.rms_eps)
        if piece is None:
            o = gated_delta_net_many(mix, z, beta, alpha, conv_states, ssm_states, *w)
        else:
            B = len(conv_states)
            head = gated_delta_net_many(mix[:B], z[:B], beta[:B], alpha[:B], conv_states,
                                        ssm_states, *w)
            rest = (u[B:].transpose(0, 1) for u in (mix, z, beta, alpha))   # [1, P, ...]
            tail = gated_delta_net(*rest, *piece, *w)                       # [1, P, Hv*dv]
            o = torch.cat([head, tail.transpose(0, 1)])
        return _mm(o, L["ssm_out.weight"])

    def _attention_in(self, L, a) -> list[torch.Tensor]:
        """Attention's input projections of a [B, T, H] -> qg [.., 2*Hq*d], k, v [.., Hkv*d]."""
        c = self.config
        if "attn_qkv.weight" in L:  # fused variant: rows [q|gate interleaved, k, v]
            hq, hkv, d = c.n_head, c.n_head_kv, c.head_dim
            return list(_mm(a, L["attn_qkv.weight"]).split([2 * hq * d, hkv * d, hkv * d], -1))
        return self._proj(L, ATTN_IN, a)

    # -- experts ------------------------------------------------------------------------------------

    def _moe(self, L, experts: Experts, f: torch.Tensor) -> tuple:
        """Routed top-k experts + sigmoid-gated shared expert. f [N, H] -> (routed [N, H],) or
        (routed, shared [N, H], shared gate logit [N, 1]): the residual stream gets routed +
        sigmoid(logit) * shared (added by the next residual_rms_norm)."""
        E = self.config.n_expert
        shared = SHEXP_IN[0] in L or "+".join(SHEXP_IN) in L
        if shared and not f.is_cuda and ROUTER[0] in L and SHEXP_IN[0] in L:
            # the router, the shared gate and its gate|up read f: one pass on the CPU pool
            logits, gate_logit, gate, up = self._proj(L, ROUTER + SHEXP_IN, f)
            ids, w = route_topk(logits[:, :E], self.config.n_expert_used)
            y = experts(f, ids, w)
            return y, _mm(swiglu(gate, up), L["ffn_down_shexp.weight"]), gate_logit
        logits = self._proj(L, ROUTER, f) if shared else (_mm(f, L[ROUTER[0]]),)
        ids, w = route_topk(logits[0][:, :E], self.config.n_expert_used)
        if not shared:
            return (experts(f, ids, w),)
        y, s = self.moe_pair(experts, f, ids, w, lambda: self._shared_expert(L, f))
        return y, s, logits[1]

    def _shared_expert(self, L, f: torch.Tensor) -> torch.Tensor:
        gate, up = self._proj(L, SHEXP_IN, f)
        return _mm(swiglu(gate, up), L["ffn_down_shexp.weight"])

    def router_logits(self, layer: int, f: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s router on f [N, H] -> logits [N, E]: how the offload runtime guesses
        the next layer's experts from the current hidden state."""
        L = self.blk[layer]
        fused = L.get("+".join(ROUTER))
        return _mm(f, fused if fused is not None else L[ROUTER[0]])[:, :self.config.n_expert]

    def embedding_moe_inputs(self, tokens: torch.Tensor, layers: int) -> list[torch.Tensor]:
        """Stand-ins for the MoE inputs of layers 0..layers-1 of tokens [N] before the trunk has
        run them: each token's embedding, normed as the layer norms its MoE input. The residual
        stream starts as the embedding, so they are closest at layer 0; how close further on is
        the model's (the offload runtime counts how often the guesses made from them hit)."""
        c = self.config
        e = embed_rows(self.embd, tokens).float()
        return [rms_norm(e, self.blk[i]["post_attention_norm.weight"], c.rms_eps)
                for i in range(min(layers, c.n_layer))]

    def _proj(self, L, names: tuple[str, ...], a: torch.Tensor) -> list[torch.Tensor]:
        """The projections `names` of one input a [..., H]: one matmul split in parts if they
        were fused at upload (views of its output), else one matmul each."""
        fused = L.get("+".join(names))
        if fused is not None:
            return list(_mm(a, fused).split(fused.parts, dim=-1))
        return ops.matmul_many(a, [L[n] for n in names])
