"""What the kernel tests share: fresh seeds, random weights, float64 references, tolerances.

Seeds are fresh each run (set FTPATCH_TEST_SEED to replay one); every failure message names it.
"""
from __future__ import annotations

import os
import secrets
import zlib

import numpy as np

from loaders.quants import QUANT_TYPES, QuantType, dequantize_reference, random_tensor

SEED = int(os.environ.get("FTPATCH_TEST_SEED", secrets.randbits(32)))

# How far a kernel output may be from the float64 reference, per accumulation kind (the extension
# reports each type's kind: native._cpu.accumulation(name)); elementwise, for y = W x:
#   |y - y64| <= a * sum_j |w_j x_j|  +  b * sum_blocks max|x_blk| * sum_{j in blk} |w_j|
# "f32": exact weights times float x, float32 sums: the dot-product rounding term only.
# "q8":  exact weights times x rounded to int8 per 32 features (numerics.q8_round), exact integer
#        sums. The reference multiplies the same rounded x (`kernel_input`), so only float32
#        rounding remains (a); b bounds a kernel input that is itself computed (moe_ffn's hidden
#        activations): one rounding step of 1/127 of the block's max, which covers values that
#        round the other way.
# "q16": the same with int16 per 32 features (numerics.q16_round): one step is 1/32767 of the max.
TOLERANCES = {"f32": (1e-5, 0.0), "q8": (1e-5, 1 / 127), "q16": (1e-5, 1 / 32767)}
MOE_SLACK = 2.0  # moe_ffn chains three matmuls and silu: the propagated bound, widened


def rng_for(*keys) -> np.random.Generator:
    return np.random.default_rng([SEED, *(zlib.crc32(str(k).encode()) for k in keys)])


def kernel_cols(q: QuantType, blocks: int) -> int:
    """A row of `blocks` kernel blocks (float types address 32 elements at a time)."""
    return blocks * max(32, q.block_elems)


def random_weight(q: QuantType, shape, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks uint8 [rows, row_bytes], the same weights dequantized, float64 of `shape`)."""
    raw = random_tensor(q, shape, rng)
    return raw, dequantize_reference(raw, q, shape).astype(np.float64)


def poisoned(shape, dtype=np.float32) -> np.ndarray:
    return np.full(shape, np.nan, dtype)


def dot_bound(kind: str, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The tolerance of y = x @ w.T (w [O, n], x [T, n] float64) for one accumulation kind."""
    a, b = TOLERANCES[kind]
    bound = a * (np.abs(x) @ np.abs(w).T)
    if b:
        n = w.shape[-1]
        amax = np.abs(x).reshape(-1, n // 32, 32).max(-1)                # [T, n/32]
        wsum = np.abs(w).reshape(w.shape[0], n // 32, 32).sum(-1)      # [O, n/32]
        bound += b * (amax @ wsum.T)
    return bound


def kernel_input(kind: str, x: np.ndarray) -> np.ndarray:
    """x [T, n] as the kernel of accumulation `kind` multiplies it (float64)."""
    if kind not in ("q8", "q16"):
        return x
    import torch
    from native.numerics import q8_round, q16_round
    rnd = q8_round if kind == "q8" else q16_round
    return rnd(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()


def matmul_reference(kind: str, w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y64, bound) of y = x @ w.T for a kernel of accumulation `kind` (w, x float64)."""
    xk = kernel_input(kind, x)
    return xk @ w.T, dot_bound("f32", w, xk)


def assert_close(y, y64: np.ndarray, bound: np.ndarray, what: str):
    """y within `bound` of y64 elementwise, and never NaN/inf."""
    y = np.asarray(y, dtype=np.float64)
    assert y.shape == y64.shape, f"{what}: shape {y.shape} != {y64.shape} (seed {SEED})"
    assert np.isfinite(y).all(), f"{what}: non-finite output (seed {SEED})"
    tol = bound + 1e-30
    err = np.abs(y - y64)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert (err <= tol).all(), (f"{what}: |y - y64| = {err[worst]:.3g} > {tol[worst]:.3g} at {worst} "
                                f"(y {y[worst]:.6g}, ref {y64[worst]:.6g}; seed {SEED})")


def moe_reference(x, gate, up, down, ids, weights, kinds):
    """float64 routed-expert FFN and its tolerance. gate/up [E, F, H], down [E, H, F] float64;
    kinds = accumulation kinds of (gate, up, down). Bounds propagate through silu(g) * u."""
    t, h = x.shape
    y, bound = np.zeros((t, h)), np.zeros((t, h))
    xg, xu = kernel_input(kinds[0], x), kernel_input(kinds[1], x)
    for ti in range(t):
        for e, w in zip(ids[ti], weights[ti]):
            if e < 0:
                continue
            g, u = (gate[e] @ xg[ti]), (up[e] @ xu[ti])
            eg, eu = dot_bound("f32", gate[e], xg[ti:ti + 1])[0], dot_bound("f32", up[e], xu[ti:ti + 1])[0]
            act = g / (1 + np.exp(-g)) * u
            act_err = 1.1 * eg * (np.abs(u) + eu) + np.abs(g) * eu  # |silu'| <= 1.1, |silu(g)| <= |g|
            y[ti] += w * (down[e] @ kernel_input(kinds[2], act[None])[0])
            act_hi = (np.abs(act) + act_err)[None]
            bound[ti] += abs(w) * (dot_bound(kinds[2], down[e], act_hi)[0] + np.abs(down[e]) @ act_err)
    return y, MOE_SLACK * bound
