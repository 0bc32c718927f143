"""The CPU's repacked forms (native.ops.cpu_form, csrc/cpu/repack.cpp): IQ3_S -> IQ3_S_N4 keeps
every weight (dequantized bit for bit, by the kernels and by an independent numpy decoder), and
every CPU kernel gives a product with the repacked weight the original's bits, on every ISA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_oracle import rng_for
from loaders.quants import dequantize_reference, quant_type, random_tensor
from native import ops
from native.ops import QTensor

pytestmark = pytest.mark.skipif(ops._cpu is None, reason="native._cpu is not built")
IQ3_S = quant_type("IQ3_S")


def _weight(shape, rng, qtype=IQ3_S) -> QTensor:
    return QTensor(torch.from_numpy(random_tensor(qtype, shape, rng)), qtype, tuple(shape), "w")


def test_iq3s_has_a_form_with_its_geometry_and_q4k_has_none():
    form = ops.cpu_form(IQ3_S)
    assert (form.name, form.block_elems, form.block_bytes, form.family) == ("IQ3_S_N4", 256, 134, "repacked")
    assert ops.cpu_form(quant_type("Q4_K")) is None
    w = _weight((3, 256), np.random.default_rng(0), quant_type("Q4_K"))
    assert ops.repack_for_cpu(w) is w
    with pytest.raises(ValueError, match="no CPU form"):
        ops._cpu.repack(w.qtype.type_id, w.data.data_ptr(), 3, w.data.data_ptr())
    # the repacked forms stay out of the file types' lists
    assert "IQ3_S_N4" not in ops._cpu.matmul_types()


def test_repacked_weights_dequantize_to_the_files_weights(cpu_isa):
    rng = rng_for("repack-dequantize", cpu_isa, "IQ3_S")
    w = _weight((5, 768), rng)
    r = ops.repack_for_cpu(w)
    assert r.qtype.name == "IQ3_S_N4" and tuple(r.data.shape) == (5, 3 * 134)
    want = dequantize_reference(w.data.numpy(), IQ3_S, w.shape)
    assert np.array_equal(ops.dequantize_ref(r).numpy(), want)        # the numpy decoder
    out = np.empty((5, 768), np.float32)
    ops._cpu.dequantize(r.qtype.type_id, r.data.data_ptr(), 5, 768, r.row_bytes, out.ctypes.data, 0, 0)
    assert np.array_equal(out, want)                                  # the kernels' decoder


@pytest.mark.parametrize("rows,cols", [(7, 512), (64, 2048)])
def test_products_with_a_repacked_weight_have_the_original_bits(cpu_isa, rows, cols):
    rng = rng_for("repack-matmul", cpu_isa, f"{rows}x{cols}")
    w = _weight((rows, cols), rng)
    r = ops.repack_for_cpu(w)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    for nt in (1, 2, 3, 4, 5, 8, 33):   # the decode streams and the many-token paths
        x = torch.randn(nt, cols, generator=g)
        assert torch.equal(ops.matmul(x, r), ops.matmul(x, w)), (cpu_isa, nt)


def test_moe_ffn_on_repacked_banks_has_the_original_bits(cpu_isa):
    rng = rng_for("repack-moe", cpu_isa, "IQ3_S")
    E, F, H, K = 6, 256, 512, 2
    # gate and up as the two halves of a fused bank (strided views), down on its own
    gate_up = _weight((E, 2 * F, H), rng)
    gate, up = gate_up.rows(0, F), gate_up.rows(F, 2 * F)
    down = _weight((E, H, F), rng)
    packed = [ops.repack_for_cpu(q) for q in (gate, up, down)]
    assert all(q.qtype.name == "IQ3_S_N4" for q in packed)
    g = torch.Generator().manual_seed(3)
    for T in (1, 3, 40):
        x = torch.randn(T, H, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
        ids[0, 1] = -1   # a skipped slot
        wts = torch.rand(T, K, generator=g)
        want = ops.moe_ffn(x, gate, up, down, ids, wts)
        assert torch.equal(ops.moe_ffn(x, *packed, ids, wts), want), (cpu_isa, T)
