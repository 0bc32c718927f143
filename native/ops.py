"""native.ops: the one Python API for math on quantized weights.

Every matmul of the model goes through here. Each op dispatches by device: the CUDA extension
for CUDA tensors, the CPU extension for CPU tensors, and the slow reference (gguf-py's
bit-exact dequantizer + torch) when an extension lacks the type, or when forced with
`FTPATCH_KERNELS=reference`. The reference is also the oracle the kernel tests compare with.

Legend: T tokens, H hidden (input features), O output features, E experts, K top-k, F expert ff.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from loaders.quants import QUANT_TYPES, QuantType, dequantize_reference, quant_type

from .errors import NativeError


# ---- weight handle -------------------------------------------------------------------------------

@dataclass(frozen=True)
class QTensor:
    """Raw ggml blocks of a weight on one device: uint8 `data` [rows, row_bytes] + type + shape.

    `shape` is torch order (last dim = input features, stored in blocks). For expert banks
    shape is [E, O, H] and rows = E*O. `name` is the GGUF name (errors, statistics, caches).
    """

    data: torch.Tensor
    qtype: QuantType
    shape: tuple[int, ...]
    name: str = ""

    def __post_init__(self) -> None:
        rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        want = (rows, self.qtype.row_bytes(int(self.shape[-1])))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise NativeError(f"{self.name or 'weight'}: {self.qtype.name} {list(self.shape)} needs "
                              f"uint8 data of shape {list(want)}, got {self.data.dtype} "
                              f"{list(self.data.shape)}")

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "QTensor":
        return QTensor(self.data.to(device, non_blocking=non_blocking), self.qtype, self.shape,
                       self.name)

    def expert(self, e: int) -> "QTensor":
        """Expert `e` of a bank [E, O, H] as a 2-D weight [O, H] (a view)."""
        o = self.shape[1]
        return QTensor(self.data[e * o:(e + 1) * o], self.qtype, tuple(self.shape[1:]), f"{self.name}[{e}]")

    @classmethod
    def from_numpy(cls, data: np.ndarray, qtype: str | QuantType, shape: Sequence[int],
                   name: str = "") -> "QTensor":
        """Wrap host bytes (e.g. a memory-mapped GGUF tensor) without copying."""
        q = quant_type(qtype)
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        arr = np.asarray(data).view(np.uint8).reshape(rows, -1)
        with warnings.catch_warnings():  # mmap views are read-only; kernels never write weights
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
        return cls(t, q, tuple(int(s) for s in shape), name)

    @classmethod
    def from_weight(cls, w, device: torch.device | str = "cpu") -> "QTensor":
        """From a loaders.Weight; zero-copy on the CPU, one upload otherwise."""
        qt = cls.from_numpy(w.data, w.qtype, w.shape, w.name)
        return qt if torch.device(device).type == "cpu" else qt.to(device)


# ---- backends --------------------------------------------------------------------------------------

def _load(name: str):
    if os.environ.get("FTPATCH_KERNELS", "").lower() == "reference":
        return None
    try:
        return __import__(f"native.{name}", fromlist=["_"])
    except ImportError:
        return None


_cpu = _load("_cpu")
_cuda = _load("_cuda")


def _ext_for(device: torch.device):
    return _cuda if device.type == "cuda" else _cpu if device.type == "cpu" else None


def _ext_supports(ext, qtype: QuantType, op: str) -> bool:
    return ext is not None and qtype.name in getattr(ext, f"{op}_types", lambda: ())()


def supported_types() -> dict[str, dict[str, bool]]:
    """For every type of the table: which engines run it natively (the reference runs all)."""
    return {name: {"reference": True,
                   "cpu": _ext_supports(_cpu, q, "matmul"),
                   "cuda": _ext_supports(_cuda, q, "matmul")}
            for name, q in QUANT_TYPES.items()}


# ---- reference path ------------------------------------------------------------------------------

def dequantize_ref(w: QTensor) -> torch.Tensor:
    """Reference: gguf-py's bit-exact dequantizer, on the host; result on w's device."""
    host = w.data.cpu().numpy()
    out = torch.from_numpy(dequantize_reference(host, w.qtype, w.shape))
    return out.to(w.device)


def matmul_ref(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """Reference y = x @ W^T in float32. x [T, H], W [O, H] -> [T, O]."""
    return x.float() @ dequantize_ref(w).T


def moe_ffn_ref(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor,
                ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Reference routed-expert FFN. x [T, H]; gate/up [E, F, H]; down [E, H, F]; ids/weights [T, K]."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok].float()
        h = torch.nn.functional.silu(matmul_ref(xe, gate.expert(e))) * matmul_ref(xe, up.expert(e))
        out.index_add_(0, tok, matmul_ref(h, down.expert(e)) * weights[tok, slot, None].float())
    return out


# ---- public ops ------------------------------------------------------------------------------------

def dequantize(data, qtype: str | QuantType, shape: Sequence[int]) -> torch.Tensor:
    """Raw blocks (uint8 numpy array or tensor) -> float32 tensor of `shape`, on data's device."""
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
    q = quant_type(qtype)
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    w = QTensor(data.reshape(rows, -1), q, tuple(shape))
    ext = _ext_for(w.device)
    if _ext_supports(ext, q, "dequantize"):
        return ext_dequantize(ext, w)
    return dequantize_ref(w)


def matmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """y = x @ W^T, float32. x [T, H] (or [H]) float; W [O, H] on x's device -> [T, O]."""
    if x.device != w.device:
        raise NativeError(f"{w.name}: weight on {w.device}, input on {x.device}")
    if x.shape[-1] != w.shape[-1]:
        raise NativeError(f"{w.name}: input has {x.shape[-1]} features, weight expects {w.shape[-1]}")
    ext = _ext_for(x.device)
    if _ext_supports(ext, w.qtype, "matmul"):
        return ext_matmul(ext, x, w)
    return matmul_ref(x, w)


def moe_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor,
            ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Routed experts: sum_k weights[t,k] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t,k].

    x [T, H] float32; gate/up [E, F, H]; down [E, H, F]; ids [T, K] int; weights [T, K] -> [T, H].
    """
    ext = _ext_for(x.device)
    if all(_ext_supports(ext, q.qtype, "moe_ffn") for q in (gate, up, down)):
        return ext_moe_ffn(ext, x, gate, up, down, ids, weights)
    return moe_ffn_ref(x, gate, up, down, ids, weights)


# ---- extension calls (thin: check once, pass pointers) ----------------------------------------------
# Filled in by the kernel work; until an extension reports a type in `<op>_types()`, the
# reference path above runs.

def ext_dequantize(ext, w: QTensor) -> torch.Tensor:
    raise NativeError("native dequantize is not built yet")


def ext_matmul(ext, x: torch.Tensor, w: QTensor) -> torch.Tensor:
    raise NativeError("native matmul is not built yet")


def ext_moe_ffn(ext, x, gate, up, down, ids, weights) -> torch.Tensor:
    raise NativeError("native moe_ffn is not built yet")
