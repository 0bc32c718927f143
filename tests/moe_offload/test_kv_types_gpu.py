"""Quantized KV and a prompt's tiled attention on the GPU: the tiles' TF32 products against
float32, and q8_0 / q4_0 caches through the model and the offload runtime (prefill, decode,
graphs, batched steps) against f16 with the bounds of the CPU's test_kv_types."""
import pytest
import torch

from loaders import open_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_tiled_attention_tf32_stays_near_float32(kv, monkeypatch):
    """A 2,048-token chunk at 6,000 over its prefix (the 35B's head shapes): the tiles' TF32
    products against the exact float32 ones (the reference path), relative error <= 2e-3."""
    from moe_offload.instrument import switches
    from moe_offload.models.attention import attention_tiled
    from native.kv_cache import KV_TYPES
    kt = KV_TYPES[kv]
    g = torch.Generator("cuda").manual_seed(1)
    T, first, Hq, Hkv, d = 2048, 6000, 16, 2, 256
    q = torch.randn(1, T, Hq, d, generator=g, device="cuda")
    kc = kt.quantize(torch.randn(1, first + T, Hkv, d, generator=g, device="cuda").cpu()).cuda()
    vc = kt.quantize(torch.randn(1, first + T, Hkv, d, generator=g, device="cuda").cpu()).cuda()
    pos = first + torch.arange(T, device="cuda")
    fast = attention_tiled(q, kc, vc, pos, first + T, first=first)
    monkeypatch.setattr(switches, "ATTENTION_TF32", False)
    exact = attention_tiled(q, kc, vc, pos, first + T, first=first)
    assert not torch.backends.cuda.matmul.allow_tf32          # the switch was put back
    err = float((fast - exact).abs().max()) / float(exact.abs().max())
    assert 0 < err <= 2e-3, err
    # the same rows on the CPU, whole-score reference
    from moe_offload.models.attention import attention
    ref = attention(q[:, :64].cpu(), kt.dequantize(kc.cpu(), d), kt.dequantize(vc.cpu(), d),
                    pos[:64].cpu(), torch.arange(first + T))
    assert torch.allclose(exact[:, :64].cpu(), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kv,T,first,tile", [("q8_0", 2048, 6000, None), ("f16", 100, 5000, 300),
                                             ("q4_0", 64, None, 512), ("q8_0", 1, 777, None)])
def test_tiled_attention_softmax_kernel_equals_the_torch_ops(kv, T, first, tile, monkeypatch):
    """A prompt chunk's attention with each tile's softmax update as one kernel against the torch
    ops (its reference), both with float32 products: relative 1e-5. Tiles of 300 rows leave
    rows of a width the kernel reads a column a lane; first None masks every tile; T = 1 is a
    decode token on this path."""
    from moe_offload.instrument import switches
    from moe_offload.models.attention import attention_tiled
    from native.kv_cache import KV_TYPES
    kt, Hq, Hkv, d = KV_TYPES[kv], 16, 2, 256
    start = 4000 if first is None else first
    g = torch.Generator("cuda").manual_seed(T)
    q = torch.randn(1, T, Hq, d, generator=g, device="cuda")
    kc, vc = (kt.quantize(torch.randn(1, start + T, Hkv, d, generator=g, device="cuda").cpu()).cuda()
              for _ in range(2))
    pos = start + torch.arange(T, device="cuda")
    monkeypatch.setattr(switches, "ATTENTION_TF32", False)
    fused = attention_tiled(q, kc, vc, pos, start + T, tile=tile, first=first)
    monkeypatch.setattr(switches, "SOFTMAX_TILE", False)
    ops = attention_tiled(q, kc, vc, pos, start + T, tile=tile, first=first)
    err = float((fused - ops).abs().max()) / float(ops.abs().max())
    assert err <= 1e-5, err


@pytest.fixture(scope="module")
def loaded(synth_model):
    return open_model(synth_model(type="IQ3_S"))


def _forced(backend, state, prompt, feed):
    """Logits of a prompt, then of the tokens `feed` [steps] one at a time."""
    out = [backend.prefill(prompt, state)]
    out += [backend.decode(feed[s:s + 1], state) for s in range(feed.shape[0])]
    return torch.cat(out)


def _near(a, b, what):
    """test_runtime_gpu's sanity bound for offloaded against resident logits."""
    scale, err = float(b.abs().max()), float((a - b).abs().max())
    cos = float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
    assert cos > 0.97 and err <= 0.3 * scale, f"{what}: |diff| {err:.3g}, cosine {cos:.5f}"


@pytest.mark.parametrize("kv,mean_bound", [("q8_0", 0.004), ("q4_0", 0.015)])
def test_quantized_kv_through_the_model_on_cuda(loaded, kv, mean_bound):
    """The whole model on the GPU (kernels for decode, the tiled torch path for the 70-token
    prompt): f16's greedy tokens, then the same tokens fed with a q8_0 / q4_0 KV: logits
    within the CPU test's mean bound of f16's; with q8_0 the same greedy choice wherever f16's
    top two are further apart than the two caches' logits differ there (this random-weight
    model's logits are near-uniform: one of 25 was such a tie on an H100)."""
    from moe_offload.models import build_model
    m = build_model(loaded, "cuda")
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, loaded.config.n_vocab, (1, 70), generator=g).cuda()
    st = m.new_state(1, 512, "f16")
    ref = [m.prefill(prompt, st)]
    for _ in range(24):
        ref.append(m.decode(ref[-1].argmax(-1), st))
    ref = torch.cat(ref)
    feed = ref[:-1].argmax(-1)
    out = _forced(m, m.new_state(1, 512, kv), prompt, feed)
    diff = float((out - ref).abs().mean())
    assert 0 < diff <= mean_bound, diff
    if kv == "q8_0":
        top2 = ref.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        noise = 2 * (out - ref).abs().max(-1).values
        clear = gap > noise
        assert int(clear.sum()) >= 0.8 * clear.numel()    # (20 of 25: a float mean of it is below 0.8)
        assert torch.equal(out.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("graphs", [False, True])
def test_runtime_with_q8_0_kv_follows_the_model(loaded, graphs):
    """The offload runtime (2 GiB cap, elastic KV, captured or eager steps) with a q8_0 KV,
    teacher-forced: near the all-on-GPU model with a q8_0 KV (test_runtime_gpu's bound), a
    prompt through prefill and one through decode-sized steps; decode_many of two sequences
    takes each one's argmax alone."""
    from moe_offload import OffloadPolicy, open_runtime
    from moe_offload.models import build_model
    m = build_model(loaded, "cuda")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, loaded.config.n_vocab, (1, n), generator=g).cuda() for n in (90, 7)]
    feed = torch.randint(0, loaded.config.n_vocab, (2, 12), generator=g).cuda()
    refs = [_forced(m, m.new_state(1, 512, "q8_0"), p, feed[b]) for b, p in enumerate(prompts)]
    rt = open_runtime(loaded, 2 << 30, policy=OffloadPolicy(fetch_fraction=1.0), ctx=512,
                      kv_type="q8_0", use_graphs=graphs, max_sequences=2)
    try:
        alone = []
        for b, (p, ref) in enumerate(zip(prompts, refs)):
            st = rt.new_state(1)
            assert st.kv_type.name == "q8_0" and st.k[3].dtype == torch.uint8
            alone.append(_forced(rt, st, p, feed[b]))
            _near(alone[-1], ref, f"prompt {p.shape[1]}")
            rt.release(st)
        states = [rt.new_state(1) for _ in prompts]
        first = torch.cat([rt.prefill(p, st) for p, st in zip(prompts, states)])
        steps = [rt.decode_many(feed[:, s], states) for s in range(feed.shape[1])]
        together = torch.stack([first] + steps, dim=1)             # [2, 1 + steps, V]
        for b in range(2):
            assert torch.equal(together[b].argmax(-1), alone[b].argmax(-1)), f"sequence {b}"
    finally:
        rt.close()
