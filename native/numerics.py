"""CPU emulations of the arithmetic of our CPU and CUDA paths and of ggml's, for fidelity checks.

    q8_round(x)             int8 per 32 values, d = amax / 127 kept in float32: what our int8 CPU
                            kernels and CUDA decode kernels multiply
    q16_round(x)            int16 per 32 values, d = amax / 32767: what our CPU kernels of the
                            32-weight block types multiply (native._cpu.accumulation == "q16")
    ggml_cpu_round(x, t)    x as ggml's CPU kernels multiply it against a weight of type t: each
                            weight type has its own activation type there (GGML_CPU_ACTIVATION)
    emulate("ggml-cpu")     context: every native.ops matmul / moe_ffn as llama.cpp's CPU build
                            computes it (ggml_cpu_round per weight type), on the exact weights
    emulate("ggml-q8")      context: every matmul of a quantized weight with q8_round activations
    emulate("cpu")          context: our CPU kernels' arithmetic (the best ISA's), each weight type
                            by its native._cpu.accumulation (q8_round, q16_round or float32)
    emulate("cuda")         context: the CUDA path's arithmetic on the CPU: decode-sized matmuls and
                            short-prompt experts as the decode kernels accumulate each type (q8 or
                            float32, native._cuda.matmul_accum), prefill GEMMs with 16-bit
                            operands as native.ops rounds them

The CPU extension's integer kernels (ISAs avx2 and avx512) compute the "cpu" scheme natively, with
q8_round's and q16_round's rounding bit for bit (tests/native). Per matmul and per tiny model it
is held to be no less faithful than "ggml-cpu" (tests/native/test_fidelity.py).

Inside a context a model built on the CPU computes what the emulated path would, up to float32
summation order: model-level bars (ggml-cpu for the CPU path, ggml-q8 for the CUDA path) and
predictions (cpu, cuda) CI can check without a GPU. Slow (float64, Python loops over experts):
tiny models only.
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


def _round_per_32(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """x [..., n] (n a multiple of 32) -> float64 d * round(x / d) per 32 values,
    d = amax / qmax in float32."""
    g = x.detach().to(torch.float32).reshape(*x.shape[:-1], -1, 32)
    d = g.abs().amax(-1, keepdim=True) / qmax
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv).double() * d.double()).reshape(x.shape)


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a multiple of 32) -> float64 x_hat = d * round(x / d) per 32 values,
    d = amax / 127 in float32 (the CUDA kernels' and ggml's q8_1 rounding)."""
    return _round_per_32(x, 127.0)


# ggml-cpu's vec_dot_type per weight type (type_traits_cpu in ggml-cpu.c): the activation type
# a weight's dot product takes. q8_0: int8 per 32, scale stored as f16; q8_1: the same plus an
# f16 sum for the types with an additive min; q8_K: int8 per 256, float scale.
GGML_CPU_ACTIVATION: dict[str, str] = {
    "F32": "f32", "F16": "f16", "BF16": "bf16",
    "Q4_0": "q8_0", "Q5_0": "q8_0", "Q8_0": "q8_0", "IQ4_NL": "q8_0", "MXFP4": "q8_0",
    "Q4_1": "q8_1", "Q5_1": "q8_1",
    **{n: "q8_K" for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS",
                           "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "TQ1_0", "TQ2_0")},
    "IQ3_S_N4": "q8_K",   # our CPU's repacked IQ3_S: ggml multiplies the file's IQ3_S
}


def q8_0_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's x86 quantize_row_q8_0 / q8_1 on x [..., n]: (q [..., n/32, 32] float32 integers,
    d [..., n/32, 1] float32 before its f16 store, d16 the f16 scale as float32)."""
    g = x.detach().to(torch.float32).reshape(*x.shape[:-1], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    q = torch.round(g * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return q, d, d.to(torch.float16).to(torch.float32)


def q8_K_round(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_K: per 256 values, the value of largest magnitude m maps to -127
    (iscale = -127 / m, q = min(127, round(iscale * x)), d = 1 / iscale); float64 d * q."""
    g = x.detach().to(torch.float32).reshape(*x.shape[:-1], -1, 256)
    m = torch.gather(g, -1, g.abs().argmax(-1, keepdim=True))
    iscale = torch.where(m != 0, -127.0 / m, torch.zeros_like(m))
    q = torch.clamp(torch.round(iscale * g), max=127.0)
    d = torch.where(m != 0, 1.0 / iscale, torch.zeros_like(m))
    return (q.double() * d.double()).reshape(x.shape)


def ggml_cpu_round(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """x [..., n] -> float64 activations as ggml's CPU dot product for weight type `qtype` sees
    them. For q8_1 this is the int8 values only; its f16 sum term is in ggml_cpu_matmul."""
    kind = GGML_CPU_ACTIVATION[qtype]
    if kind == "f32":
        return x.to(torch.float32).double()
    if kind in ("f16", "bf16"):
        return x.to(torch.float32).to(torch.float16 if kind == "f16" else torch.bfloat16).double()
    if kind == "q8_K":
        return q8_K_round(x)
    q, _, d16 = q8_0_parts(x)
    return (q.double() * d16.double()).reshape(x.shape)


def _legacy_mins(w: "ops.QTensor") -> torch.Tensor:
    """The f16 additive min of every 32-weight block of a Q4_1 / Q5_1 weight: [..., n/32]."""
    raw = w.data.cpu().reshape(-1, w.qtype.block_bytes)[:, w.qtype.m_offset:w.qtype.m_offset + 2]
    return raw.contiguous().view(torch.float16).float().reshape(*w.shape[:-1], -1)


def ggml_cpu_matmul(x: torch.Tensor, w64: torch.Tensor, qtype: str,
                    mins: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, n] @ w64.T as ggml's CPU computes it (float64, exact integer sums): x rounded by
    ggml_cpu_round; for q8_1 types the block mins (`mins` [O, n/32]) multiply ggml's f16 sums
    f16(d * sum q) instead of the sums of the rounded values."""
    if GGML_CPU_ACTIVATION[qtype] != "q8_1":
        return ggml_cpu_round(x, qtype) @ w64.T
    q, d, d16 = q8_0_parts(x)
    s16 = (d * q.sum(-1, keepdim=True)).to(torch.float16).double().squeeze(-1)    # [T, n/32]
    m = mins.double()
    scaled = w64 - m.repeat_interleave(32, -1)                                    # d * q_w
    return (q.double() * d16.double()).reshape(x.shape) @ scaled.T + s16 @ m.T


def q16_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a multiple of 32) -> float64 d * round(x / d) per 32 values, d = amax / 32767
    in float32 (the CPU's int16 activations)."""
    return _round_per_32(x, 32767.0)


def _cpu_accumulation() -> dict[str, str]:
    """Type name -> "q8" | "q16" | "f32" as the kernels of the best CPU ISA this machine has
    multiply each type (the generic ISA's are float32 throughout)."""
    if ops._cpu is None:
        return {}
    from loaders.quants import QUANT_TYPES
    before = ops._cpu.isa()
    ops._cpu.set_isa(ops._cpu.available_isas()[-1])
    try:
        return {n: ops._cpu.accumulation(n) for n in [*QUANT_TYPES, "IQ3_S_N4"]}
    finally:
        ops._cpu.set_isa(before)


def gemm16_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, n] -> float64 values of the 16-bit GEMM operand native.ops makes of it."""
    if dtype == torch.float16:
        x16, scale = ops.rows_to_f16_ref(x.to(torch.float32))
        return x16.double() * scale.double()[:, None]
    return x.to(dtype).double()


class _Emulation:
    def __init__(self, scheme: str):
        if scheme not in ("cpu", "ggml-cpu", "ggml-q8", "cuda"):
            raise ValueError(f"unknown scheme {scheme!r}: cpu, ggml-cpu, ggml-q8 or cuda")
        self.scheme = scheme
        self.accum = {"cuda": _cuda_accumulation, "cpu": _cpu_accumulation}.get(scheme, dict)()

    def _kind(self, w: ops.QTensor) -> str:
        """How the emulated integer kernels round x for this weight: "q8", "q16" or "f32"
        (float32, ~exact)."""
        if w.qtype.family == "float":
            return "f32"
        return self.accum.get(w.qtype.name, "q8")

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

    def _x(self, x: torch.Tensor, gemm_dtype: torch.dtype | None, kind: str) -> torch.Tensor:
        """The activations as the emulated kernel sees them: a 16-bit GEMM operand, else int8 or
        int16 per 32 values (kind q8 / q16) or float32."""
        if gemm_dtype is not None:
            return gemm16_round(x, gemm_dtype)
        if kind == "q8":
            return q8_round(x)
        return q16_round(x) if kind == "q16" else x.to(torch.float32).double()

    def _ggml(self, x: torch.Tensor, w: ops.QTensor, w64: torch.Tensor) -> torch.Tensor:
        mins = _legacy_mins(w) if GGML_CPU_ACTIVATION[w.qtype.name] == "q8_1" else None
        return ggml_cpu_matmul(x, w64, w.qtype.name, mins)

    def matmul(self, x: torch.Tensor, w: ops.QTensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.scheme == "ggml-cpu":
            if w.qtype.name == "F32":
                return self.saved_matmul(x, w)
            y = self._ggml(x2, w, self._w(w))
            return y.to(torch.float32).reshape(*x.shape[:-1], w.shape[0])
        if w.qtype.family == "float":
            return self.saved_matmul(x, w)
        prefill = self.scheme == "cuda" and x2.shape[0] > ops.DECODE_MAX_TOKENS
        dt = ops.PREFILL_DTYPE if prefill else None
        if dt == torch.float32:
            return self.saved_matmul(x, w)
        y = self._x(x2, dt, self._kind(w)) @ self._w(w, dt).T
        return y.to(torch.float32).reshape(*x.shape[:-1], w.shape[0])

    def moe_ffn(self, x, gate, up, down, ids, weights, out=None):
        t = x.shape[0]
        dt = ops.PREFILL_MOE_DTYPE if (self.scheme == "cuda" and t > ops.PREFILL_MOE_MIN_TOKENS) else None
        G, U, D = self._w(gate, dt), self._w(up, dt), self._w(down, dt)
        mins = {id(w): _legacy_mins(w) for w in (gate, up, down)
                if self.scheme == "ggml-cpu" and GGML_CPU_ACTIVATION[w.qtype.name] == "q8_1"}

        def mm(a, w, w64, e):   # rows of one expert (the rounding is per row)
            if self.scheme == "ggml-cpu":
                m = mins.get(id(w))
                return ggml_cpu_matmul(a, w64[e], w.qtype.name, None if m is None else m[e])
            return self._x(a, dt, self._kind(w)) @ w64[e].T

        y = torch.zeros(x.shape, dtype=torch.float64)
        for e in torch.unique(ids).tolist():
            if not 0 <= e < G.shape[0]:
                continue
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            a = torch.nn.functional.silu(mm(x[tok], gate, G, e).float()) * mm(x[tok], up, U, e).float()
            part = mm(a, down, D, e)
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
