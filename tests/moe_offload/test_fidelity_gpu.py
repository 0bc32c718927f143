"""Model-level fidelity of the CUDA path (GPU): logits of tiny seeded files on CUDA against the CPU
path on its generic kernels (exact), no less faithful than ggml's int8 scheme emulated on the CPU (native.numerics), for
every quant type, as a prompt (prefill GEMMs + the experts' decode kernels) and token by token
(every matmul through the decode kernels). scripts/dev/fidelity.py prints the same as a table."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loaders import open_model
from moe_offload.models import build_model
from native.numerics import emulate

pytestmark = pytest.mark.gpu

TYPES = {n: dict(type=n) for n in ("IQ2_XXS", "IQ3_S", "IQ3_XXS", "Q2_K", "Q3_K", "Q4_K", "IQ4_XS",
                                   "Q6_K", "Q8_0", "F16")}
TYPES["mixed"] = dict(type="IQ3_S", down_type="Q4_K", output_type="Q6_K")
N_TOK = 20


def _agreement(got: torch.Tensor, ref: torch.Tensor) -> np.ndarray:
    got, ref = got.double().cpu().reshape(-1, ref.shape[-1]), ref.double().reshape(-1, ref.shape[-1])
    return np.array([float((got.argmax(-1) == ref.argmax(-1)).double().mean()),
                     float(np.corrcoef(got.flatten().numpy(), ref.flatten().numpy())[0, 1])])


def _all_q8(loaded) -> bool:
    """Every quantized weight of the model goes through the int8-activation kernels."""
    import native._cuda as ext
    accum = ext.matmul_accum()
    return all(accum.get(w.qtype.name) == "q8" for w in loaded.weights.values()
               if w.qtype.family != "float")


def _exact(model, toks):
    """The exact logits: the CPU path on its generic kernels (float activations; the avx2 and
    avx512 ones round activations to int8, ggml's scheme)."""
    from native import ops
    before = ops._cpu.isa()
    ops._cpu.set_isa("generic")
    try:
        return _logits(model, toks)
    finally:
        ops._cpu.set_isa(before)


def _logits(model, toks, decode=False):
    with torch.inference_mode():
        state = model.new_state(1, toks.shape[1] + 1)
        if decode:
            return torch.stack([model.decode(toks[:, t], state)[0] for t in range(toks.shape[1])])
        return model.prefill(toks, state, all_logits=True)[0]


@pytest.mark.parametrize("name", list(TYPES))
def test_cuda_logits_no_less_faithful_than_ggml_q8(synth_model, name):
    """A prompt (prefill GEMMs at 16 bits, experts through the decode kernels) is at least as close
    to the exact logits as ggml's scheme, averaged over seeded files; token by token the decode
    kernels are ggml's scheme itself, so their logits track its emulation (float32 sums aside)."""
    prefill, bar = [], []
    for seed in (0, 1):
        loaded = open_model(synth_model(seed=seed, **TYPES[name]))
        toks = torch.randint(0, loaded.config.n_vocab, (1, N_TOK), generator=torch.Generator().manual_seed(seed))
        cpu = build_model(loaded, "cpu")
        exact = _exact(cpu, toks)
        with emulate("ggml-q8"):
            ggml = _logits(cpu, toks)
        bar.append(_agreement(ggml, exact))
        gpu = build_model(loaded, "cuda")
        prefill.append(_agreement(_logits(gpu, toks.cuda()), exact))
        decode = _logits(gpu, toks.cuda(), decode=True)
        if _all_q8(loaded):   # the decode kernels are ggml's scheme: they track its emulation
            same = _agreement(decode, ggml)[1]
            assert same >= 0.9995, f"{name} seed {seed}: decode vs ggml's scheme corr {same:.6f}"
        else:                 # some weights accumulate in float32: at least as close as the bar
            got, want = _agreement(decode, exact), bar[-1]
            assert (got + np.array([0.0, 1e-6]) >= want).all(), (
                f"{name} seed {seed} decode: {got} vs ggml q8 {want}")
    got, bar = np.mean(prefill, 0), np.mean(bar, 0)
    # float types are exact on both sides: 1e-6 of float noise
    assert (got + np.array([0.0, 1e-6]) >= bar).all(), (
        f"{name} prefill: top-1 {got[0]:.2f} corr {got[1]:.5f} vs ggml q8 {bar[0]:.2f} / {bar[1]:.5f}")
