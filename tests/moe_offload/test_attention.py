"""The attention mixer's torch forms (CPU): a prompt chunk's tiled attention
against the whole-score reference, on every KV type."""
from dataclasses import replace

import pytest
import torch

from moe_offload.models import attention as attn
from moe_offload.models.attention import attention, attention_tiled
from native.kv_cache import KV_TYPES


@pytest.mark.parametrize("tile", [1, 5, 12, 256])
def test_tiled_attention_equals_the_reference_with_a_partly_written_cache(tile):
    """A chunk at positions 5..11 over a 16-row cache of which 12 rows are attended (GQA 4:1),
    read in tiles of any size (one that ends mid-chunk, one past the rows): the reference's
    result, and rows past n_attn are never read."""
    g = torch.Generator().manual_seed(tile)
    B, T, Hq, Hkv, d, L = 2, 7, 8, 2, 32, 16
    q = torch.randn(B, T, Hq, d, generator=g)
    k = torch.randn(B, L, Hkv, d, generator=g)
    v = torch.randn(B, L, Hkv, d, generator=g)
    q_pos = torch.arange(5, 5 + T)
    ref = attention(q, k[:, :12], v[:, :12], q_pos, torch.arange(12))
    got = attention_tiled(q, k, v, q_pos, 12, tile=tile)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), float((got - ref).abs().max())
    k2, v2 = k.clone(), v.clone()
    k2[:, 12:], v2[:, 12:] = float("nan"), float("nan")
    assert torch.allclose(attention_tiled(q, k2, v2, q_pos, 12, tile=tile), got, atol=1e-6)


@pytest.mark.parametrize("name", ["f16", "q8_0", "q4_0"])
def test_tiled_attention_reads_each_kv_type_as_its_rows_dequantized(name):
    """On a quantized cache the tiles are dequantized as read: the result is the reference's
    over the dequantized cache (nothing else of the type leaks into the math)."""
    kt = KV_TYPES[name]
    g = torch.Generator().manual_seed(3)
    B, T, Hq, Hkv, d, L = 1, 9, 4, 2, 64, 40
    q = torch.randn(B, T, Hq, d, generator=g)
    kc = kt.quantize(torch.randn(B, L, Hkv, d, generator=g))
    vc = kt.quantize(torch.randn(B, L, Hkv, d, generator=g))
    q_pos = torch.arange(31, 31 + T)
    ref = attention(q, kt.dequantize(kc, d), kt.dequantize(vc, d), q_pos, torch.arange(L))
    got = attention_tiled(q, kc, vc, q_pos, L, tile=16)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), float((got - ref).abs().max())


def test_a_chunk_reads_the_cache_in_tiles_bounded_by_the_chunk():
    """The tile follows the chunk: a longer chunk reads fewer rows at a time, so one tile's
    scores stay about the same size whatever the context; and a decode token's tile is bounded
    by its rows as floats (its scores are small, a float copy of a long cache is not)."""
    tile, budget = attn.PREFILL.attention_tile, attn.PREFILL.attention_tile_bytes
    assert tile(2048, 16, 512) < tile(256, 16, 512)
    for T in (1, 64, 512, 2048, 8192):
        rows = tile(T, 16, 512)
        assert rows % 256 == 0
        assert rows * T * 16 * 4 <= max(budget, 256 * T * 16 * 4)
        assert rows * 2 * 512 * 4 <= budget
    assert tile(1, 16, 512) == budget // (2 * 512 * 4)         # qwen35moe's decode: 32,768 rows


def test_a_decode_token_reads_a_long_cache_in_tiles(monkeypatch):
    """One query over more rows than a tile (the CPU's decode over a quantized cache) reads them a
    tile at a time, with the whole-score reference's result."""
    kt = KV_TYPES["q8_0"]
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, d, L = 1, 4, 2, 64, 700
    monkeypatch.setattr(attn, "PREFILL", replace(attn.PREFILL, attention_tile_bytes=256 * 2 * Hkv * d * 4))
    q = torch.randn(B, 1, Hq, d, generator=g)
    kc, vc = (kt.quantize(torch.randn(B, L, Hkv, d, generator=g)) for _ in range(2))
    assert attn.PREFILL.attention_tile(1, Hq, Hkv * d) == 256
    seen = []
    real = kt.dequantize
    monkeypatch.setattr(type(kt), "dequantize", lambda self, rows, d: seen.append(rows.shape[1]) or real(rows, d))
    q_pos = torch.tensor([L - 1])
    got = attention_tiled(q, kc, vc, q_pos, L)
    assert max(seen) == 256
    ref = attention(q, real(kc, d), real(vc, d), q_pos, torch.arange(L))
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), float((got - ref).abs().max())


@pytest.mark.parametrize("name", ["f16", "q8_0", "q4_0"])
def test_gated_attention_writes_the_rows_of_its_kv_type(name):
    """The mixer's torch path (a prompt chunk, the CPU with a non-f32 cache) writes each new
    row as the type's quantize of the roped key and of the value, and attends what it wrote."""
    kt = KV_TYPES[name]
    g = torch.Generator().manual_seed(5)
    B, T, Hq, Hkv, d, n_ctx = 1, 6, 4, 2, 64, 32
    qg = torch.randn(B, T, Hq * 2 * d, generator=g)
    k = torch.randn(B, T, Hkv * d, generator=g)
    v = torch.randn(B, T, Hkv * d, generator=g)
    qn, kn = torch.ones(d), torch.ones(d)
    kc = torch.zeros(B, n_ctx, Hkv, kt.row_width(d), dtype=kt.storage)
    vc = torch.zeros_like(kc)
    pos = torch.arange(3, 3 + T)
    out = attn.gated_attention(qg, k, v, qn, kn, 1e-6, pos, d, 1e7, kc, vc, 3 + T)
    assert torch.equal(vc[:, 3:3 + T], kt.quantize(v.view(B, T, Hkv, d)))
    assert torch.equal(kc[:, :3], torch.zeros_like(kc[:, :3]))
    # the same through an f32 cache holding the dequantized rows
    kf = kt.dequantize(kc, d)
    vf = kt.dequantize(vc, d)
    kf32, vf32 = kf.clone(), vf.clone()
    ref = attn.gated_attention(qg, k, v, qn, kn, 1e-6, pos, d, 1e7, kf32, vf32, 3 + T)
    if name == "f16":
        assert torch.allclose(out, ref, atol=2e-3)
    # the written rows, read back, are those of the f32 cache quantized
    assert torch.equal(kc[:, 3:3 + T], kt.quantize(kf32[:, 3:3 + T]))
    assert out.shape == (B, T, Hq * d)


def test_softmax_tile_refuses_what_its_kernel_cannot_take():
    """The fused softmax update of a tile (GPU only) names what it needs in one line; on the CPU
    attention_tiled runs the torch ops instead (the tests above)."""
    from native import NativeError, ops
    s, m, l = torch.zeros(8, 16), torch.full((8, 1), float("-inf")), torch.zeros(8, 1)
    with pytest.raises(NativeError, match="float32 tensors on one CUDA device"):
        ops.softmax_tile_(s, m, l)
    assert not ops.softmax_tile_available(s)
