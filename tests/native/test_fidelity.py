"""Fidelity of the CUDA path's arithmetic against ggml's int8 scheme, checked on the CPU.

The CUDA decode kernels round activations to int8 per 32 values exactly as ggml's q8_1 kernels do
(tests/native/test_cuda_kernels.py holds them to that rounding on a GPU). Prefill GEMMs instead
round both operands to 16 bits (native.ops.PREFILL_DTYPE); these tests hold that choice to the
bar "no less faithful than ggml's scheme", per matmul and for whole tiny models, through the CPU
emulations of native.numerics. tests/moe_offload/test_fidelity_gpu.py checks the real GPU path.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_oracle import SEED, rng_for
from loaders.quants import QUANT_TYPES, dequantize_reference, quant_type, random_tensor
from native import ops
from native.numerics import emulate, gemm16_round, q8_round

QUANTIZED = [n for n, q in QUANT_TYPES.items() if q.family != "float"]
DRAWS = 8   # (W, x) pairs a fidelity comparison sums its errors over


def test_rows_to_f16_reference_scales_only_rows_that_would_overflow():
    x = torch.tensor([[1.5, -3.0, 0.0, 2.0 ** -20],        # small: unscaled
                      [32767.0, -1.0, 5.0, 7.0],           # just under 2^15: unscaled
                      [32768.0, 1.0, -2.0, 3.0],           # 2^15: one halving
                      [-1e6, 1.0, 0.5, 1e5],               # 2^19.9: 2^-5
                      [0.0, 0.0, 0.0, 0.0]])
    x16, scale = ops.rows_to_f16_ref(x)
    assert x16.dtype == torch.float16 and scale.dtype == torch.float32
    assert scale.tolist() == [1.0, 1.0, 2.0, 32.0, 1.0]
    assert torch.isfinite(x16.float()).all()
    assert x16.float().abs().amax(-1).max() <= 32768        # a value just under 2^15 may round up to it
    back = x16.double() * scale.double()[:, None]
    assert torch.allclose(back, x.double(), rtol=2.0 ** -11, atol=0)   # f16 rounding only
    assert torch.equal(x16[:2], x[:2].to(torch.float16))               # no scale: a plain cast


def _activations(rng: np.random.Generator, t: int, h: int, kind: str) -> np.ndarray:
    x = rng.standard_normal((t, h))
    if kind == "range":   # features of very different sizes and a few outliers, as in real models
        x *= np.exp(1.5 * rng.standard_normal((1, h)))
        x[rng.random((t, h)) < 0.002] *= 200.0
    if kind == "huge":    # beyond f16's range: the row scale must keep it finite and exact
        x *= 3e5
    return x.astype(np.float32)


def _rms_rel(err: torch.Tensor, ref: torch.Tensor) -> float:
    return float(err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


@pytest.mark.parametrize("kind", ["gauss", "range", "huge"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_prefill_operands_no_less_faithful_than_ggml_q8(name, kind):
    """y = x W^T with the prefill GEMM's 16-bit operands vs ggml's q8 activations, both against
    the exact product of the same weights: over DRAWS independent draws of (W, x), the 16-bit
    error must not exceed the q8 error. One draw alone can lose: W rounded to f16 keeps only
    absolute precision below f16's smallest normal (6e-5), and a rare outlier activation
    (~1.5e5 in "range") multiplies that into one row's error (Q4_K: about 1 draw in 2,000)."""
    q = quant_type(name)
    rng = rng_for("prefill-vs-q8", name, kind)
    o, h, t = 96, 8 * max(32, q.block_elems), 12
    err_q8, err16, norm = 0.0, 0.0, 0.0
    for _ in range(DRAWS):
        w = torch.from_numpy(dequantize_reference(random_tensor(q, (o, h), rng), q, (o, h)).astype(np.float64))
        x = torch.from_numpy(_activations(rng, t, h, kind))
        ref = x.double() @ w.T
        y16 = gemm16_round(x, ops.PREFILL_DTYPE) @ w.to(ops.PREFILL_DTYPE).double().T
        assert torch.isfinite(y16).all(), f"{name} {kind}: the 16-bit GEMM overflowed (seed {SEED})"
        err_q8 += float((q8_round(x) @ w.T - ref).pow(2).sum())
        err16 += float((y16 - ref).pow(2).sum())
        norm += float(ref.pow(2).sum())
    err_q8, err16 = (err_q8 / norm) ** 0.5, (err16 / norm) ** 0.5
    assert err16 <= err_q8, f"{name} {kind}: 16-bit error {err16:.3g} > q8 error {err_q8:.3g} (seed {SEED})"


def _tiny_logits(path, n_tok: int, seed: int, scheme: str | None, isa: str = "generic"):
    """All logits of a seeded prompt on the CPU: under the emulation `scheme`, or (None) the
    native kernels of `isa` -- "generic" is the exact path (float activations)."""
    from loaders import open_model
    from moe_offload.models import build_model
    loaded = open_model(path)
    toks = torch.randint(0, loaded.config.n_vocab, (1, n_tok), generator=torch.Generator().manual_seed(seed))
    model = build_model(loaded, "cpu")
    before = ops._cpu.isa()
    ops._cpu.set_isa(isa)
    try:
        with torch.inference_mode(), (emulate(scheme) if scheme else torch.inference_mode()):
            return model.prefill(toks, model.new_state(1, n_tok + 1), all_logits=True)[0].double()
    finally:
        ops._cpu.set_isa(before)


def _agreement(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    top1 = float((got.argmax(-1) == ref.argmax(-1)).double().mean())
    corr = float(np.corrcoef(got.flatten().numpy(), ref.flatten().numpy())[0, 1])
    return top1, corr


MODEL_TYPES = {"IQ3_S": {}, "IQ4_XS": {}, "Q4_K": {}, "Q6_K": {}, "Q8_0": {}, "Q3_K": {},
               "mixed": dict(type="IQ3_S", down_type="Q4_K", output_type="Q6_K")}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODEL_TYPES))
def test_cuda_arithmetic_no_less_faithful_than_ggml_q8_on_a_model(synth_model, name):
    """Logits of tiny models (16-token prompts: dense GEMMs at 16 bits, experts through the q8
    kernels) under the emulated CUDA arithmetic vs under ggml's q8 everywhere, both against the
    exact CPU path, averaged over seeded files: top-1 agreement and correlation no lower."""
    kw = MODEL_TYPES[name] or dict(type=name)
    ours, bar = [], []
    for seed in (0, 1):
        path = synth_model(seed=seed, **kw)
        exact = _tiny_logits(path, 16, seed, None)
        ours.append(_agreement(_tiny_logits(path, 16, seed, "cuda"), exact))
        bar.append(_agreement(_tiny_logits(path, 16, seed, "ggml-q8"), exact))
    (t_ours, c_ours), (t_bar, c_bar) = np.mean(ours, 0), np.mean(bar, 0)
    assert t_ours >= t_bar and c_ours >= c_bar, (
        f"{name}: emulated CUDA top-1 {t_ours:.2f} / corr {c_ours:.5f} vs ggml q8 {t_bar:.2f} / {c_bar:.5f}")


def _int8_isas() -> list[str]:
    return [i for i in (ops._cpu.available_isas() if ops._cpu is not None else []) if i != "generic"]


@pytest.mark.slow
@pytest.mark.parametrize("isa", _int8_isas() or [pytest.param("none", marks=pytest.mark.skip("no int8 CPU ISA"))])
@pytest.mark.parametrize("name", ["IQ3_S", "Q4_K", "mixed"])
def test_cpu_int8_kernels_are_ggml_q8_on_a_model(synth_model, name, isa):
    """The CPU's int8 kernels compute ggml's q8 scheme, so a tiny model's logits meet the fidelity
    bar: they are closer to the q8 emulation than the emulation is to the exact path (what is
    left are ties of the int8 rounding that float32 summation order sends the other way, which a
    random tiny model amplifies: up to 0.55 of the emulation's distance, measured), and their
    agreement with the exact path is the bar's."""
    kw = MODEL_TYPES[name] or dict(type=name)
    ours, bar = [], []
    for seed in (0, 1):
        path = synth_model(seed=seed, **kw)
        exact = _tiny_logits(path, 16, seed, None)
        native = _tiny_logits(path, 16, seed, None, isa)
        q8 = _tiny_logits(path, 16, seed, "ggml-q8")
        d_native, d_bar = _rms_rel(native - q8, q8), _rms_rel(q8 - exact, exact)
        assert d_native < d_bar, f"{name} on {isa}: native vs q8 {d_native:.3g}, q8 vs exact {d_bar:.3g}"
        ours.append(_agreement(native, exact))
        bar.append(_agreement(q8, exact))
    (t_ours, c_ours), (t_bar, c_bar) = np.mean(ours, 0), np.mean(bar, 0)
    assert t_ours >= t_bar - 1 / 16 and c_ours >= c_bar - 1e-3, (
        f"{name} on {isa}: native top-1 {t_ours:.2f} / corr {c_ours:.5f} vs ggml q8 {t_bar:.2f} / {c_bar:.5f}")
