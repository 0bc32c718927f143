"""Small math helpers of the forward pass: norms, RoPE, causal conv, delta rules (the attention
mixer is in attention.py).

Plain device-agnostic torch in float32; no host syncs (no `.item()`, no data-dependent shapes),
so a decode step built from these can be captured in a CUDA graph. Formulas follow
Legend: B batch, T new tokens, L attended positions, H heads,
d head dim, C conv channels, Kc conv kernel.

A few of them (`residual_rms_norm`, `gated_delta_net` and attention.py's `gated_attention` for one token,
`route_topk`, `swiglu`)
run as single CUDA kernels on CUDA tensors (native.ops.cuda_* / step_*): torch needs 5-10
launches for each, and launches, not bytes, bound a decode step. On CPU tensors
`residual_rms_norm`, `route_topk`, `swiglu`, the delta-net's conv and recurrence and the
attention mixer run in native._cpu (native.ops.step_* / cpu_*; a token or a whole prompt a
call): torch's ~40 passes over the state a token (or its chunked form's small matmuls) cost
more than the layer's weights, and its per-operation overhead more than a norm's arithmetic.
The torch code here is their reference; `instrument.switches.STEP_KERNELS = False` forces it everywhere (the GPU
tests compare the two, tests/native/test_cpu_step.py the CPU ones).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from native import ops

from ..instrument import switches

EXPERT_WEIGHT_FLOOR = 6.103515625e-5  # llama.cpp clamps the top-k renormalisation denominator


def _kernel_for(t: torch.Tensor) -> bool:
    return switches.STEP_KERNELS and ops.step_kernels_available(t)


def _cpu_kernel_for(t: torch.Tensor) -> bool:
    return switches.STEP_KERNELS and ops.cpu_step_kernels_available(t)


def embed_rows(table, tokens: torch.Tensor) -> torch.Tensor:
    """The rows of a token embedding (a QTensor [V, H], on the device or in pinned host RAM) for
    tokens (any shape, N ids) -> [N, H], a fresh tensor."""
    return ops.dequantize(table.data[tokens.reshape(-1)], table.qtype, (tokens.numel(), table.shape[-1]))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) * w over the last dim (w already holds the converter's +1)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dim."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def residual_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, a: torch.Tensor | None = None,
                      b: torch.Tensor | None = None, s: torch.Tensor | None = None) -> torch.Tensor:
    """The residual stream's add-then-norm: x += a + sigmoid(s) * b in place (a, b, s optional;
    b is the shared expert's output, s its gate logit), then rms_norm(x, w).
    x [N, H] contiguous; a, b [N, H]; s [N, 1]."""
    if _kernel_for(x) or (_cpu_kernel_for(x) and x.is_contiguous() and x.dim() == 2):
        return ops.step_residual_rms_norm(x, w, eps, a, b, s)
    if a is not None:
        x += a if b is None else a + torch.sigmoid(s) * b
    return rms_norm(x, w, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm before gate: rms_norm(x) * w * silu(z)."""
    return rms_norm(x, w, eps) * F.silu(z)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.dim() == 2 and (_kernel_for(gate) or (
            _cpu_kernel_for(gate) and hasattr(ops._cpu, "swiglu")
            and gate.stride(0) == up.stride(0) and gate.stride(-1) == up.stride(-1) == 1)):
        return ops.step_swiglu(gate, up)
    return F.silu(gate) * up


# ---- rotary embedding ------------------------------------------------------------------------------

def rope_neox(x: torch.Tensor, pos: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    """NEOX RoPE on the first n_rot dims of each head. x [B, T, H, d]; pos [T] int (device).

    Pair i (< n_rot/2) rotates dims (i, i + n_rot/2) by pos * base^(-2i/n_rot). For text tokens
    qwen35moe's interleaved M-RoPE reduces to exactly this (all section positions equal).
    """
    half = n_rot // 2
    inv_freq = base ** (-torch.arange(0, n_rot, 2, device=x.device, dtype=torch.float32) / n_rot)
    ang = pos.to(torch.float32)[:, None] * inv_freq              # [T, half]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


# ---- gated delta-net pieces --------------------------------------------------------------------------

def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv, no bias, no activation; updates conv_state in place.

    x [B, T, C] raw projections; conv_state [B, C, Kc-1] the previous raw inputs, oldest first;
    w [C, Kc] (w[:, Kc-1] multiplies the current token). Returns [B, T, C].
    """
    T, Kc = x.shape[1], w.shape[1]
    xs = torch.cat((conv_state, x.transpose(1, 2)), dim=-1)      # [B, C, Kc-1+T]
    conv_state.copy_(xs[:, :, T:])
    # Kc shifted multiply-adds: exact float32 everywhere (cuDNN's conv may use TF32)
    y = sum(xs[:, :, j:j + T] * w[:, j, None] for j in range(Kc))
    return y.transpose(1, 2)


def gated_delta_net(mix: torch.Tensor, z: torch.Tensor, beta_raw: torch.Tensor,
                    alpha_raw: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                    conv_w: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
                    norm_w: torch.Tensor, n_k_heads: int, eps: float, chunk: int = 64,
                    steps: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The delta-net mixer between its input and output projections.

    mix [B, T, C] raw q|k|v projections, z [B, T, Hv*dv], beta_raw / alpha_raw [B, T, Hv];
    conv_state [B, C, Kc-1] and ssm_state [B, Hv, dk, dv] are updated in place. Value head j
    reads q/k head j mod Hk (tiled, not interleaved). Returns [B, T, Hv*dv].
    steps (conv [D, B, C, Kc-1], ssm [D, B, Hv, dk, dv], D >= T-1): the tokens run one at a
    time, as decode runs them, and the states after each of the first T-1 are kept there
    (a speculative verify step rewinds to one of them).
    """
    B, T, _ = mix.shape
    hk = n_k_heads
    if isinstance(ssm_state, ops.SeqTable):   # one sequence's states through a state table (CUDA)
        return _delta_net_steps(mix, z, beta_raw, alpha_raw, conv_state, ssm_state, conv_w, ssm_a,
                                dt_bias, norm_w, hk, eps)
    hv, dk, dv = ssm_state.shape[1:]
    if _kernel_for(mix) and (T <= ops.DECODE_MAX_TOKENS or steps is not None):
        # decode, a verify or a short prompt step on CUDA: decode's step kernels, one launch each
        # for all T tokens (the chunked form pads them to a whole chunk and runs a triangular
        # solve of its size, several times slower for 2-8 tokens)
        return _delta_net_steps(mix, z, beta_raw, alpha_raw, list(conv_state), list(ssm_state),
                                conv_w, ssm_a, dt_bias, norm_w, hk, eps, steps)
    if T > 1 and steps is not None:   # the CPU, keeping the state after each token: one at a time
        outs = []
        for t in range(T):
            one = (u[:, t:t + 1].contiguous() for u in (mix, z, beta_raw, alpha_raw))
            outs.append(gated_delta_net(*one, conv_state, ssm_state, conv_w, ssm_a, dt_bias,
                                        norm_w, n_k_heads, eps))
            if t < T - 1:
                steps[0][t].copy_(conv_state)
                steps[1][t].copy_(ssm_state)
        return torch.cat(outs, dim=1)
    if _cpu_kernel_for(mix) and ssm_state.is_contiguous():
        # on the CPU (csrc/cpu/step.cpp): the recurrence token by token, each head's state in cache
        y = ops.cpu_conv_silu(mix, conv_state, conv_w)                        # [B*T, C]
        o = ops.cpu_delta_rule(y, z.reshape(B * T, -1), beta_raw.reshape(B * T, -1),
                               alpha_raw.reshape(B * T, -1), ssm_a, dt_bias, ssm_state, norm_w, hk, eps)
        return o.view(B, T, hv * dv)
    beta = torch.sigmoid(beta_raw)
    g = ssm_a * F.softplus(alpha_raw + dt_bias)
    y = F.silu(causal_conv(mix, conv_state, conv_w))
    q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
    r = hv // hk
    q = l2_norm(q.reshape(B, T, hk, dk), eps).repeat(1, 1, r, 1) * dk ** -0.5
    k = l2_norm(k.reshape(B, T, hk, dk), eps).repeat(1, 1, r, 1)
    if T == 1:
        o = delta_rule_recurrent(q, k, v.reshape(B, T, hv, dv), g, beta, ssm_state)
    else:
        o = delta_rule_chunked(q, k, v.reshape(B, T, hv, dv), g, beta, ssm_state, chunk)
    o = gated_rms_norm(o, z.reshape(B, T, hv, dv), norm_w, eps)             # [B, T, Hv, dv]
    return o.reshape(B, T, hv * dv)


def gated_delta_net_many(mix: torch.Tensor, z: torch.Tensor, beta_raw: torch.Tensor,
                         alpha_raw: torch.Tensor, conv_states: list[torch.Tensor],
                         ssm_states: list[torch.Tensor], conv_w: torch.Tensor, ssm_a: torch.Tensor,
                         dt_bias: torch.Tensor, norm_w: torch.Tensor, n_k_heads: int,
                         eps: float) -> torch.Tensor:
    """gated_delta_net for one token of each of B sequences whose states are tensors of their
    own (a batched decode step): mix etc. [B, 1, ..], conv_states / ssm_states B tensors [1, ..]
    -> [B, 1, Hv*dv]. On CUDA one launch each for the B sequences."""
    if _kernel_for(mix):
        return _delta_net_steps(mix, z, beta_raw, alpha_raw, conv_states, ssm_states, conv_w,
                                ssm_a, dt_bias, norm_w, n_k_heads, eps)
    return torch.cat([gated_delta_net(mix[b:b + 1], z[b:b + 1], beta_raw[b:b + 1],
                                      alpha_raw[b:b + 1], cs, ss, conv_w, ssm_a, dt_bias, norm_w,
                                      n_k_heads, eps)
                      for b, (cs, ss) in enumerate(zip(conv_states, ssm_states))])


def _delta_net_steps(mix, z, beta_raw, alpha_raw, conv_states, ssm_states, conv_w, ssm_a, dt_bias,
                     norm_w, n_k_heads, eps, steps=None) -> torch.Tensor:
    """The CUDA step kernels over T tokens of each of S sequences (mix etc. [S, T, ..]; a state
    tensor each) -> [S, T, Hv*dv]; steps (conv, ssm) [D, S, ..] receive the states after each
    token but the last."""
    S, T, _ = mix.shape
    flat = lambda u: u.reshape(S * T, u.shape[-1])   # noqa: E731  (a view: rows s*T + t)
    y = ops.cuda_conv_silu_steps(flat(mix), conv_states, conv_w, T,
                                 steps[0] if steps is not None and T > 1 else None)
    o = ops.cuda_delta_rule_steps(y, flat(z), flat(beta_raw), flat(alpha_raw), ssm_a, dt_bias,
                                  ssm_states, norm_w, n_k_heads, eps, T,
                                  steps[1] if steps is not None and T > 1 else None)
    return o.view(S, T, -1)


def delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Gated delta rule, one token at a time; updates S in place.

    q, k [B, T, H, dk] (L2-normed, q pre-scaled); v [B, T, H, dv]; g (log decay), beta [B, T, H];
    S [B, H, dk, dv] with S[i, c]: key dim i, value dim c. Returns o [B, T, H, dv].
    """
    s, outs = S, []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kv = torch.einsum("bhi,bhic->bhc", k[:, t], s)           # Sᵀk
        u = beta[:, t, :, None] * (v[:, t] - kv)
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhi,bhic->bhc", q[:, t], s))
    S.copy_(s)
    return torch.stack(outs, dim=1)


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, S: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """The same recurrence evaluated chunk by chunk: matmuls inside a chunk, a
    triangular solve for the intra-chunk corrections, one state update per chunk. Same
    arguments and result as `delta_rule_recurrent`; updates S in place.
    """
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    pad = -T % chunk                                              # zero tokens change nothing
    q, k, v = (F.pad(t.transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v))   # [B, H, Tp, d]
    g, beta = (F.pad(t.transpose(1, 2), (0, pad)) for t in (g, beta))        # [B, H, Tp]
    n = (T + pad) // chunk
    q, k = q.view(B, H, n, chunk, dk), k.view(B, H, n, chunk, dk)
    v, g, beta = v.view(B, H, n, chunk, dv), g.view(B, H, n, chunk), beta.view(B, H, n, chunk)

    gam = g.cumsum(-1)                                            # γ_r, [B, H, n, C]
    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    D = (gam[..., :, None] - gam[..., None, :]).masked_fill(~ones.tril(), float("-inf")).exp()
    kb = k * beta[..., None]
    A = ((kb @ k.transpose(-1, -2)) * D).masked_fill(~ones.tril(-1), 0.0)   # strictly lower
    I_A = A + torch.eye(chunk, device=q.device)
    U = torch.linalg.solve_triangular(I_A, v * beta[..., None], upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(I_A, kb * gam.exp()[..., None], upper=False,
                                      unitriangular=True)
    QK = (q @ k.transpose(-1, -2)) * D                            # [B, H, n, C, C]
    q_dec = q * gam.exp()[..., None]
    k_dec = k * (gam[..., -1:] - gam).exp()[..., None]
    # The loop over chunks is sequential (the state carries over), so its launches add up on
    # long prompts: chunk-major copies make each chunk's operands contiguous [B*H, C, d]
    # batches, and fused multiply-adds keep it at five launches a chunk.
    BH = B * H

    def by_chunk(t: torch.Tensor) -> torch.Tensor:   # [B, H, n, ...] -> [n, B*H, ...]
        return t.movedim(2, 0).reshape(n, BH, *t.shape[3:])
    U, W, QK, q_dec, k_dec = map(by_chunk, (U, W, QK, q_dec, k_dec))
    decay = by_chunk(gam[..., -1].exp())[..., None, None]         # [n, B*H, 1, 1]
    s = S.reshape(BH, dk, dv)
    out = torch.empty(n, BH, chunk, dv, dtype=v.dtype, device=v.device)
    for c in range(n):
        vp = torch.baddbmm(U[c], W[c], s, alpha=-1)                # V' = U - W S
        torch.baddbmm(torch.bmm(q_dec[c], s), QK[c], vp, out=out[c])
        s = torch.baddbmm(s * decay[c], k_dec[c].transpose(1, 2), vp)
    S.copy_(s.view(B, H, dk, dv))
    o = out.view(n, B, H, chunk, dv).movedim(0, 2).reshape(B, H, n * chunk, dv)[:, :, :T]
    return o.transpose(1, 2)


def route_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (f32), top-k, renormalise. logits [N, E] -> ids, weights [N, K]
    (ids int32 from the CUDA kernel, int64 from torch: consumers take either)."""
    if logits.dtype == torch.float32 and (
            _kernel_for(logits) or (_cpu_kernel_for(logits) and logits.dim() == 2)):
        return ops.step_route_topk(logits, k, EXPERT_WEIGHT_FLOOR)
    p = torch.softmax(logits.float(), dim=-1)
    w, ids = p.topk(k, dim=-1)
    return ids, w / w.sum(-1, keepdim=True).clamp(min=EXPERT_WEIGHT_FLOOR)
