"""The KV cache's value types (native/kv_cache.py): layout, arithmetic, error bounds."""
import pytest
import torch

from native.kv_cache import BLOCK, KV_TYPES, kv_type, kv_type_of


def _rows(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_row_sizes(d):
    assert KV_TYPES["f32"].row_bytes(d) == 4 * d and KV_TYPES["f16"].row_bytes(d) == 2 * d
    assert KV_TYPES["q8_0"].row_bytes(d) == d + d // 16          # 34 bytes a block, as ggml's
    assert KV_TYPES["q4_0"].row_bytes(d) == d // 2 + d // 16     # 18 bytes a block
    for name, t in KV_TYPES.items():
        rows = t.quantize(_rows(3, 2, d))
        assert rows.shape == (3, 2, t.row_width(d)) and rows.dtype == t.storage
        assert kv_type_of(rows, d) is t


def test_q8_0_block_by_hand():
    """One block: scale amax/127 stored as f16, quants round(x * 127/amax) half to even, in
    value order, the scale after the quants."""
    x = torch.arange(32, dtype=torch.float32) - 12.0     # amax 19 at the end
    row = KV_TYPES["q8_0"].quantize(x)
    s = torch.tensor(19.0) / 127.0
    q = torch.round(x * (1.0 / s)).to(torch.int8)
    assert torch.equal(row[:32].view(torch.int8), q)
    assert row[32:].view(torch.float16).item() == s.half().item()
    assert q[-1] == 127 and q[0] == torch.round(torch.tensor(-12.0) * (1.0 / s))


def test_q4_0_block_by_hand():
    """One block: m the value of largest magnitude (the first on ties), s = m / -8, quants
    min(15, floor(x/s + 8.5)) two a byte, value 2i low, 2i+1 high."""
    x = torch.zeros(32)
    x[5], x[9], x[20] = 4.0, -4.0, 1.0          # ties: the first (+4) sets the sign
    row = KV_TYPES["q4_0"].quantize(x)
    s = 4.0 / -8.0
    q = [min(15, int(torch.floor(torch.tensor(v / s + 8.5)))) for v in x.tolist()]
    nibbles = [(b & 15, b >> 4) for b in row[:16].tolist()]
    assert [n for pair in nibbles for n in pair] == q
    assert row[16:].view(torch.float16).item() == s
    back = KV_TYPES["q4_0"].dequantize(row, 32)
    assert back[5] == 4.0                                     # (0 - 8) * -0.5
    assert back[9] == pytest.approx(-3.5) and back[20] == pytest.approx(1.0)


@pytest.mark.parametrize("name,levels,steps", [("q8_0", 127, 0.5), ("q4_0", 8, 1.0)])
def test_error_is_within_a_step_of_the_block(name, levels, steps):
    """Each value comes back within half a quantization step s = amax/levels of its block (q4_0:
    a whole step, for values of the other sign than the largest: 16 clamps to 15), plus
    what the f16 scale's rounding moves the largest quant by (relative 2^-11, or 2^-25 where the
    scale is subnormal in f16); all-zero blocks stay zero; values from 1e-3 to 1e3."""
    t = KV_TYPES[name]
    for scale in (1e-3, 1.0, 1e3):
        x = _rows(64, 4, 256, seed=int(scale * 7) + 1, scale=scale)
        x[0, 0] = 0.0
        back = t.dequantize(t.quantize(x), 256)
        amax = x.view(64, 4, 256 // BLOCK, BLOCK).abs().amax(-1, keepdim=True)
        step = amax / levels
        bound = step * steps + levels * torch.clamp(step * 2.0 ** -11, min=2.0 ** -25)
        err = (back - x).view(64, 4, 256 // BLOCK, BLOCK).abs()
        assert bool((err <= bound * 1.0001).all()), float((err / bound).max())
        assert torch.equal(back[0, 0], torch.zeros(256))


def test_head_size_not_a_multiple_of_the_block_is_refused():
    with pytest.raises(ValueError, match="multiple of 32.*f16"):
        KV_TYPES["q8_0"].row_bytes(48)
    assert KV_TYPES["f16"].row_bytes(48) == 96


def test_names_and_dtypes():
    assert kv_type("q4_0") is KV_TYPES["q4_0"] and kv_type(torch.float16) is KV_TYPES["f16"]
    with pytest.raises(ValueError, match="unknown KV type 'q5_1'"):
        kv_type("q5_1")
    with pytest.raises(ValueError, match="not supported"):
        kv_type(torch.bfloat16)
