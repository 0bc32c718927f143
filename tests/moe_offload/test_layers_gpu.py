"""The decode-step CUDA kernels (native/csrc/cuda/step.cu) against their torch references in
moe_offload.models.layers (STEP_KERNELS = False), on fresh random inputs, including the row-strided
views that a fused projection's output gives. GPU only; the references run in CI through the
model's oracle tests.

Tolerances: float32 with different summation orders and --use_fast_math exp/rsqrt: relative 2e-5
of each output's scale.
"""
from __future__ import annotations

import pytest
import torch

from moe_offload.models import attention as attn
from moe_offload.models import layers
from moe_offload.instrument import switches

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def _need_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from native import ops
    if not ops.step_kernels_available(torch.zeros(1, device=DEV)):
        pytest.skip("native._cuda lacks the decode-step kernels")


def _reference(fn, *args, **kw):
    old = switches.STEP_KERNELS
    switches.STEP_KERNELS = False
    try:
        return fn(*args, **kw)
    finally:
        switches.STEP_KERNELS = old


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 2e-5) -> None:
    scale = max(float(b.abs().max()), 1e-6)
    err = float((a.float() - b.float()).abs().max())
    assert err <= rel * scale, f"max |diff| {err:.3g} vs scale {scale:.3g}"


def _rand(*shape, g, scale=1.0):
    return torch.randn(*shape, generator=g, device=DEV) * scale


@pytest.mark.parametrize("rows,n", [(1, 2048), (5, 96), (3, 1000)])
@pytest.mark.parametrize("terms", ["none", "a", "a+b"])
def test_residual_rms_norm(rows, n, terms):
    g = torch.Generator(DEV).manual_seed(rows * n)
    x = _rand(rows, n, g=g)
    w = _rand(n, g=g) * 0.1 + 1
    wide = _rand(rows, 3 * n + 1, g=g)              # a, b, s as views of one wider output
    a, b, s = wide[:, :n], wide[:, n + 1:2 * n + 1], wide[:, n:n + 1]
    args = {"none": (), "a": (a,), "a+b": (a, b, s)}[terms]
    x_ref = x.clone()
    ref = _reference(layers.residual_rms_norm, x_ref, w, 1e-6, *args)
    out = layers.residual_rms_norm(x, w, 1e-6, *args)
    _close(x, x_ref, 1e-6)
    _close(out, ref)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dims", [(2, 4, 32, 64, 4), (16, 32, 128, 128, 4)])
def test_gated_delta_net_one_token(batch, dims):
    hk, hv, dk, dv, kc = dims
    g = torch.Generator(DEV).manual_seed(batch * hv)
    C = 2 * hk * dk + hv * dv
    proj = _rand(batch, 1, C + hv * dv + 2 * hv, g=g)           # mix | z | beta | alpha
    mix, z, beta_raw, alpha_raw = proj.split([C, hv * dv, hv, hv], dim=-1)
    conv_w, ssm_a = _rand(C, kc, g=g, scale=0.5), -torch.rand(hv, generator=g, device=DEV) * 2
    dt_bias, norm_w = _rand(hv, g=g), _rand(dv, g=g) * 0.1 + 1
    conv0, ssm0 = _rand(batch, C, kc - 1, g=g), _rand(batch, hv, dk, dv, g=g, scale=0.1)
    conv_r, ssm_r, conv_k, ssm_k = conv0.clone(), ssm0.clone(), conv0.clone(), ssm0.clone()
    args = (conv_w, ssm_a, dt_bias, norm_w, hk, 1e-6)
    ref = _reference(layers.gated_delta_net, mix, z, beta_raw, alpha_raw, conv_r, ssm_r, *args)
    out = layers.gated_delta_net(mix, z, beta_raw, alpha_raw, conv_k, ssm_k, *args)
    assert out.shape == ref.shape == (batch, 1, hv * dv)
    _close(out, ref, 1e-4)     # through a norm: relative errors of o are amplified by ~1/rms(o)
    _close(conv_k, conv_r, 0)  # the shift is a copy
    _close(ssm_k, ssm_r)


def test_gated_delta_net_steps_accumulate_like_the_reference():
    """Twenty tokens in a row: the state the kernel leaves is what the next step reads."""
    hk, hv, dk, dv, kc = 2, 4, 32, 64, 4
    g = torch.Generator(DEV).manual_seed(7)
    C = 2 * hk * dk + hv * dv
    conv_w, ssm_a = _rand(C, kc, g=g, scale=0.5), -torch.rand(hv, generator=g, device=DEV)
    dt_bias, norm_w = _rand(hv, g=g), torch.ones(dv, device=DEV)
    conv_r, ssm_r = torch.zeros(1, C, kc - 1, device=DEV), torch.zeros(1, hv, dk, dv, device=DEV)
    conv_k, ssm_k = conv_r.clone(), ssm_r.clone()
    for _ in range(20):
        mix, z = _rand(1, 1, C, g=g), _rand(1, 1, hv * dv, g=g)
        br, ar = _rand(1, 1, hv, g=g), _rand(1, 1, hv, g=g)
        args = (conv_w, ssm_a, dt_bias, norm_w, hk, 1e-6)
        ref = _reference(layers.gated_delta_net, mix, z, br, ar, conv_r, ssm_r, *args)
        out = layers.gated_delta_net(mix, z, br, ar, conv_k, ssm_k, *args)
        _close(out, ref, 1e-4)
    _close(ssm_k, ssm_r, 1e-4)


def _delta_inputs(g, n, T, hk=2, hv=4, dk=32, dv=64, kc=4):
    """n sequences' projections [n, T, ..] (views of one fused output), weights, and states."""
    C = 2 * hk * dk + hv * dv
    proj = _rand(n, T, C + hv * dv + 2 * hv, g=g)
    mix, z, br, ar = proj.split([C, hv * dv, hv, hv], dim=-1)
    conv_w, ssm_a = _rand(C, kc, g=g, scale=0.5), -torch.rand(hv, generator=g, device=DEV)
    weights = (conv_w, ssm_a, _rand(hv, g=g), _rand(dv, g=g) * 0.1 + 1, hk, 1e-6)
    conv = _rand(n, C, kc - 1, g=g)
    ssm = _rand(n, hv, dk, dv, g=g, scale=0.1)
    return (mix, z, br, ar), weights, conv, ssm


# (2, 4, 32, 64): rows of 4 a thread, the guarded loops; (16, 32, 128, 128): the 35B-A3B's heads,
# the kernel's unrolled form
@pytest.mark.parametrize("dims", [(2, 4, 32, 64), (16, 32, 128, 128)])
@pytest.mark.parametrize("T", [2, 3, 8, 11])   # 11: two batches of tokens in one launch
def test_delta_net_tokens_in_one_launch_equal_one_at_a_time(T, dims):
    """A verify step's T tokens go through one launch each of the conv and the delta rule; outputs,
    final states and the states kept after each token equal T one-token steps bit for bit (a
    verify step must compute what decode computes)."""
    g = torch.Generator(DEV).manual_seed(T)
    hk, hv, dk, dv = dims
    proj, w, conv, ssm = _delta_inputs(g, 1, T, hk, hv, dk, dv)
    conv_1, ssm_1 = conv.clone(), ssm.clone()
    outs, kept = [], []
    for t in range(T):
        outs.append(layers.gated_delta_net(*(u[:, t:t + 1] for u in proj), conv_1, ssm_1, *w))
        kept.append((conv_1.clone(), ssm_1.clone()))
    steps = (torch.full((T - 1, *conv.shape), float("nan"), device=DEV),
             torch.full((T - 1, *ssm.shape), float("nan"), device=DEV))
    out = layers.gated_delta_net(*proj, conv, ssm, *w, steps=steps)
    assert torch.equal(out, torch.cat(outs, dim=1))
    assert torch.equal(conv, conv_1) and torch.equal(ssm, ssm_1)
    for t in range(T - 1):
        assert torch.equal(steps[0][t], kept[t][0]) and torch.equal(steps[1][t], kept[t][1])


@pytest.mark.parametrize("dims", [(2, 4, 32, 64), (16, 32, 128, 128)])
@pytest.mark.parametrize("n", [3, 10])   # 10: two launches of at most 8 sequences
def test_delta_net_many_sequences_equal_each_alone(n, dims):
    """decode_many's delta-net: one token of n sequences whose states are separate tensors, in one
    launch each, equals each sequence stepped alone bit for bit, and against the torch reference."""
    g = torch.Generator(DEV).manual_seed(n)
    proj, w, conv, ssm = _delta_inputs(g, n, 1, *dims)
    convs = [conv[b:b + 1].clone() for b in range(n)]
    ssms = [ssm[b:b + 1].clone() for b in range(n)]
    alone_c, alone_s = [c.clone() for c in convs], [s.clone() for s in ssms]
    ref_c, ref_s = [c.clone() for c in convs], [s.clone() for s in ssms]
    out = layers.gated_delta_net_many(*proj, convs, ssms, *w)
    for b in range(n):
        one = tuple(u[b:b + 1] for u in proj)
        alone = layers.gated_delta_net(*one, alone_c[b], alone_s[b], *w)
        assert torch.equal(out[b:b + 1], alone)
        assert torch.equal(convs[b], alone_c[b]) and torch.equal(ssms[b], alone_s[b])
        ref = _reference(layers.gated_delta_net, *one, ref_c[b], ref_s[b], *w)
        _close(out[b:b + 1], ref, 1e-4)
        _close(ssms[b], ref_s[b])


@pytest.mark.parametrize("positions", [[5, 300, 1100], [0, 7, 129, 255, 256, 600, 901, 1500, 3, 64]])
def test_attention_many_sequences_equal_each_alone(positions):
    """decode_many's attention: one token of each sequence, its own cache and position, in one
    launch (10: two launches of at most 8), equals each sequence's own decode step bit for bit,
    also where one attends fewer splits of rows than the longest."""
    n, (hq, hkv, d, n_rot), n_ctx = len(positions), (8, 2, 128, 64), 2048
    g = torch.Generator(DEV).manual_seed(n)
    proj = _rand(n, 1, hq * 2 * d + 2 * hkv * d, g=g)
    qg, k, v = proj.split([hq * 2 * d, hkv * d, hkv * d], dim=-1)
    q_norm, k_norm = _rand(d, g=g) * 0.1 + 1, _rand(d, g=g) * 0.1 + 1
    kc = [_rand(1, n_ctx, hkv, d, g=g).half() for _ in range(n)]
    vc = [_rand(1, n_ctx, hkv, d, g=g).half() for _ in range(n)]
    kc1, vc1 = [c.clone() for c in kc], [c.clone() for c in vc]
    pos = [torch.tensor([p], device=DEV) for p in positions]
    n_attn = [min(n_ctx, (p // 256 + 1) * 256) for p in positions]
    out = attn.gated_attention_many(qg, k, v, q_norm, k_norm, 1e-6, pos, n_rot, 1e7, kc, vc, n_attn)
    for b in range(n):
        alone = attn.gated_attention(qg[b:b + 1], k[b:b + 1], v[b:b + 1], q_norm, k_norm, 1e-6,
                                       pos[b], n_rot, 1e7, kc1[b], vc1[b], n_attn[b])
        assert torch.equal(out[b:b + 1], alone), f"sequence {b} at {positions[b]}"
        assert torch.equal(kc[b], kc1[b]) and torch.equal(vc[b], vc1[b])


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("T,batch,start", [(2, 1, 0), (3, 1, 517), (8, 1, 250), (3, 2, 40)])
def test_attention_of_several_tokens_equals_one_at_a_time(cache_dtype, T, batch, start):
    """A verify step's attention: T tokens of a sequence at start..start+T-1, their rows written
    first and then all attending in one launch, equal T one-token steps in turn bit for bit
    (outputs and caches), also across a split boundary (250..257) and for two sequences."""
    (hq, hkv, d, n_rot), n_ctx = (16, 2, 256, 64), 1024
    g = torch.Generator(DEV).manual_seed(T * 100 + start + batch)
    proj = _rand(batch, T, hq * 2 * d + 2 * hkv * d, g=g)
    qg, k, v = proj.split([hq * 2 * d, hkv * d, hkv * d], dim=-1)
    q_norm, k_norm = _rand(d, g=g) * 0.1 + 1, _rand(d, g=g) * 0.1 + 1
    kc, vc = (_rand(batch, n_ctx, hkv, d, g=g).to(cache_dtype) for _ in range(2))
    kc1, vc1 = kc.clone(), vc.clone()
    pos = start + torch.arange(T, device=DEV)
    n_attn = min(n_ctx, ((start + T) // 256 + 1) * 256)
    args = (q_norm, k_norm, 1e-6)
    out = attn.gated_attention(qg, k, v, *args, pos, n_rot, 1e7, kc, vc, n_attn)
    one = [attn.gated_attention(qg[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], *args, pos[t:t + 1],
                                  n_rot, 1e7, kc1, vc1, n_attn) for t in range(T)]
    assert torch.equal(kc, kc1) and torch.equal(vc, vc1)
    assert torch.equal(out, torch.cat(one, 1))


@pytest.mark.parametrize("wtype", ["F32", "F16", "BF16"])
def test_float_matmul_rows_equal_one_at_a_time(wtype):
    """A float weight (the F32 router, F16 eh_proj) on few rows: every row's product is the bits
    of its one-row product whatever the row count (a verify step routes as decode does), and
    close to torch's."""
    from loaders.quants import quant_type
    from native import ops
    from native.ops import QTensor
    o, h = 257, 2048
    g = torch.Generator(DEV).manual_seed(7)
    wf = _rand(o, h, g=g, scale=0.02)
    raw = wf.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[wtype])
    w = QTensor(raw.view(torch.uint8).reshape(o, -1), quant_type(wtype), (o, h), "router")
    x = _rand(8, h, g=g)
    one = torch.cat([ops.matmul(x[i:i + 1], w) for i in range(8)])
    for T in (2, 3, 5, 8):
        assert torch.equal(ops.matmul(x[:T], w), one[:T]), T
    _close(one, x @ raw.float().T, 1e-5)


@pytest.mark.parametrize("rows,E,k", [(1, 256, 8), (4, 256, 8), (3, 64, 4), (2, 2048, 16)])
def test_route_topk(rows, E, k):
    g = torch.Generator(DEV).manual_seed(E + k)
    logits = _rand(rows, E + 1, g=g, scale=3.0)[:, :E]          # a view, as the fused router gives
    ids_r, w_r = _reference(layers.route_topk, logits, k)
    ids, w = layers.route_topk(logits, k)
    assert ids.dtype == torch.int32 and ids.shape == (rows, k)
    assert torch.equal(ids.long(), ids_r)                        # same experts, same order
    _close(w, w_r)
    _close(w.sum(-1), torch.ones(rows, device=DEV), 1e-6)


def test_swiglu_on_a_fused_output():
    g = torch.Generator(DEV).manual_seed(3)
    gu = _rand(3, 2 * 512, g=g, scale=4.0)
    gate, up = gu[:, :512], gu[:, 512:]
    _close(layers.swiglu(gate, up), _reference(layers.swiglu, gate, up))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("dims,batch,pos", [((4, 2, 64, 32), 1, 0), ((4, 2, 64, 32), 2, 37),
                                            ((16, 2, 256, 64), 1, 3000)])
def test_gated_attention_one_token(cache_dtype, dims, batch, pos):
    hq, hkv, d, n_rot = dims
    n_ctx = 4096 if pos > 64 else 64
    g = torch.Generator(DEV).manual_seed(pos + batch)
    proj = _rand(batch, 1, hq * 2 * d + 2 * hkv * d, g=g)           # qg | k | v, as fused
    qg, k, v = proj.split([hq * 2 * d, hkv * d, hkv * d], dim=-1)
    q_norm, k_norm = _rand(d, g=g) * 0.1 + 1, _rand(d, g=g) * 0.1 + 1
    cache0 = [_rand(batch, n_ctx, hkv, d, g=g).to(cache_dtype) for _ in range(2)]
    kr, vr, kk, vk = cache0[0].clone(), cache0[1].clone(), cache0[0].clone(), cache0[1].clone()
    p = torch.tensor([pos], device=DEV)
    n_attn = min(n_ctx, (pos // 64 + 1) * 64)                        # a bucket past pos: masked
    args = (q_norm, k_norm, 1e-6, p, n_rot, 1e7)
    ref = _reference(attn.gated_attention, qg, k, v, *args, kr, vr, n_attn)
    out = attn.gated_attention(qg, k, v, *args, kk, vk, n_attn)
    assert out.shape == ref.shape == (batch, 1, hq * d)
    _close(out, ref, 1e-4)
    # row pos: one f16 rounding step apart at most; in f32, RoPE angles of pos * inv_freq differ
    # by pos ulps (torch's float32 pow is not correctly rounded; the kernel's is)
    _close(kk.float(), kr.float(), 2e-3 if cache_dtype == torch.float16 else 1e-5 + pos * 1e-8)
    _close(vk.float(), vr.float(), 0)


def _table(rows: list[list[torch.Tensor]]) -> torch.Tensor:
    """[S, W] int64 on the device: row s the addresses of sequence s's buffers."""
    return torch.tensor([[b.data_ptr() for b in bufs] for bufs in rows], dtype=torch.int64,
                        device=DEV)


def _through(table: torch.Tensor, col: int, like: torch.Tensor):
    from native import ops
    W = table.shape[1]
    return ops.SeqTable(table, tuple(b * W + col for b in range(table.shape[0])), like)


def _attention_inputs(g, n, T=1, hq=8, hkv=2, d=128, n_ctx=2048):
    proj = _rand(n, T, hq * 2 * d + 2 * hkv * d, g=g)
    qg, k, v = proj.split([hq * 2 * d, hkv * d, hkv * d], dim=-1)
    norms = (_rand(d, g=g) * 0.1 + 1, _rand(d, g=g) * 0.1 + 1)
    kc = [_rand(1, n_ctx, hkv, d, g=g).half() for _ in range(n)]
    vc = [_rand(1, n_ctx, hkv, d, g=g).half() for _ in range(n)]
    return (qg, k, v), norms, kc, vc


@pytest.mark.parametrize("n", [3, 10])   # 10: two launches of at most 8 sequences
def test_sequences_through_a_table_equal_by_address(n):
    """The step kernels reaching each sequence's state through a device table of addresses (how a
    batched server's captured steps reach them) compute what they compute given the addresses,
    bit for bit: decode_many's delta-net and attention, and a verify step's tokens of one
    sequence."""
    g = torch.Generator(DEV).manual_seed(100 + n)
    proj, w, conv, ssm = _delta_inputs(g, n, 1)
    convs = [conv[b:b + 1].clone() for b in range(n)]
    ssms = [ssm[b:b + 1].clone() for b in range(n)]
    convs_t, ssms_t = [c.clone() for c in convs], [s.clone() for s in ssms]
    table = _table([[c, s] for c, s in zip(convs_t, ssms_t)])
    ref = layers.gated_delta_net_many(*proj, convs, ssms, *w)
    got = layers.gated_delta_net_many(*proj, _through(table, 0, convs_t[0]),
                                      _through(table, 1, ssms_t[0]), *w)
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(convs + ssms, convs_t + ssms_t))

    positions = torch.randint(0, 1900, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    (qg, k, v), norms, kc, vc = _attention_inputs(g, n)
    kc_t, vc_t = [c.clone() for c in kc], [c.clone() for c in vc]
    pos = [torch.tensor([p], device=DEV) for p in positions]
    n_attn = [min(2048, (p // 256 + 1) * 256) for p in positions]
    table = _table([[a, b] for a, b in zip(kc_t, vc_t)])
    ref = attn.gated_attention_many(qg, k, v, *norms, 1e-6, pos, 64, 1e7, kc, vc, n_attn)
    got = attn.gated_attention_many(qg, k, v, *norms, 1e-6, pos, 64, 1e7,
                                      _through(table, 0, kc_t[0]), _through(table, 1, vc_t[0]),
                                      n_attn)
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(kc + vc, kc_t + vc_t))

    for T in (1, 5):   # one sequence's tokens (a verify step), its caches through the table
        (qg, k, v), norms, (kc1,), (vc1,) = _attention_inputs(g, 1, T)
        kc1_t, vc1_t = kc1.clone(), vc1.clone()
        at = torch.arange(T, device=DEV) + 700
        ref = attn.gated_attention(qg, k, v, *norms, 1e-6, at, 64, 1e7, kc1, vc1, 768)
        table = _table([[kc1_t, vc1_t]])
        got = attn.gated_attention(qg, k, v, *norms, 1e-6, at, 64, 1e7,
                                     _through(table, 0, kc1_t), _through(table, 1, vc1_t), 768)
        assert torch.equal(got, ref), f"{T} tokens"
        assert torch.equal(kc1, kc1_t) and torch.equal(vc1, vc1_t)


def test_a_step_captured_on_a_table_runs_whichever_sequences_it_names():
    """A CUDA graph of decode_many's mixers captured on a table naming sequences A replays on
    sequences B once the table is rewritten to name them: B's outputs and states are the eager
    call's on B, bit for bit, and A's buffers are left as they were."""
    n = 3
    g = torch.Generator(DEV).manual_seed(7)
    proj, w, conv, ssm = _delta_inputs(g, 2 * n, 1)
    (qg, k, v), norms, kc, vc = _attention_inputs(g, 2 * n)
    convs = [conv[b:b + 1].clone() for b in range(2 * n)]
    ssms = [ssm[b:b + 1].clone() for b in range(2 * n)]
    positions = [40, 900, 1300, 5, 600, 1800]
    rows = [[kc[b], vc[b], convs[b], ssms[b]] for b in range(2 * n)]
    before = [[t.clone() for t in r] for r in rows]
    pos_b = [torch.tensor([p], device=DEV) for p in positions[n:]]
    ref_rows = [[t.clone() for t in r] for r in rows[n:]]     # eager on B, by address
    ref_a = attn.gated_attention_many(qg[:n], k[:n], v[:n], *norms, 1e-6, pos_b, 64, 1e7,
                                        [r[0] for r in ref_rows], [r[1] for r in ref_rows],
                                        [2048] * n)
    ref_d = layers.gated_delta_net_many(*(u[:n] for u in proj), [r[2] for r in ref_rows],
                                        [r[3] for r in ref_rows], *w)

    table = _table(rows[:n])
    pos = torch.tensor([[p] for p in positions[:n]], device=DEV)
    scratch = [[t.clone() for t in r] for r in rows[:n]]   # the warm-up runs on copies of A

    def step(tab):
        p = [pos[b] for b in range(n)]
        a = attn.gated_attention_many(qg[:n], k[:n], v[:n], *norms, 1e-6, p, 64, 1e7,
                                        _through(tab, 0, kc[0]), _through(tab, 1, vc[0]),
                                        [2048] * n)
        d = layers.gated_delta_net_many(*(u[:n] for u in proj), _through(tab, 2, convs[0]),
                                        _through(tab, 3, ssms[0]), *w)
        return a, d

    step(_table(scratch))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(table)
    table.copy_(_table(rows[n:]))
    pos.copy_(torch.tensor([[p] for p in positions[n:]], device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], ref_a) and torch.equal(out[1], ref_d)
    for got, ref in zip(rows[n:], ref_rows):
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    for got, was in zip(rows[:n], before[:n]):
        assert all(torch.equal(a, b) for a, b in zip(got, was))


# ---- quantized KV caches (native/kv_cache.py: q8_0, q4_0) ------------------------------------------

QUANT_KV = ["q8_0", "q4_0"]


def _quantized(kind: str, values: torch.Tensor) -> torch.Tensor:
    """values [..., d] f32 -> rows of the KV type `kind` on the device (quantized by the reference
    on the CPU, whose divisions are correctly rounded)."""
    from native.kv_cache import KV_TYPES
    return KV_TYPES[kind].quantize(values.cpu()).to(DEV)


def _dequantized(kind: str, rows: torch.Tensor, d: int) -> torch.Tensor:
    from native.kv_cache import KV_TYPES
    return KV_TYPES[kind].dequantize(rows.cpu(), d)


def _step_inputs(g, batch, hq, hkv, d):
    proj = _rand(batch, hq * 2 * d + 2 * hkv * d, g=g)               # qg | k | v, as fused
    qg, k, v = proj.split([hq * 2 * d, hkv * d, hkv * d], dim=-1)
    return qg, k, v, _rand(d, g=g) * 0.1 + 1, _rand(d, g=g) * 0.1 + 1


@pytest.mark.parametrize("kind", QUANT_KV)
@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_quantized_cache_row_is_the_reference_quantization(kind, d):
    """The row a step writes into a q8_0 / q4_0 cache is kv_cache's quantization of the row the
    same step writes into an f32 cache (k normed and roped, v), bit for bit, quants and scales;
    every other row is left as it was."""
    from native import ops
    hq, hkv, n_ctx, batch, pos = 4, 2, 64, 2, 37
    g = torch.Generator(DEV).manual_seed(d)
    qg, k, v, q_norm, k_norm = _step_inputs(g, batch, hq, hkv, d)
    init = [_rand(batch, n_ctx, hkv, d, g=g) for _ in range(2)]
    fk, fv = (c.clone() for c in init)
    qk, qv = (_quantized(kind, c) for c in init)
    qk0, qv0 = qk.clone(), qv.clone()
    p = torch.tensor(pos, device=DEV)
    n_rot = min(d, 64)
    ops.cuda_attention_step(qg, k, v, q_norm, k_norm, 1e-6, p, n_rot, 1e7, fk, fv, hq, n_ctx)
    ops.cuda_attention_step(qg, k, v, q_norm, k_norm, 1e-6, p, n_rot, 1e7, qk, qv, hq, n_ctx)
    other = torch.arange(n_ctx, device=DEV) != pos
    for got, f32, before, what in ((qk, fk, qk0, "k"), (qv, fv, qv0, "v")):
        want = _quantized(kind, f32[:, pos])
        assert torch.equal(got[:, pos], want), f"{what} row at {pos}"
        assert torch.equal(got[:, other], before[:, other]), f"{what}: other rows"


def _attention_reference(qg, q_norm, pos, n_rot, k_rows, v_rows, hq):
    """The torch math of a decode step's attention in float64 on the CPU, given the cache rows
    0..pos as f32 [B, pos+1, Hkv, d]: q RMS-normed, then NEOX-roped with the kernel's float32
    angles (pos * float32(base^(-2i/n_rot))), softmax over the rows, times sigmoid(gate)."""
    B, L, hkv, d = k_rows.shape
    qh = qg.cpu().double().view(B, hq, 2, d)
    q, gate = qh[:, :, 0], qh[:, :, 1]
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * q_norm.cpu().double()
    half = n_rot // 2
    inv = (1e7 ** (-2 * torch.arange(half, dtype=torch.float64) / n_rot)).float()
    ang = (torch.tensor(float(pos), dtype=torch.float32) * inv).double()
    c, s = ang.cos(), ang.sin()
    x1, x2 = q[..., :half].clone(), q[..., half:n_rot].clone()
    q[..., :half], q[..., half:n_rot] = x1 * c - x2 * s, x2 * c + x1 * s
    kh = k_rows.double().repeat_interleave(hq // hkv, dim=2)          # [B, L, hq, d]
    vh = v_rows.double().repeat_interleave(hq // hkv, dim=2)
    w = torch.softmax(torch.einsum("bhd,blhd->bhl", q, kh) * d ** -0.5, dim=-1)
    o = torch.einsum("bhl,blhd->bhd", w, vh)
    return (o * torch.sigmoid(gate)).reshape(B, hq * d)


@pytest.mark.parametrize("kind", QUANT_KV)
@pytest.mark.parametrize("dims,batch,pos", [((4, 2, 64, 32), 1, 0), ((4, 2, 128, 64), 2, 37),
                                            ((16, 2, 256, 64), 1, 3000), ((4, 1, 512, 64), 1, 300),
                                            ((16, 2, 128, 64), 2, 9000), ((8, 2, 256, 64), 1, 40000)])
def test_attention_over_a_quantized_cache(kind, dims, batch, pos):
    """A decode step over a q8_0 / q4_0 cache attends the rows as the cache holds them: the
    output is the float64 torch math over the dequantized rows 0..pos (row pos the one the step
    wrote, whose bits the test above checks), at one split of rows and across many."""
    from native import ops
    hq, hkv, d, n_rot = dims
    n_ctx = pos + 1000 if pos > 64 else 64
    g = torch.Generator(DEV).manual_seed(pos + batch + d)
    qg, k, v, q_norm, k_norm = _step_inputs(g, batch, hq, hkv, d)
    kc, vc = (_quantized(kind, _rand(batch, n_ctx, hkv, d, g=g)) for _ in range(2))
    p = torch.tensor(pos, device=DEV)
    n_attn = min(n_ctx, (pos // 64 + 1) * 64)                        # a bucket past pos: masked
    out = ops.cuda_attention_step(qg, k, v, q_norm, k_norm, 1e-6, p, n_rot, 1e7, kc, vc, hq, n_attn)
    assert out.shape == (batch, hq * d)
    ref = _attention_reference(qg, q_norm, pos, n_rot, _dequantized(kind, kc[:, :pos + 1], d),
                               _dequantized(kind, vc[:, :pos + 1], d), hq)
    _close(out.cpu().double(), ref, 1e-4)


@pytest.mark.parametrize("kind", QUANT_KV)
@pytest.mark.parametrize("T,batch,start", [(2, 1, 0), (3, 1, 517), (8, 1, 250), (3, 2, 40)])
def test_quantized_attention_of_several_tokens_equals_one_at_a_time(kind, T, batch, start):
    """A verify step's attention over a quantized cache: T tokens' rows written first, then all
    attending in one launch, equal T one-token steps in turn bit for bit (outputs and caches),
    also across a split boundary (250..257) and for two sequences."""
    from native import ops
    (hq, hkv, d, n_rot), n_ctx = (16, 2, 256, 64), 1024
    g = torch.Generator(DEV).manual_seed(T * 100 + start + batch)
    proj = _rand(batch, T, hq * 2 * d + 2 * hkv * d, g=g)
    qg, k, v = proj.split([hq * 2 * d, hkv * d, hkv * d], dim=-1)
    norms = (_rand(d, g=g) * 0.1 + 1, _rand(d, g=g) * 0.1 + 1, 1e-6)
    kc, vc = (_quantized(kind, _rand(batch, n_ctx, hkv, d, g=g)) for _ in range(2))
    kc1, vc1 = kc.clone(), vc.clone()
    pos = start + torch.arange(T, device=DEV)
    n_attn = min(n_ctx, ((start + T) // 256 + 1) * 256)
    out = ops.cuda_attention_many(qg.reshape(batch * T, -1), k.reshape(batch * T, -1),
                                  v.reshape(batch * T, -1), *norms, [pos[t] for t in range(T)] * batch,
                                  n_rot, 1e7, [c for c in kc for _ in range(T)],
                                  [c for c in vc for _ in range(T)], hq, n_attn, write_first=True)
    one = [ops.cuda_attention_step(qg[:, t], k[:, t], v[:, t], *norms, pos[t], n_rot, 1e7, kc1, vc1,
                                   hq, n_attn) for t in range(T)]
    assert torch.equal(kc, kc1) and torch.equal(vc, vc1)
    assert torch.equal(out.view(batch, T, -1), torch.stack(one, dim=1))


@pytest.mark.parametrize("n", [3, 10])   # 10: two launches of at most 8 sequences
def test_quantized_caches_through_a_table_equal_by_address(n):
    """q8_0 caches reached through a device table of addresses: decode_many's attention and a
    verify step's tokens of one sequence compute what they compute given the addresses, bit for
    bit, outputs and caches."""
    from native import ops
    hq, hkv, d, n_ctx = 8, 2, 128, 2048
    g = torch.Generator(DEV).manual_seed(200 + n)
    qg, k, v, q_norm, k_norm = _step_inputs(g, n, hq, hkv, d)
    norms = (q_norm, k_norm, 1e-6)
    kc = [_quantized("q8_0", _rand(1, n_ctx, hkv, d, g=g)) for _ in range(n)]
    vc = [_quantized("q8_0", _rand(1, n_ctx, hkv, d, g=g)) for _ in range(n)]
    kc_t, vc_t = [c.clone() for c in kc], [c.clone() for c in vc]
    positions = torch.randint(0, 1900, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    pos = [torch.tensor([p], device=DEV) for p in positions]
    n_attn = max(min(n_ctx, (p // 256 + 1) * 256) for p in positions)
    ref = ops.cuda_attention_many(qg, k, v, *norms, pos, 64, 1e7, kc, vc, hq, n_attn)
    table = _table([[a, b] for a, b in zip(kc_t, vc_t)])
    got = ops.cuda_attention_many(qg, k, v, *norms, pos, 64, 1e7, _through(table, 0, kc_t[0]),
                                  _through(table, 1, vc_t[0]), hq, n_attn)
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(kc + vc, kc_t + vc_t))

    for T in (1, 5):   # one sequence's tokens (a verify step), its caches through the table
        qg, k, v, q_norm, k_norm = _step_inputs(g, T, hq, hkv, d)
        (kc1,), (vc1,) = ([_quantized("q8_0", _rand(1, n_ctx, hkv, d, g=g))] for _ in range(2))
        kc1_t, vc1_t = kc1.clone(), vc1.clone()
        at = [torch.tensor(700 + t, device=DEV) for t in range(T)]
        ref = ops.cuda_attention_many(qg, k, v, q_norm, k_norm, 1e-6, at, 64, 1e7, [kc1] * T,
                                      [vc1] * T, hq, 768, write_first=T > 1)
        table = _table([[kc1_t, vc1_t]])
        got = ops.cuda_attention_many(qg, k, v, q_norm, k_norm, 1e-6, at, 64, 1e7,
                                      ops.SeqTable(table, (0,) * T, kc1_t),
                                      ops.SeqTable(table, (1,) * T, vc1_t), hq, 768,
                                      write_first=T > 1)
        assert torch.equal(got, ref), f"{T} tokens"
        assert torch.equal(kc1, kc1_t) and torch.equal(vc1, vc1_t)


def test_a_cache_of_no_kv_type_is_refused():
    """uint8 rows of a width that is no KV type's for the head size, or caches of two types,
    are refused in one line before any launch."""
    from native import ops
    from native.errors import NativeError
    hq, hkv, d = 4, 2, 128
    g = torch.Generator(DEV).manual_seed(5)
    qg, k, v, q_norm, k_norm = _step_inputs(g, 1, hq, hkv, d)
    p = torch.tensor(3, device=DEV)
    bad = torch.zeros(1, 64, hkv, d + 1, dtype=torch.uint8, device=DEV)
    with pytest.raises(NativeError, match="q8_0 or q4_0"):
        ops.cuda_attention_step(qg, k, v, q_norm, k_norm, 1e-6, p, 64, 1e7, bad, bad.clone(), hq, 64)
    q8 = torch.zeros(1, 64, hkv, d + d // 16, dtype=torch.uint8, device=DEV)
    q4 = torch.zeros(1, 64, hkv, d // 2 + d // 16, dtype=torch.uint8, device=DEV)
    with pytest.raises(NativeError, match="one type"):
        ops.cuda_attention_many(qg, k, v, q_norm, k_norm, 1e-6, [p], 64, 1e7, [q8[0]], [q4[0]], hq, 64)


def _kernel_form(form: str, fn):
    """fn() with the attention kernel FTPATCH_ATTENTION_GROUPED names (read at each launch): 0 the
    per-head kernel, 1 the group kernel a warp a group, 2 a warp a half group, 3 the tensor-core
    group kernel."""
    import os
    old = os.environ.get("FTPATCH_ATTENTION_GROUPED")
    os.environ["FTPATCH_ATTENTION_GROUPED"] = form
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["FTPATCH_ATTENTION_GROUPED"]
        else:
            os.environ["FTPATCH_ATTENTION_GROUPED"] = old


@pytest.mark.parametrize("form", ["1", "2", "3"])
@pytest.mark.parametrize("kind", ["f32", "f16", *QUANT_KV])
@pytest.mark.parametrize("dims,pos", [((16, 2, 256, 64), 5), ((16, 2, 256, 64), 70000),
                                      ((16, 2, 256, 64), 4111), ((16, 2, 128, 64), 2000),
                                      ((8, 2, 128, 64), 1500), ((16, 1, 128, 128), 300)])
def test_group_kernel_equals_the_per_head_kernel(form, kind, dims, pos):
    """The group kernels (one block a kv head, its 4 or 8 query heads at once: a warp for all of
    them or for half, or 8 heads on the tensor cores) against the per-head kernel on the same
    inputs: the rows written into the caches bit for bit (the same norm, RoPE and rounding), the
    outputs to float32 summation order (the tensor-core products carry each f16 operand with its
    remainder), at one split, at a partly filled last run of 16 rows and at 256 splits of a long
    context; a group of 16 (no group kernel) runs the per-head kernel either way, and the
    tensor-core form falls back to the warp form for f32 caches and groups of 4."""
    from native import ops
    from native.kv_cache import KV_TYPES
    hq, hkv, d, n_rot = dims
    n_ctx = pos + 64
    g = torch.Generator(DEV).manual_seed(pos + hq + d)
    qg, k, v, q_norm, k_norm = _step_inputs(g, 2, hq, hkv, d)
    caches = [KV_TYPES[kind].quantize(_rand(2, n_ctx, hkv, d, g=g)) for _ in range(2)]
    p = torch.tensor(pos, device=DEV)
    n_attn = min(n_ctx, (pos // 64 + 1) * 64)
    kg, vg = (c.clone() for c in caches)
    kp, vp = (c.clone() for c in caches)
    step = lambda kc, vc: ops.cuda_attention_step(qg, k, v, q_norm, k_norm, 1e-6, p, n_rot, 1e7,  # noqa: E731
                                                  kc, vc, hq, n_attn)
    got = _kernel_form(form, lambda: step(kg, vg))
    want = _kernel_form("0", lambda: step(kp, vp))
    assert torch.equal(kg, kp) and torch.equal(vg, vp)
    _close(got, want, 1e-5)
