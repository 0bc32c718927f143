"""CPU emulations of the arithmetic the CUDA path and ggml's int8 kernels do, for fidelity checks.

    q8_round(x)             ggml's q8 activations: x rounded to int8 per 32 values, d = amax / 127
    emulate("ggml-q8")      context: every native.ops matmul / moe_ffn of a quantized weight on the
                            CPU with q8 activations (what llama.cpp's int8 kernels compute), on the
                            exact dequantized weights
    emulate("cuda")         context: the CUDA path's arithmetic on the CPU: decode-sized matmuls and
                            short-prompt experts as the decode kernels accumulate each type (q8 or
                            float32, native._cuda.matmul_accum), prefill GEMMs with 16-bit
                            operands as native.ops rounds them

The CPU extension's int8 kernels (ISAs avx2 and avx512: native._cpu.accumulation(type) == "q8")
compute the ggml-q8 scheme natively, with q8_round's rounding bit for bit (tests/native).

Inside a context a model built on the CPU computes what the emulated path would, up to float32
summation order: a model-level bar (ggml-q8) and a model-level prediction (cuda) CI can check
without a GPU. Slow (float64, Python loops over experts): tiny models only.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from . import ops


def _cuda_accumulation() -> dict[str, str]:
    """Type name -> "q8" | "f32" as the CUDA decode kernels accumulate (the extension's own
    table; it imports without a GPU). Without the CUDA extension: q8 for every quantized type."""
    try:
        import native._cuda as ext
        return dict(ext.matmul_accum())
    except ImportError:
        return {}


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a multiple of 32) -> float64 x_hat = d * round(x / d) per 32 values,
    d = amax / 127 in float32 (the CUDA kernels' and ggml's q8_1 rounding)."""
    g = x.detach().to(torch.float32).reshape(*x.shape[:-1], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv).double() * d.double()).reshape(x.shape)


def gemm16_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, n] -> float64 values of the 16-bit GEMM operand native.ops makes of it."""
    if dtype == torch.float16:
        x16, scale = ops.rows_to_f16_ref(x.to(torch.float32))
        return x16.double() * scale.double()[:, None]
    return x.to(dtype).double()


class _Emulation:
    def __init__(self, scheme: str):
        if scheme not in ("ggml-q8", "cuda"):
            raise ValueError(f"unknown scheme {scheme!r}: ggml-q8 or cuda")
        self.scheme = scheme
        self.accum = _cuda_accumulation() if scheme == "cuda" else {}

    def _q8(self, w: ops.QTensor) -> bool:
        """Whether the emulated int8 kernels round x for this weight (else float32, ~exact)."""
        if w.qtype.family == "float":
            return False
        return self.accum.get(w.qtype.name, "q8") == "q8"

    def _w(self, w: ops.QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """w dequantized (float64), rounded to `dtype` first if given; kept while w.data lives."""
        held = _DEQUANTIZED.get(id(w.data))
        if held is None or held[0]() is not w.data:        # new, or an id reused after a free
            held = _DEQUANTIZED[id(w.data)] = (weakref.ref(w.data), {})
            weakref.finalize(w.data, _DEQUANTIZED.pop, id(w.data), None)
        per_data = held[1]
        key = (tuple(w.shape), w.qtype.name, dtype)
        if key not in per_data:
            full = per_data.get(key[:2] + (None,))
            if full is None:
                full = per_data[key[:2] + (None,)] = ops.dequantize_ref(w).double()
            per_data[key] = full if dtype is None else full.to(dtype).double()
        return per_data[key]

    def _x(self, x: torch.Tensor, gemm_dtype: torch.dtype | None, q8: bool) -> torch.Tensor:
        """The activations as the emulated kernel sees them: a 16-bit GEMM operand, else int8
        per 32 values (q8) or float32."""
        if gemm_dtype is not None:
            return gemm16_round(x, gemm_dtype)
        return q8_round(x) if q8 else x.to(torch.float32).double()

    def matmul(self, x: torch.Tensor, w: ops.QTensor) -> torch.Tensor:
        if w.qtype.family == "float":
            return self.saved_matmul(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        prefill = self.scheme == "cuda" and x2.shape[0] > ops.DECODE_MAX_TOKENS
        dt = ops.PREFILL_DTYPE if prefill else None
        if dt == torch.float32:
            return self.saved_matmul(x, w)
        y = self._x(x2, dt, self._q8(w)) @ self._w(w, dt).T
        return y.to(torch.float32).reshape(*x.shape[:-1], w.shape[0])

    def moe_ffn(self, x, gate, up, down, ids, weights, out=None):
        t = x.shape[0]
        dt = ops.PREFILL_MOE_DTYPE if (self.scheme == "cuda" and t > ops.PREFILL_MOE_MIN_TOKENS) else None
        G, U, D = self._w(gate, dt), self._w(up, dt), self._w(down, dt)
        xq = self._x(x, dt, self._q8(gate))
        y = torch.zeros(x.shape, dtype=torch.float64)
        for e in torch.unique(ids).tolist():
            if not 0 <= e < G.shape[0]:
                continue
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            a = torch.nn.functional.silu((xq[tok] @ G[e].T).float()) * (xq[tok] @ U[e].T).float()
            part = self._x(a, dt, self._q8(down)) @ D[e].T
            y.index_add_(0, tok, part * weights[tok, slot].double()[:, None])
        y = y.to(torch.float32)
        return y if out is None else out.copy_(y)


# Dequantized weights by the tensor holding their blocks (dropped with it): contexts reuse them.
# Keyed by id, not by the tensor: a tensor's == is elementwise, which a dict key cannot use.
_DEQUANTIZED: dict[int, tuple[weakref.ref, dict]] = {}


@contextlib.contextmanager
def emulate(scheme: str):
    """native.ops.matmul / matmul_many / moe_ffn replaced by the emulation of `scheme` (see the
    module doc); matmul_many as one emulated matmul per weight."""
    em = _Emulation(scheme)
    em.saved_matmul, saved_many, saved_moe = ops.matmul, ops.matmul_many, ops.moe_ffn
    ops.matmul, ops.moe_ffn = em.matmul, em.moe_ffn
    ops.matmul_many = lambda x, ws: [em.matmul(x, w) for w in ws]
    try:
        yield em
    finally:
        ops.matmul, ops.matmul_many, ops.moe_ffn = em.saved_matmul, saved_many, saved_moe
