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

# How far a kernel output may be from the float64 reference, per accumulation kind:
#   |y - y64| <= tol * sum_i |w_i x_i|   (elementwise; the classic dot-product error bound).
# "f32": weights decoded exactly (bit-exact with gguf-py), products summed in float32 (FMA).
TOLERANCES = {"f32": 1e-5}
# Accumulation kind of each type on each engine; every CPU path today is "f32".
ACCUMULATION: dict[str, str] = {name: "f32" for name in QUANT_TYPES}
MOE_SLACK = 4.0  # moe_ffn chains three matmuls and silu: the bound is applied to the last, widened


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


def assert_close(y, y64: np.ndarray, bound: np.ndarray, kind: str, what: str, slack: float = 1.0):
    """y within TOLERANCES[kind] * bound of y64, and never NaN/inf."""
    y = np.asarray(y, dtype=np.float64)
    assert y.shape == y64.shape, f"{what}: shape {y.shape} != {y64.shape} (seed {SEED})"
    assert np.isfinite(y).all(), f"{what}: non-finite output (seed {SEED})"
    tol = TOLERANCES[kind] * slack * bound + 1e-30
    err = np.abs(y - y64)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert (err <= tol).all(), (f"{what}: |y - y64| = {err[worst]:.3g} > {tol[worst]:.3g} at {worst} "
                                f"(y {y[worst]:.6g}, ref {y64[worst]:.6g}; seed {SEED})")


def moe_reference(x, gate, up, down, ids, weights):
    """float64 routed-expert FFN with its error bound. gate/up [E, F, H], down [E, H, F] float64."""
    t, h = x.shape
    y, bound = np.zeros((t, h)), np.zeros((t, h))
    for ti in range(t):
        for e, w in zip(ids[ti], weights[ti]):
            if e < 0:
                continue
            g, u = gate[e] @ x[ti], up[e] @ x[ti]
            act = g / (1 + np.exp(-g)) * u
            y[ti] += w * (down[e] @ act)
            # errors of g/u carry into act; bound them by |gate||x| scaled like act
            act_bound = np.abs(act) + (np.abs(gate[e]) @ np.abs(x[ti])) * np.abs(u) + \
                np.abs(g) * (np.abs(up[e]) @ np.abs(x[ti]))
            bound[ti] += abs(w) * (np.abs(down[e]) @ act_bound)
    return y, bound
