"""The CPU step kernels against their torch references in moe_offload.models.layers, on fresh random
inputs: the delta-net (native._cpu.conv_silu_seq, delta_rule_step / delta_rule_seq; the recurrent
form for a token, the chunked form for a prompt: outputs and the updated states), the residual add
+ RMS norm, the router's top-k and the attention core (native._cpu.attention, on every ISA)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_oracle import SEED, rng_for
from moe_offload.models import attention as attn
from moe_offload.models import layers
from moe_offload.instrument import switches
from native import ops

pytestmark = pytest.mark.skipif(not ops.cpu_step_kernels_available(torch.zeros(1)),
                                reason="native._cpu has no step kernels")


def _t(rng, *shape, scale=1.0):
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))


@pytest.mark.parametrize("n_tok", [1, 37])
@pytest.mark.parametrize("batch,hk,hv,dk,dv", [(1, 16, 32, 128, 128), (2, 2, 4, 32, 64), (1, 4, 4, 64, 32)])
def test_delta_net_matches_the_torch_reference(batch, hk, hv, dk, dv, n_tok):
    rng = rng_for("delta_step", batch, hk, hv, dk, dv, n_tok)
    c = 2 * hk * dk + hv * dv
    mix, z = _t(rng, batch, n_tok, c), _t(rng, batch, n_tok, hv * dv)
    beta, alpha = _t(rng, batch, n_tok, hv), _t(rng, batch, n_tok, hv)
    conv_w, conv0 = _t(rng, c, 4, scale=0.5), _t(rng, batch, c, 3)
    ssm_a, dt_bias, norm_w = -torch.rand(hv) * 4, _t(rng, hv), 1 + _t(rng, dv, scale=0.1)
    S0 = _t(rng, batch, hv, dk, dv, scale=0.05)
    args = (ssm_a, dt_bias, norm_w, hk, 1e-6)
    outs = {}
    for kernels in (True, False):
        conv, S = conv0.clone(), S0.clone()
        switches.STEP_KERNELS = kernels
        try:
            for _ in range(3):   # a few calls: the states carry over
                o = layers.gated_delta_net(mix, z, beta, alpha, conv, S, conv_w, *args[:3], args[3], args[4], 16)
        finally:
            switches.STEP_KERNELS = True
        outs[kernels] = (o, conv, S)
    for got, want, what in zip(outs[True], outs[False], ("output", "conv state", "ssm state")):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{what} T={n_tok} [{batch}, {hk}, {hv}, {dk}, {dv}]: {m} (seed {SEED})")


@pytest.mark.parametrize("batch,channels", [(1, 8192), (2, 96), (3, 1000)])
def test_conv_token_by_token_equals_the_prompt_call_bit_for_bit(batch, channels):
    """A decode token takes the conv's one-token path (each channel straight from w and its
    state, over the pool when large); a prompt the transposed many-token path. Same sums in the
    same order: the outputs and the final state are identical."""
    rng = rng_for("conv_steps", batch, channels)
    n_tok = 5
    x, w, st0 = _t(rng, batch, n_tok, channels), _t(rng, channels, 4, scale=0.5), _t(rng, batch, channels, 3)
    st_prompt, st_steps = st0.clone(), st0.clone()
    prompt = ops.cpu_conv_silu(x, st_prompt, w).view(batch, n_tok, channels)
    steps = torch.stack([ops.cpu_conv_silu(x[:, t:t + 1].contiguous(), st_steps, w)
                         for t in range(n_tok)], dim=1)
    assert torch.equal(steps, prompt) and torch.equal(st_steps, st_prompt), f"seed {SEED}"


def test_a_state_in_the_denormal_range_is_flushed_not_slow():
    """A state decayed to denormals: the kernel flushes them (FTZ/DAZ) and the output matches the
    reference, which keeps them (their contribution is below float32's resolution)."""
    rng = rng_for("denormal")
    hk, hv, dk, dv = 2, 2, 32, 32
    c = 2 * hk * dk + hv * dv
    mix, z = _t(rng, 1, 1, c), _t(rng, 1, 1, hv * dv)
    beta, alpha = _t(rng, 1, 1, hv), _t(rng, 1, 1, hv)
    conv_w, conv = _t(rng, c, 4), _t(rng, 1, c, 3)
    S = torch.full((1, hv, dk, dv), 1e-39)                 # denormal
    ref = layers.gated_delta_net(mix, z, beta, alpha, conv.clone(), S.clone(), conv_w, -torch.ones(hv),
                                 torch.zeros(hv), torch.ones(dv), hk, 1e-6)
    got = layers.gated_delta_net(mix, z, beta, alpha, conv.clone(), S, conv_w, -torch.ones(hv),
                                 torch.zeros(hv), torch.ones(dv), hk, 1e-6)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("parts", ["none", "a", "a+b"])
def test_residual_rms_norm_matches_the_torch_reference(rows, parts):
    rng = rng_for("rms", rows, parts)
    h = 512
    x0, w = _t(rng, rows, h), 1 + _t(rng, h, scale=0.1)
    a = _t(rng, rows, h) if parts != "none" else None
    b, s = (_t(rng, rows, h), _t(rng, rows, 1)) if parts == "a+b" else (None, None)
    outs = {}
    for kernels in (True, False):
        x = x0.clone()
        switches.STEP_KERNELS = kernels
        try:
            outs[kernels] = (layers.residual_rms_norm(x, w, 1e-6, a, b, s), x)
        finally:
            switches.STEP_KERNELS = True
    for got, want, what in zip(outs[True], outs[False], ("output", "residual")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{what} rows={rows} {parts}: {m} (seed {SEED})")


@pytest.mark.parametrize("rows,e,k", [(1, 256, 8), (37, 16, 4), (300, 256, 8)])
def test_route_topk_matches_the_torch_reference(rows, e, k):
    logits = _t(rng_for("topk", rows, e, k), rows, e, scale=3.0)
    ids, w = layers.route_topk(logits, k)
    assert ids.dtype == torch.int32 and w.shape == (rows, k)
    switches.STEP_KERNELS = False
    try:
        ref_ids, ref_w = layers.route_topk(logits, k)
    finally:
        switches.STEP_KERNELS = True
    assert torch.equal(ids.long(), ref_ids), f"seed {SEED}"
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-7, msg=lambda m: f"{m} (seed {SEED})")


@pytest.mark.parametrize("rows", [1, 200])
def test_swiglu_matches_torch_on_views_of_one_buffer(rows):
    """The shared expert's silu(gate) * up on the gate|up column views of one matmul_many output."""
    gu = _t(rng_for("swiglu", rows), rows, 2 * 384, scale=3.0)
    gate, up = gu.split(384, dim=1)
    got = layers.swiglu(gate, up)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"{m} (seed {SEED})")


def _on_generic(fn, *args):
    """fn(*args) with the generic (scalar) CPU kernels active, then the ISA as it was."""
    before = ops._cpu.isa()
    try:
        ops._cpu.set_isa("generic")
        return fn(*args)
    finally:
        ops._cpu.set_isa(before)


@pytest.mark.parametrize("n_tok,pos0,n_attn", [(1, 0, 1), (1, 40, 41), (1, 5, 64), (37, 0, 37),
                                               (20, 13, 40), (9, 100, 128)])
@pytest.mark.parametrize("hq,hkv,d", [(16, 2, 256), (4, 4, 32), (6, 2, 16)])
def test_attention_matches_the_torch_reference(cpu_isa, hq, hkv, d, n_tok, pos0, n_attn):
    """Causal GQA attention with the sigmoid gate: the kernel (heads and query blocks over the
    pool, 16 partial sums a dot) against attn.attention; cache rows past the queries' positions
    hold garbage the mask must hide. Every ISA gives the same bits (the sums' order is fixed)."""
    rng = rng_for("attention", hq, hkv, d, n_tok, pos0, n_attn)
    qg = _t(rng, n_tok, hq, 2, d)
    q, gate = qg[:, :, 0], qg[:, :, 1]
    kc, vc = _t(rng, n_attn + 3, hkv, d), _t(rng, n_attn + 3, hkv, d)
    pos = torch.arange(pos0, pos0 + n_tok)
    want = attn.attention(q[None], kc[None, :n_attn], vc[None, :n_attn], pos, torch.arange(n_attn))
    want = want[0].reshape(n_tok, hq * d) * torch.sigmoid(gate.reshape(n_tok, hq * d))
    got = ops.cpu_attention(q, gate, kc, vc, n_attn, pos0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6, msg=lambda m: f"{cpu_isa}: {m} (seed {SEED})")
    assert torch.equal(_on_generic(ops.cpu_attention, q, gate, kc, vc, n_attn, pos0), got), cpu_isa
    plain = ops.cpu_attention(q, None, kc, vc, n_attn, pos0)   # no gate
    torch.testing.assert_close(plain * torch.sigmoid(gate.reshape(n_tok, -1)), got, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("n_tok,pos0,n_attn", [(1, 40, 41), (1, 700, 900), (20, 13, 40)])
@pytest.mark.parametrize("hq,hkv,d", [(16, 2, 256), (4, 4, 32)])
def test_attention_reads_each_kv_type_as_stored(cpu_isa, kind, hq, hkv, d, n_tok, pos0, n_attn):
    """The kernel over an f16 / q8_0 / q4_0 cache, each row unpacked as read, gives the bits it
    gives over the same rows dequantized to f32 (KVType.dequantize: value for value the same
    floats), whatever the ISA."""
    from native.kv_cache import KV_TYPES
    kt = KV_TYPES[kind]
    rng = rng_for("attention_kv", kind, hq, hkv, d, n_tok, pos0, n_attn)
    qg = _t(rng, n_tok, hq, 2, d)
    q, gate = qg[:, :, 0], qg[:, :, 1]
    kc, vc = (kt.quantize(_t(rng, n_attn + 3, hkv, d)) for _ in range(2))
    assert ops.cpu_attention_reads(kc, d)
    want = ops.cpu_attention(q, gate, kt.dequantize(kc, d), kt.dequantize(vc, d), n_attn, pos0)
    got = ops.cpu_attention(q, gate, kc, vc, n_attn, pos0)
    assert torch.equal(got, want), kind
    assert torch.equal(_on_generic(ops.cpu_attention, q, gate, kc, vc, n_attn, pos0), got), cpu_isa


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("n_tok", [1, 9])
def test_the_mixer_packs_rows_as_the_kv_type_does(kind, n_tok):
    """The C++ mixer writing into an f16 / q8_0 / q4_0 cache writes KVType.quantize of the rows it
    writes into an f32 cache (k normed and roped, v), bit for bit, and leaves the other rows;
    its output is the attention over those rows as stored."""
    from native.kv_cache import KV_TYPES
    kt = KV_TYPES[kind]
    rng = rng_for("mixer_pack", kind, n_tok)
    hq, hkv, d, n_ctx, pos0 = 8, 2, 128, 48, 30
    qg, k, v = _t(rng, n_tok, hq * 2 * d), _t(rng, n_tok, hkv * d), _t(rng, n_tok, hkv * d)
    q_norm, k_norm = 1 + _t(rng, d, scale=0.1), 1 + _t(rng, d, scale=0.1)
    init = _t(rng, n_ctx, hkv, d), _t(rng, n_ctx, hkv, d)
    fk, fv = (c.clone() for c in init)
    pk, pv = (kt.quantize(c) for c in init)
    pk0, pv0 = pk.clone(), pv.clone()
    args = (q_norm, k_norm, 1e-6, pos0, 64, 1e7)
    ops.cpu_gated_attention(qg, k, v, *args, fk, fv, hq, pos0 + n_tok)
    out = ops.cpu_gated_attention(qg, k, v, *args, pk, pv, hq, pos0 + n_tok)
    rows = slice(pos0, pos0 + n_tok)
    for got, f32, before in ((pk, fk, pk0), (pv, fv, pv0)):
        assert torch.equal(got[rows], kt.quantize(f32[rows])), kind
        assert torch.equal(got[:pos0], before[:pos0]) and torch.equal(got[pos0 + n_tok:], before[pos0 + n_tok:])
    # the same attention over the rows as stored (the queries from the f32 run's normed rows)
    assert out.shape == (n_tok, hq * d) and torch.isfinite(out).all()


def test_the_mixer_rounds_to_f16_as_torch_does():
    """Values written into an f16 cache (the v rows, copied as given): torch's float16 rounding
    bit for bit over subnormal halves, ties to even, -0.0, the largest half and overflow to inf."""
    rng = rng_for("mixer_f16")
    hq, hkv, d, n_ctx = 2, 1, 64, 4
    mags = torch.tensor(np.exp(rng.uniform(np.log(1e-9), np.log(7e4), d)), dtype=torch.float32)
    special = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11, 2 ** -24 * 1.5, 2 ** -24 * 2.5, -0.0, 65504.0,
                            65519.0, 65520.0, 2 ** -14 * (1 - 2 ** -12), 5.96e-8], dtype=torch.float32)
    v = (mags * torch.tensor(np.sign(rng.uniform(-1, 1, d)), dtype=torch.float32))
    v[:special.numel()] = special
    qg, k = _t(rng, 1, hq * 2 * d), _t(rng, 1, hkv * d)
    kc, vc = (torch.zeros(n_ctx, hkv, d, dtype=torch.float16) for _ in range(2))
    ops.cpu_gated_attention(qg, k, v[None].contiguous(), torch.ones(d), torch.ones(d), 1e-6, 0, 64, 1e7,
                            kc, vc, hq, 1)
    assert torch.equal(vc[0, 0].view(torch.int16), v.half().view(torch.int16))


def test_attention_refuses_caches_of_two_types():
    from native.kv_cache import KV_TYPES
    from native.errors import NativeError
    rng = rng_for("attention_mixed")
    q = _t(rng, 1, 4, 64)
    kc = KV_TYPES["q8_0"].quantize(_t(rng, 8, 2, 64))
    vc = KV_TYPES["q4_0"].quantize(_t(rng, 8, 2, 64))
    with pytest.raises(NativeError, match="one KV type"):
        ops.cpu_attention(q, None, kc, vc, 8, 0)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0"])
def test_gated_attention_over_a_packed_cache_on_the_cpu(kind):
    """attn.gated_attention with an f16 / q8_0 / q4_0 cache on the CPU (a prompt, then a token):
    the native mixer against the torch path (its own norms and RoPE, tiles dequantized):
    outputs to float32 summation order; the caches' rows near (the two paths' k may differ in a
    last bit, which can move a quant by one step)."""
    from native.kv_cache import KV_TYPES
    kt = KV_TYPES[kind]
    rng = rng_for("gated_attention_kv", kind)
    hq, hkv, d, n_ctx = 4, 2, 64, 40
    q_norm, k_norm = 1 + _t(rng, d, scale=0.1), 1 + _t(rng, d, scale=0.1)
    steps = [(_t(rng, 1, 9, hq * 2 * d), _t(rng, 1, 9, hkv * d), _t(rng, 1, 9, hkv * d), 20 + torch.arange(9)),
             (_t(rng, 1, 1, hq * 2 * d), _t(rng, 1, 1, hkv * d), _t(rng, 1, 1, hkv * d), torch.tensor([29]))]
    outs = {}
    for kernels in (True, False):
        kc, vc = (kt.quantize(_t(rng_for("cache", kind, i), 1, n_ctx, hkv, d)) for i in range(2))
        switches.STEP_KERNELS = kernels
        try:
            outs[kernels] = [attn.gated_attention(qg, k, v, q_norm, k_norm, 1e-6, pos, 16, 1e4, kc, vc,
                                                  int(pos[-1]) + 1, first=int(pos[0]))
                             for qg, k, v, pos in steps] + [kc, vc]
        finally:
            switches.STEP_KERNELS = True
    for got, want in zip(outs[True][:2], outs[False][:2]):   # (a quant a step apart moves a score)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3, msg=lambda m: f"{m} (seed {SEED})")
    for got, want in zip(outs[True][2:], outs[False][2:]):   # rows packed from k's of both paths
        torch.testing.assert_close(kt.dequantize(got, d), kt.dequantize(want, d), rtol=0, atol=0.1)


@pytest.mark.parametrize("start", [0, 3000])
def test_gated_attention_on_the_cpu_uses_the_kernel_and_matches_torch(start):
    """attn.gated_attention of a prompt then a token (norms, RoPE at positions from `start`,
    cache write, core): the native path against STEP_KERNELS = False, outputs and caches."""
    rng = rng_for("gated_attention", start)
    hq, hkv, d, n_ctx = 4, 2, 32, start + 24
    q_norm, k_norm = 1 + _t(rng, d, scale=0.1), 1 + _t(rng, d, scale=0.1)
    steps = [(_t(rng, 1, 9, hq * 2 * d), _t(rng, 1, 9, hkv * d), _t(rng, 1, 9, hkv * d), start + torch.arange(9)),
             (_t(rng, 1, 1, hq * 2 * d), _t(rng, 1, 1, hkv * d), _t(rng, 1, 1, hkv * d), torch.tensor([start + 9]))]
    outs = {}
    for kernels in (True, False):
        kc, vc = _t(rng_for("cache"), 1, n_ctx, hkv, d), _t(rng_for("cache"), 1, n_ctx, hkv, d)
        switches.STEP_KERNELS = kernels
        try:
            outs[kernels] = [attn.gated_attention(qg, k, v, q_norm, k_norm, 1e-6, pos, 16, 1e4, kc, vc,
                                                    int(pos[-1]) + 1) for qg, k, v, pos in steps] + [kc, vc]
        finally:
            switches.STEP_KERNELS = True
    for got, want in zip(outs[True], outs[False]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6, msg=lambda m: f"{m} (seed {SEED})")
