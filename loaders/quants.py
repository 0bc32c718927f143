"""The one table of ggml weight types, the bit-exact reference dequantizer, random valid blocks.

Everything else in the project that needs to know a type's block geometry asks this module.
The reference dequantizer is gguf-py's (measured bit-identical with ggml's C decoders, see
ggml's own code); our own decoders (torch, C++, CUDA) are tested against it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import GGUFError

try:  # gguf-py is a runtime dependency; keep the import local to this module
    import gguf
    from gguf import GGMLQuantizationType as _G
    from gguf import quants as _gq
except ImportError as exc:  # pragma: no cover - dependency missing is an install error
    raise ImportError("ftpatch needs the 'gguf' package: pip install gguf") from exc


@dataclass(frozen=True)
class QuantType:
    """Geometry of one ggml type: `block_elems` weights are stored in `block_bytes` bytes."""

    name: str          # ggml's name, e.g. "IQ3_S"
    type_id: int       # ggml_type enum value as stored in GGUF
    block_elems: int
    block_bytes: int
    family: str        # float | legacy | k | i | ternary | fp4 | repacked (native.ops.cpu_form)
    # Where the fp16 block scale(s) live, for making random valid blocks; None where absent.
    d_offset: int | None = None
    m_offset: int | None = None   # second fp16 scale: `m` (Q4_1/Q5_1) or `dmin` (K types)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_elems

    def row_bytes(self, n_elems: int) -> int:
        """Bytes of one row of `n_elems` weights; the row must hold whole blocks."""
        if n_elems % self.block_elems:
            raise GGUFError(f"a {self.name} row of {n_elems} weights is not a whole number of "
                            f"{self.block_elems}-weight blocks")
        return n_elems // self.block_elems * self.block_bytes

    def nbytes(self, shape: Sequence[int]) -> int:
        """Bytes of a tensor of logical `shape` (torch order, last dim contiguous)."""
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        return rows * self.row_bytes(int(shape[-1]))


def _q(name: str, family: str, d: int | None = None, m: int | None = None) -> QuantType:
    gt = _G[name]
    elems, nbytes = gguf.GGML_QUANT_SIZES[gt]
    return QuantType(name, int(gt), elems, nbytes, family, d, m)


# Every weight type of gguf 0.19 that published GGUFs use. Block sizes come from gguf-py;
# scale offsets are from the block layouts (native/csrc/quants.h declares each).
QUANT_TYPES: dict[str, QuantType] = {q.name: q for q in [
    _q("F32", "float"), _q("F16", "float"), _q("BF16", "float"),
    _q("Q4_0", "legacy", d=0), _q("Q4_1", "legacy", d=0, m=2),
    _q("Q5_0", "legacy", d=0), _q("Q5_1", "legacy", d=0, m=2), _q("Q8_0", "legacy", d=0),
    _q("Q2_K", "k", d=80, m=82), _q("Q3_K", "k", d=108), _q("Q4_K", "k", d=0, m=2),
    _q("Q5_K", "k", d=0, m=2), _q("Q6_K", "k", d=208),
    _q("IQ1_S", "i", d=0), _q("IQ1_M", "i"),  # IQ1_M scatters its fp16 scale, see below
    _q("IQ2_XXS", "i", d=0), _q("IQ2_XS", "i", d=0), _q("IQ2_S", "i", d=0),
    _q("IQ3_XXS", "i", d=0), _q("IQ3_S", "i", d=0),
    _q("IQ4_NL", "i", d=0), _q("IQ4_XS", "i", d=0),
    _q("TQ1_0", "ternary", d=52), _q("TQ2_0", "ternary", d=64),
    _q("MXFP4", "fp4"),  # E8M0 exponent byte at offset 0
]}
_BY_ID: dict[int, QuantType] = {q.type_id: q for q in QUANT_TYPES.values()}


def quant_type(qtype: str | int | QuantType) -> QuantType:
    """Look a type up by ggml name or id; unknown ones fail listing what exists."""
    if isinstance(qtype, QuantType):
        return qtype
    q = _BY_ID.get(qtype) if isinstance(qtype, int) else QUANT_TYPES.get(str(qtype).upper())
    if q is None:
        raise GGUFError(f"unsupported ggml type {qtype!r}; supported: {', '.join(QUANT_TYPES)}")
    return q


def ggml_type_name(type_id: int) -> str | None:
    """ggml's name for a type id gguf-py knows (also non-weight types like I32), else None."""
    try:
        return _G(type_id).name
    except ValueError:
        return None


def ggml_type_sizes(type_id: int) -> tuple[int, int] | None:
    """(block elems, block bytes) for any type id gguf-py knows, else None."""
    try:
        return gguf.GGML_QUANT_SIZES[_G(type_id)]
    except (ValueError, KeyError):
        return None


# ---------------------------------------------------------------------------------------------
# Reference dequantizer
# ---------------------------------------------------------------------------------------------

def dequantize_reference(data: np.ndarray, qtype: str | int | QuantType,
                         shape: Sequence[int] | None = None) -> np.ndarray:
    """Raw blocks -> float32 of logical `shape` (torch order), bit-exact with ggml via gguf-py.

    `data` is a uint8 array holding whole rows of blocks (any shape; it is flattened).
    Without `shape`, the result is 1-D.
    """
    q = quant_type(qtype)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.size % q.block_bytes:
        raise GGUFError(f"{raw.size} bytes is not a whole number of {q.name} blocks "
                        f"({q.block_bytes} bytes each)")
    n = raw.size // q.block_bytes * q.block_elems
    if shape is None:
        shape = (n,)
    if int(np.prod(shape)) != n:
        raise GGUFError(f"{raw.size} bytes of {q.name} hold {n} weights, not shape {tuple(shape)}")
    if q.name == "F32":
        return raw.view(np.float32).reshape(shape).copy()
    rows = raw.reshape(-1, q.row_bytes(int(shape[-1])))
    out = _gq.dequantize(rows, _G(q.type_id))
    return np.asarray(out, dtype=np.float32).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Random valid blocks (tests and synthetic models)
# ---------------------------------------------------------------------------------------------

def _put_f16(raw: np.ndarray, offset: int, values: np.ndarray) -> None:
    raw[:, offset:offset + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _put_iq1m_scale(raw: np.ndarray, values: np.ndarray) -> None:
    # IQ1_M keeps its fp16 super-scale in the top nibble of each of the 4 u16 scale words (@48).
    bits = values.astype(np.float16).view(np.uint16).astype(np.uint16)
    words = raw[:, 48:56].copy().view(np.uint16)  # [n, 4]
    for k in range(4):
        nib = (bits >> np.uint16(4 * k)) & np.uint16(0xF)
        words[:, k] = (words[:, k] & np.uint16(0x0FFF)) | (nib << np.uint16(12))
    raw[:, 48:56] = words.view(np.uint8)


def _set_scales(q: QuantType, raw: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> None:
    if q.name == "IQ1_M":
        _put_iq1m_scale(raw, d)
    elif q.name == "MXFP4":
        # E8M0: value scale 2^(e-128) (the fp4 table is doubled); d here is that power of two.
        raw[:, 0] = np.clip(np.round(np.log2(d)) + 128, 1, 254).astype(np.uint8)
    else:
        _put_f16(raw, q.d_offset, d)
        if q.m_offset is not None and m is not None:
            _put_f16(raw, q.m_offset, m)


def _random_raw(q: QuantType, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform random bytes `[n_blocks, block_bytes]`, with codes a type forbids made valid."""
    n = n_blocks * q.block_bytes
    words = rng.integers(0, np.iinfo(np.uint64).max, size=-(-n // 8), dtype=np.uint64,
                         endpoint=True)  # 64 random bits at a time: ~3x faster than bytes()
    raw = words.view(np.uint8)[:n].reshape(n_blocks, q.block_bytes)
    if q.name == "TQ2_0":  # ternary: a 2-bit code of 3 is not a valid trit; map it to 1 (zero)
        qs = raw[:, :64]
        for sh in (0, 2, 4, 6):
            three = ((qs >> sh) & 3) == 3
            qs[three] ^= np.uint8(2 << sh)  # 0b11 -> 0b01
    return raw


@functools.cache
def _unit_stats(name: str) -> tuple[float, float]:
    """For unit scales: (rms of weights, ratio m/d that zeroes the mean). Measured once per type."""
    q = QUANT_TYPES[name]
    rng = np.random.default_rng(1234)
    n = 512
    raw = _random_raw(q, n, rng)
    ones = np.ones(n, np.float32)
    _set_scales(q, raw, ones, np.zeros(n, np.float32))
    a = dequantize_reference(raw, q).astype(np.float64)   # d * A
    ratio = 0.0
    if q.m_offset is not None:
        _set_scales(q, raw, np.zeros(n, np.float32), ones)
        b = dequantize_reference(raw, q).astype(np.float64)  # m-term alone
        # Q4_1/Q5_1 add m, K types subtract dmin*m: solve mean(a) + ratio*mean(b) = 0.
        ratio = float(-a.mean() / b.mean())
        _set_scales(q, raw, ones, np.full(n, ratio, np.float32))
        a = dequantize_reference(raw, q).astype(np.float64)
    return float(np.sqrt(np.mean(a * a))), ratio


def random_blocks(qtype: str | int | QuantType, n_blocks: int, rng: np.random.Generator,
                  scale: float = 0.02, jitter: float = 0.5) -> np.ndarray:
    """`n_blocks` random valid blocks as uint8 `[n_blocks, block_bytes]`, weights with rms ~ `scale`.

    Quant fields are uniform random bytes; block scales are set so weights are finite, centred and
    of the requested size, each block's scale drawn from scale * [1-jitter, 1+jitter].
    """
    q = quant_type(qtype)
    if q.family == "float":
        w = rng.standard_normal(n_blocks, dtype=np.float32) * np.float32(scale)
        return float_bytes(w, q).reshape(n_blocks, q.block_bytes)
    raw = _random_raw(q, n_blocks, rng)
    unit_rms, ratio = _unit_stats(q.name)
    d = (scale / unit_rms) * rng.uniform(1 - jitter, 1 + jitter, n_blocks).astype(np.float32)
    _set_scales(q, raw, d, d * ratio)
    return raw


def float_bytes(values: np.ndarray, qtype: str | QuantType) -> np.ndarray:
    """float32 values -> the raw bytes of a float type (F32, F16, or BF16 rounded to nearest
    even), same shape with the last dimension in bytes."""
    q = quant_type(qtype)
    v = np.ascontiguousarray(values, dtype=np.float32)
    if q.name == "F32":
        return v.view(np.uint8)
    if q.name == "F16":
        return v.astype(np.float16).view(np.uint8)
    if q.name != "BF16":
        raise GGUFError(f"{q.name} is not a float type; expected F32, F16 or BF16")
    bits = v.view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return bits.astype(np.uint16).view(np.uint8)


def random_tensor(qtype: str | int | QuantType, shape: Sequence[int], rng: np.random.Generator,
                  scale: float = 0.02) -> np.ndarray:
    """Random valid blocks for a tensor of logical `shape`, as uint8 `[rows, row_bytes]`."""
    q = quant_type(qtype)
    nbytes = q.nbytes(shape)
    blocks = random_blocks(q, nbytes // q.block_bytes, rng, scale)
    return blocks.reshape(-1, q.row_bytes(int(shape[-1])))


# ---------------------------------------------------------------------------------------------
# IQ lookup tables, taken from gguf-py at run time (never pasted into our sources)
# ---------------------------------------------------------------------------------------------

@functools.cache
def iq_tables() -> dict[str, np.ndarray]:
    """ggml's IQ tables as flat arrays: grids as uint64 (8 bytes/entry) or uint32 (4 bytes/entry),
    `ksigns` uint8[128], `kvalues_iq4nl` int8[16], `kvalues_mxfp4` int8[16]."""
    out: dict[str, np.ndarray] = {}
    for key, cls, dt, sign in (("iq2xxs", _gq.IQ2_XXS, np.uint64, False),
                               ("iq2xs", _gq.IQ2_XS, np.uint64, False),
                               ("iq2s", _gq.IQ2_S, np.uint64, False),
                               ("iq3xxs", _gq.IQ3_XXS, np.uint32, False),
                               ("iq3s", _gq.IQ3_S, np.uint32, False),
                               ("iq1s", _gq.IQ1_S, np.uint64, True)):
        cls.init_grid()
        n, k = cls.grid_shape
        vals = np.asarray(cls.grid).reshape(n, k)
        vals = vals.astype(np.int8) if sign else vals.astype(np.uint8)
        out[key] = np.ascontiguousarray(vals).view(dt).reshape(n)
    out["ksigns"] = np.frombuffer(bytes(_gq.IQ2_XXS.ksigns), np.uint8).copy()
    out["kvalues_iq4nl"] = np.asarray(_gq.IQ4_NL.kvalues, np.int8)
    out["kvalues_mxfp4"] = np.asarray(_gq.MXFP4.kvalues, np.int8)
    return out
