"""Math helpers of the model that have two forms (CPU)."""
import torch

from moe_offload.models.layers import attention, attention_fused


def test_fused_attention_equals_the_reference_with_a_partly_written_cache():
    """GPU prefill uses torch's fused attention; it must see exactly the keys the reference does:
    a chunk at positions 5..11 over a 16-row cache of which 12 rows are written (GQA 4:1)."""
    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hkv, d, L = 2, 7, 8, 2, 32, 16
    q = torch.randn(B, T, Hq, d, generator=g)
    k = torch.randn(B, L, Hkv, d, generator=g)
    v = torch.randn(B, L, Hkv, d, generator=g)
    q_pos = torch.arange(5, 5 + T)
    k_pos = torch.arange(L)
    ref = attention(q, k, v, q_pos, k_pos)
    got = attention_fused(q, k, v, q_pos, k_pos)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), float((got - ref).abs().max())
    k2 = k.clone()
    k2[:, 12:] = 1e4   # rows past the last query position are never read
    assert torch.allclose(attention_fused(q, k2, v, q_pos, k_pos), got, atol=1e-5)
