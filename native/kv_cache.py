"""How a KV cache stores its values: f32, f16, q8_0, q4_0 (`--kv-type`).

A cache is [B, n_ctx, Hkv, X]: one row of X per position and kv head. For f32 and f16 X is the
head size d and the row holds the values. q8_0 and q4_0 cut a row into blocks of 32 values
with ggml's Q8_0 and Q4_0 arithmetic (one f16 scale a block) but in a layout of our own, chosen
for the attention kernels: a row is its d quants, then its d/32 scales, so that a GPU lane
reads its consecutive values with one aligned load and finds their scale beside them.

  q8_0  X = d + d/16 bytes: d int8 quants, then d/32 f16 scales.
        s = amax / 127, q = round-half-even(x * (1/s)) in [-127, 127], x' = q * f16(s)
  q4_0  X = d/2 + d/16 bytes: d/2 bytes of 4-bit quants (value 2i in the low nibble of byte
        i, value 2i+1 in the high one), then d/32 f16 scales.
        m = the block's value of largest magnitude (the first, on ties), s = m / -8,
        q = min(15, floor(x * (1/s) + 8.5)), x' = (q - 8) * f16(s)

Every step is one IEEE operation in f32 (1/s a correctly rounded division, the product and the
sum rounded apart, no fused multiply-add), so the CUDA kernels' rows equal `quantize`'s bit
for bit. A q8_0 row costs 1.06 bytes a value (f16: 2), q4_0 0.56.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32


@dataclass(frozen=True)
class KVType:
    name: str           # "f32", "f16", "q8_0", "q4_0"
    storage: torch.dtype
    code: int           # what the CUDA kernels' cache_dtype argument says (api.h)

    @property
    def quantized(self) -> bool:
        return self.storage == torch.uint8

    def row_bytes(self, d: int) -> int:
        """Bytes a head row of d values takes."""
        if self.name == "f32":
            return 4 * d
        if self.name == "f16":
            return 2 * d
        if d % BLOCK:
            raise ValueError(f"--kv-type {self.name} needs a head size that is a multiple of "
                             f"{BLOCK}, not {d}; use --kv-type f16")
        return (d if self.name == "q8_0" else d // 2) + d // BLOCK * 2

    def bytes_per_value(self, d: int) -> float:
        """Bytes a value takes in head rows of d (what memory estimates multiply by)."""
        return self.row_bytes(d) / d

    def row_width(self, d: int) -> int:
        """The cache's last dimension (X) for head size d."""
        return self.row_bytes(d) // self.storage.itemsize

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Values [..., d] (f32) -> rows [..., X] of this type."""
        if not self.quantized:
            return x.to(self.storage)
        return _quantize_blocks(x.float(), self.name)

    def dequantize(self, rows: torch.Tensor, d: int) -> torch.Tensor:
        """Rows [..., X] of this type -> values [..., d] f32."""
        if not self.quantized:
            return rows.float()
        return _dequantize_blocks(rows, d, self.name)


KV_TYPES = {t.name: t for t in (KVType("f32", torch.float32, 0), KVType("f16", torch.float16, 1),
                                KVType("q8_0", torch.uint8, 2), KVType("q4_0", torch.uint8, 3))}
_BY_DTYPE = {torch.float32: "f32", torch.float16: "f16"}


def kv_type(spec) -> KVType:
    """A KVType from its name, a KVType, or a float dtype (f32, f16)."""
    if isinstance(spec, KVType):
        return spec
    if isinstance(spec, torch.dtype):
        if spec not in _BY_DTYPE:
            raise ValueError(f"KV cache dtype {spec} is not supported; use "
                             f"{', '.join(KV_TYPES)}")
        return KV_TYPES[_BY_DTYPE[spec]]
    if spec not in KV_TYPES:
        raise ValueError(f"unknown KV type {spec!r}; use one of {', '.join(KV_TYPES)}")
    return KV_TYPES[spec]


def kv_type_of(cache: torch.Tensor, d: int) -> KVType:
    """The type of a cache [..., Hkv, X] holding head rows of d values."""
    if cache.dtype != torch.uint8:
        return kv_type(cache.dtype)
    for name in ("q8_0", "q4_0"):
        if KV_TYPES[name].row_width(d) == cache.shape[-1]:
            return KV_TYPES[name]
    raise ValueError(f"a uint8 cache row of {cache.shape[-1]} bytes holds no KV type of head "
                     f"size {d}")


def _quantize_blocks(x: torch.Tensor, name: str) -> torch.Tensor:
    *lead, d = x.shape
    if d % BLOCK:
        raise ValueError(f"--kv-type {name} needs a head size that is a multiple of {BLOCK}")
    blocks = x.reshape(*lead, d // BLOCK, BLOCK)
    if name == "q8_0":
        s = _div(blocks.abs().amax(-1), 127.0)
    else:
        at = blocks.abs().argmax(-1, keepdim=True)      # the first of equal magnitudes
        s = _div(torch.gather(blocks, -1, at).squeeze(-1), -8.0)
    inv = torch.where(s != 0, _div(torch.ones_like(s), torch.where(s != 0, s, 1.0)), 0.0)[..., None]
    scaled = blocks * inv
    if name == "q8_0":
        quants = torch.round(scaled).to(torch.int8).view(torch.uint8).reshape(*lead, d)
    else:
        q = torch.floor(scaled + 8.5).clamp(max=15).to(torch.uint8).reshape(*lead, d // 2, 2)
        quants = q[..., 0] | (q[..., 1] << 4)
    scales = s.to(torch.float16).contiguous().view(torch.uint8).reshape(*lead, d // BLOCK * 2)
    return torch.cat([quants, scales], dim=-1)


def _div(a: torch.Tensor, b) -> torch.Tensor:
    """a / b elementwise, each quotient correctly rounded (a tensor divisor: torch may turn a
    scalar divisor into a product by its reciprocal)."""
    return torch.div(a, torch.full_like(a, b) if not isinstance(b, torch.Tensor) else b)


def _dequantize_blocks(rows: torch.Tensor, d: int, name: str) -> torch.Tensor:
    *lead, _ = rows.shape
    n_q = d if name == "q8_0" else d // 2
    quants, scales = rows[..., :n_q], rows[..., n_q:]
    s = scales.contiguous().view(torch.float16).float()                     # [..., d/32]
    if name == "q8_0":
        q = quants.contiguous().view(torch.int8).float()
    else:
        q = torch.stack([quants & 15, quants >> 4], dim=-1).reshape(*lead, d).float() - 8.0
    return (q.reshape(*lead, d // BLOCK, BLOCK) * s[..., None]).reshape(*lead, d)
