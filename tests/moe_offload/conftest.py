"""Fixtures of the runtime tests: the HF oracle's directory on the path, and reference kernels
that dequantize each named weight once (same math, so decode loops stay fast in CI)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import hf_oracle`

_DEQUANT_CACHE: dict = {}
_CACHE_LIMIT = 512 << 20  # bytes of dequantized weights kept across tests


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: one intra-op thread is fastest, and immune to a busy machine (OpenMP
    workers spinning on shared cores made decode steps 10x slower)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def reference_kernels(monkeypatch):
    """Force native.ops onto its reference path (gguf-py dequantize + torch float32 matmul) and
    memoize the dequantized weights. Keeps the model's math apart from kernel rounding."""
    from native import ops
    orig = ops.dequantize_ref

    def dequantize_once(w):
        if not w.name:  # transient (e.g. gathered embedding rows): never cache
            return orig(w)
        key = (w.name, w.data.data_ptr(), str(w.device), w.shape)
        hit = _DEQUANT_CACHE.get(key)
        if hit is None:  # keep w.data alive so its address cannot be reused by another tensor
            if sum(t.numel() * 4 for _, t in _DEQUANT_CACHE.values()) > _CACHE_LIMIT:
                _DEQUANT_CACHE.clear()
            hit = _DEQUANT_CACHE[key] = (w.data, orig(w))
        return hit[1]

    monkeypatch.setattr(ops, "dequantize_ref", dequantize_once)
    monkeypatch.setattr(ops, "_cpu", None, raising=False)
    monkeypatch.setattr(ops, "_cuda", None, raising=False)
