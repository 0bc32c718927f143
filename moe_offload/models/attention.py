"""The full-attention mixer of the forward pass: causal GQA attention (the whole-score reference,
and a prompt chunk's form that reads the cache in tiles), the gated mixer between its
projections for T tokens or one token of each of B sequences.

On CUDA tensors a few tokens run as one kernel (native.ops.cuda_attention_*: norms, RoPE, the
cache write and the attention of every KV type); on CPU tensors native._cpu runs the mixer for
any number of tokens (norms, RoPE, the write, the attention over the rows as stored: f16, q8_0,
q4_0 unpacked one at a time as read). The torch code is their
reference, as in layers.py (`instrument.switches.STEP_KERNELS = False` forces it).
Legend: B batch, T new tokens, L attended positions, H heads, d head dim, X a cache row's width
in its KV type (native.kv_cache).
"""
from __future__ import annotations

import contextlib

import torch

from native import ops
from native.kv_cache import kv_type_of

from ..config import PREFILL
from ..instrument import switches
from .layers import _cpu_kernel_for, _kernel_for, rms_norm, rope_neox

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor) -> torch.Tensor:
    """Causal GQA softmax attention. q [B, T, Hq, d]; k, v [B, L, Hkv, d]; q_pos [T]; k_pos [L].

    Query head h reads kv head h // (Hq/Hkv); key l is visible to query t iff k_pos[l] <= q_pos[t]
    (cache rows past the written ones are masked out). Scale 1/sqrt(d). Returns [B, T, Hq, d].
    """
    B, T, Hq, d = q.shape
    Hkv = k.shape[2]
    q = q.view(B, T, Hkv, Hq // Hkv, d).permute(0, 2, 3, 1, 4)    # [B, Hkv, G, T, d]
    k = k.permute(0, 2, 1, 3).unsqueeze(2)                        # [B, Hkv, 1, L, d]
    v = v.permute(0, 2, 1, 3).unsqueeze(2)
    s = (q @ k.transpose(-1, -2)) * d ** -0.5                     # [B, Hkv, G, T, L]
    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    o = torch.softmax(s, dim=-1) @ v                              # [B, Hkv, G, T, d]
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, d)


def attention_tiled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    q_pos: torch.Tensor, n_attn: int, tile: int | None = None,
                    first: int | None = None) -> torch.Tensor:
    """`attention` over the first n_attn rows of caches [B, n_ctx, Hkv, X] of any KV type
    (native.kv_cache), read `tile` rows at a time with an online softmax: what a prompt's chunk
    needs beside its own tensors is one tile's scores and rows, whatever the context (the whole
    [Hq, T, n_attn] scores, or a float copy of the whole cache, do not fit a long prompt under a
    cap). The first tile holds row 0, which every query sees, so the running maximum is finite
    from it on. tile: default PREFILL.attention_tile. first (a host int, when the
    caller knows it): the queries sit at first..first+T-1, so rows past the last are not read
    and tiles every query sees whole are not masked. On a GPU a tile's softmax update (mask,
    max, exp, sum) is one kernel (native.ops.softmax_tile_: three passes over the scores,
    against the torch ops' six, which are its reference). Returns [B, T, Hq, d]
    f32."""
    B, T, Hq, d = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    kt = kv_type_of(k_cache, d)
    if tile is None:
        tile = PREFILL.attention_tile(T, Hq, Hkv * d)
    # queries of a kv head's group as rows g*T + t, scaled once
    qh = (q.view(B, T, Hkv, G, d).permute(0, 2, 3, 1, 4) * d ** -0.5).reshape(B, Hkv, G * T, d)
    row_pos = q_pos.repeat(G)[:, None]                                     # [G*T, 1]
    m = torch.full((B, Hkv, G * T, 1), float("-inf"), device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(B, Hkv, G * T, d, device=q.device)
    end = n_attn if first is None else min(n_attn, first + T)
    fused = switches.SOFTMAX_TILE and _kernel_for(q) and ops.softmax_tile_available(q)
    pos64 = q_pos.to(torch.int64).contiguous() if fused else None
    with _fast_matmul(q):
        for j0 in range(0, end, tile):
            j1 = min(end, j0 + tile)
            k = kt.dequantize(k_cache[:, j0:j1], d).permute(0, 2, 3, 1)       # [B, Hkv, d, L]
            s = qh @ k
            masked = first is None or j1 - 1 > first
            if fused:   # the update below in one kernel: three passes over the scores, not six
                corr = ops.softmax_tile_(s, m, l, j0, pos64 if masked else None)
                p = s
            else:
                if masked:
                    s.masked_fill_(torch.arange(j0, j1, device=q.device) > row_pos, float("-inf"))
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                corr = torch.exp(m - m_new)
                p = s.sub_(m_new).exp_()
                l = l * corr + p.sum(-1, keepdim=True)
                m = m_new
            v = kt.dequantize(v_cache[:, j0:j1], d).permute(0, 2, 1, 3)       # [B, Hkv, L, d]
            acc = acc * corr + p @ v
    o = (acc / l).view(B, Hkv, G, T, d)
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, d)


@contextlib.contextmanager
def _fast_matmul(t: torch.Tensor):
    """On a GPU, the tiles' float32 products on the tensor cores (TF32: 10-bit operands, float32
    sums; an f16 cache's keys and values are exact in it, so only the queries and the softmax
    weights are rounded, once each), unless switched off (switches.ATTENTION_TF32) or the torch
    code runs as the kernels' reference (switches.STEP_KERNELS off: exact float32). torch's
    switch is per process; the thread that runs the model is the only one multiplying on the
    GPU while it is set."""
    if not (t.is_cuda and switches.ATTENTION_TF32 and switches.STEP_KERNELS):
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _attention_kernel_for(qg: torch.Tensor, k_cache: torch.Tensor, d: int) -> bool:
    """Whether the CUDA attention kernel takes this cache's type and head size d (every KV
    type, native.kv_cache)."""
    return _kernel_for(qg) and d in (64, 128, 256, 512) and \
        k_cache.dtype in (torch.float16, torch.float32, torch.uint8)


def gated_attention(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                    k_norm: torch.Tensor, eps: float, pos: torch.Tensor, n_rot: int, base: float,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, n_attn: int,
                    first: int | None = None) -> torch.Tensor:
    """The full-attention mixer between its projections.

    qg [B, T, Hq*2d] (per head: d query rows, then d gate rows), k, v [B, T, Hkv*d]; q and k are
    RMS-normed and roped, k and v written into the caches [B, n_ctx, Hkv, X] (native.kv_cache's
    rows of d values) at pos [T]; the first
    n_attn cache rows are attended (first: pos's first entry as a host int, when it is
    first..first+T-1: attention_tiled's hint). Returns attention * sigmoid(gate), [B, T, Hq*d].
    """
    B, T, _ = qg.shape
    if isinstance(k_cache, ops.SeqTable):
        # one sequence's caches through a state table (CUDA; B = 1): decode's kernel as below
        d = k.shape[-1] // k_cache.like.shape[2]
        hq = qg.shape[-1] // (2 * d)
        rep = lambda c: ops.SeqTable(c.table, c.at * T, c.like)   # noqa: E731  (a place a token)
        o = ops.cuda_attention_many(qg.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), q_norm,
                                    k_norm, eps, [pos[t] for t in range(T)], n_rot, base,
                                    rep(k_cache), rep(v_cache), hq, n_attn, write_first=T > 1)
        return o.view(B, T, hq * d)
    hkv = k_cache.shape[2]
    d = k.shape[-1] // hkv
    hq = qg.shape[-1] // (2 * d)
    if T <= ops.DECODE_MAX_TOKENS and _attention_kernel_for(qg, k_cache, d):
        # a few tokens (decode, a speculative verify step): each token with the arithmetic of
        # its own decode step (greedy speculative output = plain), the T tokens' rows written
        # first so that token t sees the ones before it; three launches whatever T
        if T == 1:
            return ops.cuda_attention_step(qg[:, 0], k[:, 0], v[:, 0], q_norm, k_norm, eps,
                                           pos[0] if pos.dim() else pos, n_rot, base, k_cache,
                                           v_cache, hq, n_attn).view(B, 1, hq * d)
        at = [pos[t] for t in range(T)] * B
        o = ops.cuda_attention_many(qg.reshape(B * T, -1), k.reshape(B * T, -1),
                                    v.reshape(B * T, -1), q_norm, k_norm, eps, at, n_rot, base,
                                    [c for c in k_cache for _ in range(T)],
                                    [c for c in v_cache for _ in range(T)], hq, n_attn,
                                    write_first=True)
        return o.view(B, T, hq * d)
    if B == 1 and d % 16 == 0 and k_cache.is_contiguous() and v_cache.is_contiguous() \
            and _cpu_kernel_for(qg) and ops.cpu_attention_reads(k_cache[0], d):
        # the CPU's (csrc/cpu/attention.cpp): norms, RoPE, the cache write (packed as the KV type
        # packs), then the attention over the rows as stored, a kv head's queries a task
        o = ops.cpu_gated_attention(qg[0], k[0], v[0], q_norm, k_norm, eps, int(pos[0]), n_rot, base,
                                    k_cache[0], v_cache[0], hq, n_attn)
        return o.view(B, T, hq * d)
    qg = qg.view(B, T, hq, 2, d)
    q, gate = qg[..., 0, :], qg[..., 1, :]
    q = rope_neox(rms_norm(q, q_norm, eps), pos, n_rot, base)
    k = rope_neox(rms_norm(k.view(B, T, hkv, d), k_norm, eps), pos, n_rot, base)
    kt = kv_type_of(k_cache, d)
    k_cache.index_copy_(1, pos, kt.quantize(k))
    v_cache.index_copy_(1, pos, kt.quantize(v.view(B, T, hkv, d)))
    o = attention_tiled(q, k_cache, v_cache, pos, n_attn, first=first)
    return o.reshape(B, T, hq * d) * torch.sigmoid(gate.reshape(B, T, hq * d))


def gated_attention_many(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                         k_norm: torch.Tensor, eps: float, pos: list[torch.Tensor], n_rot: int,
                         base: float, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                         n_attn: list[int], write_first: bool = False) -> torch.Tensor:
    """gated_attention for one token of each of B sequences with caches and positions of their
    own (a batched decode step): qg, k, v [B, 1, ..]; caches [1, n_ctx, Hkv, X] each; pos [1]
    and n_attn per sequence -> [B, 1, Hq*d]. On CUDA one launch for the B sequences, with the
    arithmetic of each one's own decode step while the longest attends at most 32,768 rows (a
    sequence attending fewer rows than the longest leaves its last splits empty; past that the
    splits grow with the longest, api.h). write_first (caches through an ops.SeqTable): every row's
    K and V are written before any attends, so rows may share a cache (a prompt's tokens in a
    batched step, each at its own position)."""
    B = qg.shape[0]
    tabled = isinstance(k_caches, ops.SeqTable)   # the caches through a state table (CUDA)
    d = k.shape[-1] // (k_caches.like if tabled else k_caches[0]).shape[2]
    hq = qg.shape[-1] // (2 * d)
    if tabled or _attention_kernel_for(qg, k_caches[0], d):
        o = ops.cuda_attention_many(qg[:, 0], k[:, 0], v[:, 0], q_norm, k_norm, eps, pos, n_rot,
                                    base, k_caches, v_caches, hq, max(n_attn),
                                    write_first=write_first)
        return o.view(B, 1, hq * d)
    return torch.cat([gated_attention(qg[b:b + 1], k[b:b + 1], v[b:b + 1], q_norm, k_norm, eps,
                                      pos[b], n_rot, base, k_caches[b], v_caches[b], n_attn[b])
                      for b in range(B)])
