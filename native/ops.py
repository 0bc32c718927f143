"""native.ops: the one Python API for math on quantized weights.

Every matmul of the model goes through here. Each op dispatches by device: the CUDA extension
for CUDA tensors, the CPU extension for CPU tensors, and the slow reference (gguf-py's
bit-exact dequantizer + torch) when an extension lacks the type, or when forced with
`FTPATCH_KERNELS=reference`. The reference is also the oracle the kernel tests compare with.

Extension calls follow one rule: every kernel entry point of native._cpu and native._cuda has the
same signature, ending in `stream: int` (0 for the CPU; the current CUDA stream's handle for CUDA),
takes data_ptr()s and sizes, and releases the GIL (see csrc/bindings_cpu.cpp for the contract).

Legend: T tokens, H hidden (input features), O output features, E experts, K top-k, F expert ff.
"""
from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from loaders.quants import QUANT_TYPES, QuantType, dequantize_reference, iq_tables, quant_type

from .errors import NativeError
from .kv_cache import kv_type_of


# ---- weight handle -------------------------------------------------------------------------------

@dataclass(frozen=True)
class QTensor:
    """Raw ggml blocks of a weight on one device: uint8 `data` [rows, row_bytes] + type + shape.

    `shape` is torch order (last dim = input features, stored in blocks). For expert banks
    shape is [E, O, H] and rows = E*O; a bank may also hold a strided view `data` [E, O, row_bytes]
    (rows contiguous inside an expert), e.g. the gate or up half of a fused gate_up bank
    (see `rows`). `name` is the GGUF name (errors, statistics, caches). `parts`: for weights
    that several projections of one input were concatenated into (one matmul instead of
    several), the output rows of each, in order.
    """

    data: torch.Tensor
    qtype: QuantType
    shape: tuple[int, ...]
    name: str = ""
    parts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        rb = self.qtype.row_bytes(int(self.shape[-1]))
        flat = tuple(self.data.shape) == (rows, rb)
        bank = len(self.shape) == 3 and tuple(self.data.shape) == (*self.shape[:2], rb)
        if self.data.dtype != torch.uint8 or not (flat or bank):
            raise NativeError(f"{self.name or 'weight'}: {self.qtype.name} {list(self.shape)} needs "
                              f"uint8 data of shape {[rows, rb]}, got {self.data.dtype} "
                              f"{list(self.data.shape)}")
        if self.data.numel() and (self.data.stride(-1) != 1 or
                                  (self.data.shape[-2] > 1 and self.data.stride(-2) != rb)):
            raise NativeError(f"{self.name or 'weight'}: block rows must be contiguous "
                              f"(strides {self.data.stride()})")

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def row_bytes(self) -> int:
        return self.qtype.row_bytes(int(self.shape[-1]))

    @property
    def expert_stride(self) -> int:
        """Bytes from one expert's rows to the next (banks [E, O, H])."""
        return self.data.stride(0) if self.data.dim() == 3 else self.shape[1] * self.row_bytes

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "QTensor":
        return QTensor(self.data.to(device, non_blocking=non_blocking), self.qtype, self.shape,
                       self.name, self.parts)

    def expert(self, e: int) -> "QTensor":
        """Expert `e` of a bank [E, O, H] as a 2-D weight [O, H] (a view)."""
        o = self.shape[1]
        data = self.data[e] if self.data.dim() == 3 else self.data[e * o:(e + 1) * o]
        return QTensor(data, self.qtype, tuple(self.shape[1:]), f"{self.name}[{e}]")

    def rows(self, start: int, stop: int) -> "QTensor":
        """Output rows [start, stop) of every expert of a bank [E, O, H], as a strided view
        (no copy): `gate, up = gu.rows(0, F), gu.rows(F, 2 * F)` for a fused gate_up bank."""
        e, o, h = self.shape
        view = self.data.view(e, o, self.row_bytes) if self.data.dim() == 2 else self.data
        return QTensor(view[:, start:stop], self.qtype, (e, stop - start, h),
                       f"{self.name}[:, {start}:{stop}]")

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


# ---- the CPU's repacked forms ---------------------------------------------------------------------

def cpu_form(qtype: QuantType) -> QuantType | None:
    """The CPU extension's repacked form of a file type (the same weights in a layout its kernels
    read without table lookups: IQ3_S -> IQ3_S_N4, 22% more bytes), or None."""
    form = None if _cpu is None or not hasattr(_cpu, "repacked_type") else _cpu.repacked_type(qtype.type_id)
    if form is None:
        return None
    type_id, name, block_elems, block_bytes = form
    return QuantType(name, type_id, block_elems, block_bytes, "repacked")


def repack_for_cpu(w: QTensor) -> QTensor:
    """`w` (a CPU weight [O, H] or bank [E, O, H]) in the CPU's repacked form of its type, in new
    memory; `w` itself where its type has none. Every CPU kernel gives the original's bits on it
    (tests/native/test_cpu_repack.py)."""
    form = cpu_form(w.qtype)
    if form is None or w.device.type != "cpu":
        return w
    shape = tuple(w.shape)
    experts = shape[0] if len(shape) == 3 else 1
    rows = int(np.prod(shape[:-1], dtype=np.int64)) // experts   # rows of one expert
    rb = form.row_bytes(int(shape[-1]))
    out = torch.empty((experts * rows, rb), dtype=torch.uint8)
    nblocks = rows * (w.row_bytes // w.qtype.block_bytes)
    # rows are contiguous inside an expert (QTensor's rule): one run of blocks an expert
    _cpu.repack(w.qtype.type_id, w.data.data_ptr(), nblocks, out.data_ptr(), experts,
                w.expert_stride if experts > 1 else 0, rows * rb)
    return QTensor(out, form, shape, w.name, w.parts)


# ---- backends --------------------------------------------------------------------------------------

def _load(name: str):
    if os.environ.get("FTPATCH_KERNELS", "").lower() == "reference":
        return None
    try:
        ext = __import__(f"native.{name}", fromlist=["_"])
    except ImportError:
        return None
    if name == "_cuda" and torch.cuda.is_available():   # a GPU this build has no code for: one line
        from . import build_info
        gpu = torch.cuda.current_device()
        build_info.unusable = build_info.mismatch(torch.cuda.get_device_name(gpu),
                                                  torch.cuda.get_device_capability(gpu),
                                                  build_info.built_archs(ext))
        if build_info.unusable:
            warnings.warn(build_info.unusable + "; using the reference path")
            return None
    if hasattr(ext, "set_tables"):  # IQ grids from gguf-py, once per process
        try:
            ext.set_tables(iq_tables())
        except Exception as exc:  # e.g. no usable CUDA device: run the reference instead
            if name == "_cuda" and not torch.cuda.is_available():
                return None   # no GPU here (built where nvcc was found): nothing to warn about
            warnings.warn(f"native.{name} is unusable ({exc}); using the reference path")
            return None
    return ext


_cpu = _load("_cpu")
_cuda = _load("_cuda")

# ggml ids of the float element types the kernels write (dequantize) and read (KV caches), as the
# extensions state them (OUTPUT_DTYPES, csrc/offload_bindings.h); the header's values without one
_GGML_DTYPE = {getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[name]): int(i)
               for name, i in (getattr(_cpu or _cuda, "OUTPUT_DTYPES", None)
                               or {"F32": 0, "F16": 1, "BF16": 30}).items()}


def _ext_for(device: torch.device):
    return _cuda if device.type == "cuda" else _cpu if device.type == "cpu" else None


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


_EXT_TYPES: dict[tuple[int, str], tuple] = {}   # (id(ext), op) -> (ext, names): asked once


def _ext_supports(ext, qtype: QuantType, op: str, n_cols: int | None = None) -> bool:
    if ext is None:
        return False
    hit = _EXT_TYPES.get((id(ext), op))
    if hit is None or hit[0] is not ext:
        hit = _EXT_TYPES[(id(ext), op)] = (ext, frozenset(getattr(ext, f"{op}_types", lambda: ())()))
    if qtype.name not in hit[1] and not (qtype.family == "repacked" and ext is _cpu):
        return False
    # kernels address rows in 32-weight groups: float rows need a multiple of 32 elements
    return n_cols is None or n_cols % max(32, qtype.block_elems) == 0


def supported_types() -> dict[str, dict[str, bool]]:
    """For every type of the table: which engines run it natively (the reference runs all)."""
    return {name: {"reference": True,
                   "cpu": _ext_supports(_cpu, q, "matmul"),
                   "cuda": _ext_supports(_cuda, q, "matmul")}
            for name, q in QUANT_TYPES.items()}


# ---- reference path ------------------------------------------------------------------------------

def dequantize_ref(w: QTensor) -> torch.Tensor:
    """Reference: gguf-py's bit-exact dequantizer (for the CPU's repacked forms, the numpy one
    below), on the host; result on w's device."""
    host = w.data.cpu().numpy()
    deq = _dequantize_repacked_ref if w.qtype.family == "repacked" else dequantize_reference
    return torch.from_numpy(deq(host, w.qtype, w.shape)).to(w.device)


def _dequantize_repacked_ref(raw: np.ndarray, qtype: QuantType, shape: Sequence[int]) -> np.ndarray:
    """IQ3_S_N4 (quants.h) in numpy, written from the layout alone: per group of 32 weights,
    float32 (d * (1 + 2 * scale)) times the weight 2 * code - 15, as IQ3_S's reference does."""
    if qtype.name != "IQ3_S_N4":
        raise NativeError(f"no reference dequantizer for the repacked form {qtype.name}")
    blocks = np.ascontiguousarray(raw).reshape(-1, qtype.block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)            # [nb, 1]
    sc = blocks[:, 2:6]
    scales = np.stack([sc & 0xF, sc >> 4], -1).reshape(-1, 8).astype(np.float32)   # group g
    db = d * (1 + 2 * scales)                                                 # [nb, 8] float32
    qs = blocks[:, 6:].reshape(-1, 4, 32)
    codes = np.stack([qs & 0xF, qs >> 4], 2).reshape(-1, 8, 32)               # [nb, group, 32]
    vals = (2 * codes.astype(np.int32) - 15).astype(np.float32)
    return (db[:, :, None] * vals).astype(np.float32).reshape(tuple(shape))


def matmul_ref(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """Reference y = x @ W^T in float32. x [T, H], W [O, H] -> [T, O]."""
    return x.float() @ dequantize_ref(w).T


def moe_ffn_ref(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor,
                ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Reference routed-expert FFN. x [T, H]; gate/up [E, F, H]; down [E, H, F]; ids/weights [T, K].
    Slots with ids < 0 are skipped."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
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
    if _ext_supports(ext, q, "dequantize", int(shape[-1])):
        return ext_dequantize(ext, w)
    return dequantize_ref(w)


def matmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """y = x @ W^T, float32. x [T, H] (or [H]) float; W [O, H] on x's device -> [T, O]."""
    if x.device.type == "cpu":
        arg = _cpu_weight(w)
        if arg is not None and x.shape[-1] == arg[4]:
            return _cpu_matmul_many(x, [arg])[0]
    if x.device != w.device:
        raise NativeError(f"{w.name}: weight on {w.device}, input on {x.device}")
    if x.shape[-1] != w.shape[-1]:
        raise NativeError(f"{w.name}: input has {x.shape[-1]} features, weight expects {w.shape[-1]}")
    ext = _ext_for(x.device)
    if x.device.type == "cuda" and w.qtype.family == "float" and len(w.shape) == 2:
        return _float_matmul(x, w)  # decode's rows natively, longer inputs by cuBLAS
    if _ext_supports(ext, w.qtype, "matmul", int(w.shape[-1])):
        if ext is _cuda and x.numel() // x.shape[-1] > DECODE_MAX_TOKENS and len(w.shape) == 2:
            return cuda_prefill_matmul(x, w, dtype=PREFILL_DTYPE)
        return ext_matmul(ext, x, w)
    return matmul_ref(x, w)


_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def matmul_many(x: torch.Tensor, ws: Sequence[QTensor]) -> list[torch.Tensor]:
    """[x @ W^T for W in ws]: several weights that read the same x [T, H] (or [H]), float32.
    On the CPU one native call for all of them (x rounded once, one pool hand-off, the rows of
    every weight split over all threads) into one [T, sum O] buffer, returned as column views;
    elsewhere (or for a type the extension lacks) one `matmul` each."""
    if x.device.type == "cpu":
        args = [_cpu_weight(w) for w in ws]
        if all(a is not None and a[4] == x.shape[-1] for a in args):
            return _cpu_matmul_many(x, args)
    return [matmul(x, w) for w in ws]


# A decode token makes a few hundred matmul and moe_ffn calls, each cheap next to Python's own
# checks: the native arguments of CPU weights are worked out once, kept while the weights live.
_NATIVE_ARGS: dict[tuple, tuple] = {}   # ids of the weights -> (weakrefs to them, the arguments)


def _native_args(weights: tuple, make) -> tuple | None:
    """make() -> the native arguments of `weights` (None: the extension cannot run them), worked
    out once and kept while every one of the weights lives."""
    key = tuple(map(id, weights))
    hit = _NATIVE_ARGS.get(key)
    if hit is not None and all(r() is q for r, q in zip(hit[0], weights)):
        return hit[1]
    arg = make()
    if arg is not None:
        drop = lambda _, k=key: _NATIVE_ARGS.pop(k, None)   # noqa: E731
        _NATIVE_ARGS[key] = (tuple(weakref.ref(q, drop) for q in weights), arg)
    return arg


def _cpu_weight(w: QTensor) -> tuple | None:
    """The matmul_multi argument of a 2-D CPU weight the extension runs (else None), plus n_in."""
    def make():
        if (_cpu is None or not hasattr(_cpu, "matmul_multi") or w.device.type != "cpu"
                or len(w.shape) != 2 or w.data.dim() != 2
                or not _ext_supports(_cpu, w.qtype, "matmul", int(w.shape[-1]))):
            return None
        return (w.qtype.type_id, w.data.data_ptr(), int(w.shape[0]), w.row_bytes, int(w.shape[1]))
    return None if _cpu is None else _native_args((w,), make)   # (tests can switch it off)


def _cpu_matmul_many(x: torch.Tensor, args: list[tuple]) -> list[torch.Tensor]:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.to(torch.float32).contiguous()
    outs = [a[2] for a in args]
    total = sum(outs)
    y = torch.empty(x2.shape[0], total, dtype=torch.float32)
    if x2.shape[0] and total:
        _cpu.matmul_multi([a[:4] for a in args], h, x2.data_ptr(), x2.shape[0], y.data_ptr(), total, 0)
    yv = y.view(*x.shape[:-1], total)
    return [yv] if len(args) == 1 else list(yv.split(outs, dim=-1))


def _float_matmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x @ W^T for a float-typed weight on a GPU: up to DECODE_MAX_TOKENS rows by the native
    float_matmul, more by cuBLAS on the bytes viewed as the float type."""
    o, h = w.shape
    x2 = x.reshape(-1, h).to(torch.float32)
    data = _rows(w)
    if x2.is_cuda and 0 < x2.shape[0] <= DECODE_MAX_TOKENS and h % 4 == 0 \
            and hasattr(_cuda, "float_matmul"):
        # decode's few rows: one launch whose every row sums in the same order whatever the row
        # count (cuBLAS picks its kernel, and so its order, by shape), so a speculative verify
        # step or a batch routes as decode does (an F32 router's logits decide the experts);
        # F16/BF16 weights are read as they are stored
        x2 = x2.contiguous() if x2.data_ptr() % 16 == 0 else x2.clone()
        y = torch.empty(x2.shape[0], o, dtype=torch.float32, device=x.device)
        _cuda.float_matmul(w.qtype.type_id, data.data_ptr(), o, h, w.row_bytes, x2.data_ptr(),
                           x2.shape[0], y.data_ptr(), _stream(x.device))
        return y.reshape(*x.shape[:-1], o)
    wt = data.view(_FLOAT_DTYPES[w.qtype.name]).view(o, h)
    wt = wt if wt.dtype == torch.float32 else wt.float()
    return (x2 @ wt.T).reshape(*x.shape[:-1], o)


def moe_ffn(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor,
            ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts: sum_k weights[t,k] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t,k].

    x [T, H] float32; gate/up [E, F, H]; down [E, H, F]; ids [T, K] int; weights [T, K] -> [T, H].
    Slots with ids < 0 contribute nothing (the offload runtime masks experts computed elsewhere).
    `out` (float32 [T, H], contiguous) receives the result if given. On CPU tensors the call
    releases the GIL, so a Python thread can run the CPU misses while another drives the GPU.
    """
    if x.device.type == "cpu" and ids.device.type == "cpu" and weights.device.type == "cpu":
        banks = _cpu_banks(gate, up, down)   # the banks checked once (a decode token: 40 calls)
        if banks is not None and x.dim() == 2 and x.shape[1] == banks[2] and ids.dim() == 2 \
                and ids.shape == weights.shape and ids.shape[0] == x.shape[0]:
            return ext_moe_ffn(_cpu, x, gate, up, down, ids, weights, out, banks)
    (t, h), (e, f) = x.shape, gate.shape[:2]
    if (tuple(gate.shape) != (e, f, h) or tuple(up.shape) != (e, f, h) or tuple(down.shape) != (e, h, f)
            or tuple(ids.shape) != tuple(weights.shape) or ids.dim() != 2 or ids.shape[0] != t):
        raise NativeError(f"moe_ffn: shapes x {list(x.shape)}, gate {list(gate.shape)}, up "
                          f"{list(up.shape)}, down {list(down.shape)}, ids {list(ids.shape)}, weights "
                          f"{list(weights.shape)} do not fit x [T, H], gate/up [E, F, H], down [E, H, F], "
                          f"ids/weights [T, K]")
    if len({x.device, gate.device, up.device, down.device, ids.device, weights.device}) != 1:
        raise NativeError("moe_ffn: x, ids, weights and the three banks must be on one device")
    ext = _ext_for(x.device)
    if all(_ext_supports(ext, q.qtype, "moe_ffn", int(q.shape[-1])) for q in (gate, up, down)):
        if ext is _cuda and t > PREFILL_MOE_MIN_TOKENS and PREFILL_DTYPE != torch.float32:
            y = cuda_prefill_moe(x, gate, up, down, ids, weights)
            return y if out is None else out.copy_(y)
        return ext_moe_ffn(ext, x, gate, up, down, ids, weights, out)
    y = moe_ffn_ref(x, gate, up, down, ids, weights)
    return y if out is None else out.copy_(y)


# ---- extension calls (thin: check once, pass pointers) ----------------------------------------------

def _rows(w: QTensor) -> torch.Tensor:
    """w.data as uniformly strided rows (a strided bank view is copied)."""
    return w.data.contiguous() if w.data.dim() == 3 else w.data


def ext_dequantize(ext, w: QTensor) -> torch.Tensor:
    data = _rows(w)
    rows, cols = data.numel() // max(w.row_bytes, 1), int(w.shape[-1])
    out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    if out.numel():
        ext.dequantize(w.qtype.type_id, data.data_ptr(), rows, cols, w.row_bytes, out.data_ptr(), 0,
                       _stream(w.device))
    return out


def ext_matmul(ext, x: torch.Tensor, w: QTensor) -> torch.Tensor:
    if len(w.shape) != 2:
        raise NativeError(f"{w.name}: matmul needs a 2-D weight [O, H], got {list(w.shape)}")
    (o, h), data = w.shape, _rows(w)
    x2 = x.reshape(-1, h).to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], o, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        ext.matmul(w.qtype.type_id, data.data_ptr(), o, h, w.row_bytes, x2.data_ptr(), x2.shape[0],
                   y.data_ptr(), _stream(x.device))
    return y.reshape(*x.shape[:-1], o)


def _cpu_banks(gate: QTensor, up: QTensor, down: QTensor) -> tuple | None:
    """(E, F, H, the bank arguments of native moe_ffn) of three CPU banks that fit together and
    the extension runs, else None (moe_ffn's checks then say why)."""
    def make():
        e, f, h = gate.shape if len(gate.shape) == 3 else (0, 0, 0)
        if (_cpu is None or not e or any(q.device.type != "cpu" for q in (gate, up, down))
                or tuple(up.shape) != (e, f, h) or tuple(down.shape) != (e, h, f)
                or not all(_ext_supports(_cpu, q.qtype, "moe_ffn", int(q.shape[-1]))
                           for q in (gate, up, down))):
            return None
        return (e, f, h, [v for q in (gate, up, down)
                          for v in (q.qtype.type_id, q.data.data_ptr(), q.expert_stride)])
    return None if _cpu is None else _native_args((gate, up, down), make)


def ext_moe_ffn(ext, x, gate, up, down, ids, weights, out=None, banks=None) -> torch.Tensor:
    (t, h), (e, f), k = x.shape, gate.shape[:2], ids.shape[1]
    x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    ids32 = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
    w32 = weights if weights.dtype == torch.float32 and weights.is_contiguous() \
        else weights.to(torch.float32).contiguous()
    if out is None:
        out = torch.empty(t, h, dtype=torch.float32, device=x.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (t, h) or not out.is_contiguous():
        raise NativeError(f"moe_ffn: out must be contiguous float32 {[t, h]}, got {out.dtype} "
                          f"{list(out.shape)}")
    if t:
        banks = banks[3] if banks is not None else \
            [v for q in (gate, up, down) for v in (q.qtype.type_id, q.data.data_ptr(), q.expert_stride)]
        ext.moe_ffn(x32.data_ptr(), t, h, f, e, ids32.data_ptr(), w32.data_ptr(), k, *banks,
                    out.data_ptr(), _stream(x.device))
    return out


# Above this many tokens a CUDA matmul dequantizes W and runs one GEMM (the decode kernels re-read W
# for every 8 tokens). PREFILL_DTYPE: the GEMM's operands. float16 (the default): tensor cores at
# bfloat16's speed with 3 more bits of mantissa, x scaled per row by a power of two so that
# nothing overflows; bfloat16 rounds W and x 8x more coarsely (at model level it fell below ggml's
# int8 scheme on several types, docs/BENCHMARKS.md "GPU fidelity"); float32 for exact comparisons.
DECODE_MAX_TOKENS = 8
PREFILL_DTYPE = torch.float16
# Routed experts switch to the dequantize + grouped-GEMM path above this many tokens. Below, the
# decode kernels (8 tokens a launch) need no bf16 copy of 32 experts (200 MB on the 35B): a short
# prompt then borrows far less of an elastic expert cache, which decode must refill after it.
PREFILL_MOE_MIN_TOKENS = 64
# The grouped expert GEMMs' operands: bfloat16, the type torch._grouped_mm runs (with float16 it
# falls back to a loop of GEMMs: pp2048 at 8 GiB halves, docs/BENCHMARKS.md "GPU fidelity").
PREFILL_MOE_DTYPE = torch.bfloat16


# ---- CUDA prefill: dequantize to 16 bits + one GEMM (CUDA only; kept apart from the dispatch) ----
# The decode kernels read W once per 8 tokens; for prefill (T > 8) a tensor-core GEMM on dequantized
# weights is far faster. W [O, H] -> `dtype` (gguf-py's values rounded to nearest even) in
# `workspace`, x rounded to `dtype` (float16: after its row's power-of-two scale), float32
# accumulation (and float32 output where torch has it).

def rows_to_f16_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of native._cuda.rows_to_f16: x [T, H] float32 -> (x * 2^-k per row as
    float16, 2^k float32 [T]), k >= 0 the least that brings the row's largest |x| under 2^15."""
    amax = x.abs().amax(-1) if x.shape[-1] else torch.zeros(x.shape[0], device=x.device)
    _, e = torch.frexp(amax)                      # amax = m * 2^e, m in [0.5, 1): ilogb = e - 1
    k = torch.where(amax >= 32768.0, (e - 1 - 14).clamp(max=126), torch.zeros_like(e))
    scale = torch.ldexp(torch.ones_like(amax), k)
    return (x / scale[:, None]).to(torch.float16), scale


def _x_for_gemm(x2: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x2 [T, H] float -> (x in `dtype` for the GEMM, per-row scale to apply to its output)."""
    if dtype != torch.float16:
        return x2.to(dtype), None
    x32 = x2.to(torch.float32)
    if x32.stride(-1) != 1:
        x32 = x32.contiguous()
    out = torch.empty(x32.shape, dtype=torch.float16, device=x32.device)
    scale = torch.empty(x32.shape[0], dtype=torch.float32, device=x32.device)
    _cuda.rows_to_f16(x32.data_ptr(), x32.shape[0], x32.shape[1], x32.stride(0), out.data_ptr(),
                      scale.data_ptr(), _stream(x32.device))
    return out, scale


def cuda_prefill_matmul(x: torch.Tensor, w: QTensor, workspace: torch.Tensor | None = None,
                        dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """y [T, O] float32 = x [T, H] @ W [O, H]^T on CUDA via native._cuda.dequantize + cuBLAS.
    `workspace`: a contiguous CUDA tensor of >= O*H*2 bytes, reused across calls (else allocated)."""
    if _cuda is None or x.device.type != "cuda" or w.device != x.device or len(w.shape) != 2:
        raise NativeError(f"{w.name}: cuda_prefill_matmul needs native._cuda and x, W [O, H] on one "
                          f"CUDA device (x on {x.device}, W {list(w.shape)} on {w.device})")
    (o, h), data = w.shape, _rows(w)
    ggml_dtype = _GGML_DTYPE[dtype]
    size = o * h * torch.finfo(dtype).bits // 8
    if workspace is None:
        wt = torch.empty(o, h, dtype=dtype, device=x.device)
    else:
        if workspace.device != x.device or not workspace.is_contiguous() or workspace.nbytes < size:
            raise NativeError(f"{w.name}: workspace needs {size} contiguous bytes on {x.device}")
        wt = workspace.reshape(-1).view(torch.uint8)[:size].view(dtype).view(o, h)
    _cuda.dequantize(w.qtype.type_id, data.data_ptr(), o, h, w.row_bytes, wt.data_ptr(), ggml_dtype,
                     _stream(x.device))
    x2, row_scale = _x_for_gemm(x.reshape(-1, h), dtype)
    if dtype == torch.float32:
        return torch.mm(x2, wt.T).reshape(*x.shape[:-1], o)
    try:
        y = torch.mm(x2, wt.T, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        y = torch.mm(x2, wt.T).float()
    if row_scale is not None:
        y.mul_(row_scale[:, None])
    return y.reshape(*x.shape[:-1], o)


def cuda_prefill_moe(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, ids: torch.Tensor,
                     weights: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Routed experts for many tokens on CUDA: tokens sorted by expert, each group of `group`
    experts dequantized to PREFILL_MOE_DTYPE in one launch per projection, then grouped GEMMs.
    x [T, H]; gate/up [E, F, H], down [E, H, F] banks (expert stride may exceed the expert's
    bytes: cache pools); ids/weights [T, K]; ids outside [0, E) are skipped. -> [T, H] float32.
    One host sync (the per-expert token counts)."""
    (t, h), (e, f), k = x.shape, gate.shape[:2], ids.shape[1]
    flat = ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < e), flat, e)              # invalid ids sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=e + 1)[:e]
    counts_h = counts.tolist()
    starts = [0]
    for c in counts_h:
        starts.append(starts[-1] + c)
    tok = order[:starts[-1]] // k
    wts = weights.reshape(-1)[order[:starts[-1]]].float()
    dt = PREFILL_MOE_DTYPE
    ggml_dtype = _GGML_DTYPE[dt]
    xs, xs_scale = _x_for_gemm(x.index_select(0, tok), dt)           # [N, H] grouped by expert
    ends = counts.cumsum(0).to(torch.int32)    # on the device: group offsets need no more syncs
    y = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    stream = _stream(x.device)
    for g0 in range(0, e, group):
        g1 = min(e, g0 + group)
        r0, r1 = starts[g0], starts[g1]
        if r0 == r1:
            continue
        n = g1 - g0
        mats = []
        for q, rows, cols in ((gate, f, h), (up, f, h), (down, h, f)):
            wq = torch.empty(n, rows, cols, dtype=dt, device=x.device)
            _cuda.dequantize(q.qtype.type_id, q.data.data_ptr() + g0 * q.expert_stride, n,
                             rows * cols, q.expert_stride, wq.data_ptr(), ggml_dtype, stream)
            mats.append(wq)
        offs = ends[g0:g1] - r0
        a = xs[r0:r1]
        hg, hu = _grouped_mm(a, mats[0], offs).float(), _grouped_mm(a, mats[1], offs).float()
        if xs_scale is not None:
            hg.mul_(xs_scale[r0:r1, None])
            hu.mul_(xs_scale[r0:r1, None])
        act, act_scale = _x_for_gemm(torch.nn.functional.silu(hg) * hu, dt)
        out = _grouped_mm(act, mats[2], offs).float()                # [rows, H]
        rw = wts[r0:r1, None] if act_scale is None else wts[r0:r1, None] * act_scale[:, None]
        y.index_add_(0, tok[r0:r1], out * rw)
    return y


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[r] = a[r] @ w[g]^T for the rows r of group g (offs: cumulative row ends, int32).
    a [N, in], w [G, out, in] of one 16-bit dtype -> [N, out]. torch._grouped_mm where it runs,
    else a loop."""
    try:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    except (AttributeError, RuntimeError, TypeError, NotImplementedError):
        ends = offs.tolist()
        out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
        start = 0
        for g, end in enumerate(ends):
            if end > start:
                out[start:end] = a[start:end] @ w[g].T
            start = end
        return out


# ---- decode-step kernels of the CPU (csrc/cpu/step.cpp) ----------------------------------------------
# The delta-net's conv and recurrence (a decode token, or a prompt's tokens in order), with the
# arguments and results of the CUDA step kernels below, and the attention core; host tensors. The residual add + RMS
# norm and the router's top-k have one wrapper for both devices (step_residual_rms_norm,
# step_route_topk, below).

def cpu_step_kernels_available(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and _cpu is not None and hasattr(_cpu, "route_topk")


def cpu_conv_silu(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """T tokens of B sequences: x [B, T, C] (rows with unit stride) -> silu(causal conv)
    [B*T, C] contiguous; conv_state [B, C, Kc-1] shifts in place (the last Kc-1 inputs)."""
    bsz, n_tok, ch = x.shape
    if not conv_state.is_contiguous() or not w.is_contiguous() or x.dtype != torch.float32 \
            or x.stride(2) != 1 or (bsz > 1 and n_tok > 1 and x.stride(0) != n_tok * x.stride(1)):
        raise NativeError("conv_silu: conv_state and w contiguous, x float32 rows of one stride")
    y = torch.empty(bsz * n_tok, ch, dtype=torch.float32)
    ldx = x.stride(1) if n_tok > 1 else (x.stride(0) if bsz > 1 else ch)   # row b*T + t to the next
    _cpu.conv_silu_seq(x.data_ptr(), ldx, conv_state.data_ptr(), w.data_ptr(), bsz, n_tok, ch,
                       w.shape[1], y.data_ptr(), 0)
    return y


def cpu_delta_rule(y: torch.Tensor, z: torch.Tensor, beta_raw: torch.Tensor,
                   alpha_raw: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
                   S: torch.Tensor, norm_w: torch.Tensor, n_k_heads: int,
                   eps: float) -> torch.Tensor:
    """cuda_delta_rule_steps on host tensors for T tokens of each of B sequences: y [B*T, q|k|v]
    after the conv, z [B*T, Hv*dv], beta_raw / alpha_raw [B*T, Hv] (rows b*T + t), S [B, Hv, dk,
    dv] contiguous, updated in place -> [B*T, Hv*dv]."""
    bsz, hv, dk, dv = S.shape
    n_tok = y.shape[0] // bsz
    ldg = _ld(beta_raw, "delta_rule beta")
    if _ld(alpha_raw, "delta_rule alpha") != ldg or not S.is_contiguous():
        raise NativeError("delta_rule: beta and alpha need the same row stride, S contiguous")
    out = torch.empty(bsz * n_tok, hv * dv, dtype=torch.float32)
    _cpu.delta_rule_seq(y.data_ptr(), _ld(y, "delta_rule y"), z.data_ptr(), _ld(z, "delta_rule z"),
                        beta_raw.data_ptr(), alpha_raw.data_ptr(), ldg, ssm_a.data_ptr(),
                        dt_bias.data_ptr(), S.data_ptr(), norm_w.data_ptr(), bsz, n_tok, n_k_heads,
                        hv, dk, dv, eps, out.data_ptr(), 0)
    return out


def _kv_type_or_none(cache: torch.Tensor, d: int):
    """native.kv_cache's type of a cache of head size d, or None where its rows are no type's."""
    try:
        return kv_type_of(cache, d)
    except ValueError:
        return None


def _cpu_kv_type(cache: torch.Tensor, d: int):
    """The KV type of a host cache that cpu_attention reads as stored, or None: f32 always,
    f16 / q8_0 / q4_0 where the built extension unpacks them (ATTENTION_KV_TYPES)."""
    if cache.device.type != "cpu" or _cpu is None or not hasattr(_cpu, "attention") or d > 512:
        return None
    kvt = _kv_type_or_none(cache, d)
    if kvt is None or (kvt.code and getattr(_cpu, "ATTENTION_KV_TYPES", 1) <= kvt.code):
        return None
    return kvt


def cpu_attention_reads(cache: torch.Tensor, d: int) -> bool:
    """Whether cpu_attention reads this host cache [n_ctx, Hkv, X] of head size d as stored."""
    return _cpu_kv_type(cache, d) is not None


def _cpu_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, d: int, what: str):
    """The KV type of a pair of host caches [n_ctx, Hkv, X] the CPU kernels take (contiguous,
    one shape, rows of one type they read), or a NativeError naming `what`."""
    kvt = _cpu_kv_type(k_cache, d)
    if kvt is None or kvt.row_width(d) != k_cache.shape[-1] or any(
            c.dtype != k_cache.dtype or c.shape != k_cache.shape or not c.is_contiguous()
            for c in (k_cache, v_cache)):
        raise NativeError(f"{what}: caches must be contiguous [n_ctx, Hkv, X] rows of one KV type "
                          "(f32, f16, q8_0 or q4_0) of head size d, as this build of native._cpu reads")
    return kvt


def cpu_attention(q: torch.Tensor, gate: torch.Tensor | None, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, n_attn: int, pos0: int) -> torch.Tensor:
    """Causal GQA attention of one sequence on host tensors (csrc/cpu/attention.cpp): q [T, Hq, d]
    and gate [T, Hq, d] (views: unit stride in d), query t at position pos0 + t; caches [n_ctx,
    Hkv, X] contiguous rows of one KV type (native.kv_cache: f32, or f16 / q8_0 / q4_0 unpacked a
    row at a time as read, value for value as KVType.dequantize), the first n_attn rows attended,
    key l visible to query t iff l <= pos0 + t -> softmax(q k^T / sqrt(d)) v * sigmoid(gate),
    [T, Hq*d]. d % 16 == 0, d <= 512."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    for name, u in (("q", q), ("gate", gate)):
        if u is not None and (u.dtype != torch.float32 or u.stride(2) != 1 or tuple(u.shape) != (t, hq, d)):
            raise NativeError(f"attention: {name} must be float32 [T, Hq, d] with unit stride in d")
    kvt = _cpu_caches(k_cache, v_cache, d, "attention")
    out = torch.empty(t, hq * d, dtype=torch.float32)
    g = (gate.data_ptr(), gate.stride(0), gate.stride(1)) if gate is not None else (0, 0, 0)
    _cpu.attention(q.data_ptr(), q.stride(0), q.stride(1), *g, k_cache.data_ptr(),
                   v_cache.data_ptr(), n_attn, pos0, t, hq, hkv, d, out.data_ptr(), 0,
                   **({"kv_type": kvt.code} if kvt.code else {}))
    return out


_INV_FREQ: dict[tuple[int, float], torch.Tensor] = {}


def rope_inv_freq(n_rot: int, base: float) -> torch.Tensor:
    """RoPE's n_rot/2 frequencies on the host as layers.rope_neox computes them (the same float32
    arithmetic), kept per (n_rot, base): what the CPU attention kernels are handed."""
    key = (n_rot, float(base))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float32) / n_rot)
    return _INV_FREQ[key]


def cpu_gated_attention(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                        k_norm: torch.Tensor, eps: float, pos0: int, n_rot: int, base: float,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, n_head: int,
                        n_attn: int) -> torch.Tensor:
    """The attention mixer between its projections for T tokens of one sequence on host tensors
    (csrc/cpu/attention.cpp; cuda_attention_step's contract, any T): qg [T, Hq*2d] (per head d
    query then d gate values), k, v [T, Hkv*d] (rows with unit stride); q, k RMS-normed and roped
    at positions pos0 + t, k and v written to the caches [n_ctx, Hkv, X] (contiguous rows of one
    KV type that cpu_attention_reads; packed rows bit for bit as KVType.quantize packs them),
    the first n_attn rows attended -> [T, Hq*d]."""
    t = qg.shape[0]
    n_ctx, hkv, _ = k_cache.shape
    d = k.shape[-1] // hkv
    kvt = _cpu_caches(k_cache, v_cache, d, "gated_attention")
    if pos0 + t > min(n_attn, n_ctx) or qg.shape[1] != n_head * 2 * d:
        raise NativeError("gated_attention: caches with room for the tokens, qg of n_head * 2d a row")
    ld_kv = _ld(k, "gated_attention k")
    if _ld(v, "gated_attention v") != ld_kv:
        raise NativeError("gated_attention: k and v need the same row stride")
    work = torch.empty(t, n_head * d, dtype=torch.float32)
    out = torch.empty(t, n_head * d, dtype=torch.float32)
    _cpu.gated_attention(qg.data_ptr(), _ld(qg, "gated_attention qg"), k.data_ptr(), v.data_ptr(), ld_kv,
                         q_norm.data_ptr(), k_norm.data_ptr(), eps, pos0, t, n_head, hkv, d, n_rot,
                         rope_inv_freq(n_rot, base).data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), n_attn,
                         work.data_ptr(), out.data_ptr(), 0, **({"kv_type": kvt.code} if kvt.code else {}))
    return out


class cpu_threads_held:
    """`with cpu_threads_held(device):` keeps the CPU pool's idle threads spinning (not asleep)
    for a forward on the CPU, whose few hundred kernel calls a token then start without waking
    them; nothing on other devices."""

    def __init__(self, device: torch.device):
        self.on = device.type == "cpu" and hasattr(_cpu, "hold_threads")

    def __enter__(self):
        if self.on:
            _cpu.hold_threads(True)
        return self

    def __exit__(self, *exc):
        if self.on:
            _cpu.hold_threads(False)


# ---- decode-step kernels (csrc/cuda/step.cu; the step_* ones also csrc/cpu/step.cpp) ------------------
# One launch each for a step's small operations; moe_offload.models.layers dispatches to them and
# holds their torch references. Inputs are float32 CUDA tensors; 2-D arguments may be row-strided
# views (a slice of a fused projection's output) as long as each row is contiguous.

def step_kernels_available(t: torch.Tensor) -> bool:
    return t.is_cuda and _cuda is not None and hasattr(_cuda, "delta_rule_steps")


def _ld(t: torch.Tensor, what: str) -> int:
    """Row stride (in floats) of a float32 matrix whose rows are contiguous."""
    if t.dtype != torch.float32 or t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise NativeError(f"{what}: needs float32 rows with unit stride, got {t.dtype} "
                          f"{list(t.shape)} strides {t.stride()}")
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _step_ext(t: torch.Tensor):
    """The extension and stream of a step kernel on t's device (the CPU ones take stream 0)."""
    return (_cuda, _stream(t.device)) if t.is_cuda else (_cpu, 0)


def step_residual_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
                           a: torch.Tensor | None = None, b: torch.Tensor | None = None,
                           s: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H] (contiguous) += a + sigmoid(s) * b in place (b, s optional); -> rms_norm(x) * w.
    On x's device: the CUDA step kernel, or the CPU's (csrc/cpu/step.cpp)."""
    if not x.is_contiguous() or x.dtype != torch.float32:
        raise NativeError("residual_rms_norm: x must be contiguous float32")
    n, h = x.shape
    out = torch.empty_like(x)
    pa, lda = (a.data_ptr(), _ld(a, "residual_rms_norm a")) if a is not None else (0, 0)
    pb, ldb = (b.data_ptr(), _ld(b, "residual_rms_norm b")) if b is not None else (0, 0)
    ps, lds = (s.data_ptr(), _ld(s, "residual_rms_norm s")) if s is not None else (0, 0)
    ext, stream = _step_ext(x)
    ext.residual_rms_norm(x.data_ptr(), n, h, pa, lda, pb, ldb, ps, lds, w.data_ptr(), eps,
                          out.data_ptr(), stream)
    return out


@dataclass(frozen=True)
class SeqTable:
    """Sequences' buffers reached through a device table of their addresses (api.h's SeqTable),
    where a step kernel takes a list of tensors: a step captured on it is bound to the table, not
    to the buffers, so the same graph runs other sequences once the table is rewritten.
    table: int64 on the device; at[s]: the flat index of sequence s's address in it; like: one
    of the buffers, whose shape, dtype and layout stand for all of them."""
    table: torch.Tensor
    at: tuple[int, ...]
    like: torch.Tensor

    def __post_init__(self):
        t = self.table
        if t.dtype != torch.int64 or not t.is_contiguous() or not t.is_cuda:
            raise NativeError("a sequence table must be contiguous int64 on a CUDA device")
        if any(not 0 <= a < t.numel() for a in self.at):
            raise NativeError(f"sequence table places {list(self.at)} outside its "
                              f"{t.numel()} entries")

    def __len__(self) -> int:
        return len(self.at)


def _sequences(states, per: int, what: str) -> tuple[list[int], int, list[int]]:
    """Where a step kernel finds each sequence's state (float32, contiguous, `per` values each):
    (addresses, 0, []) for a list of tensors, ([], table address, places) for a SeqTable."""
    like = [states.like] if isinstance(states, SeqTable) else states
    for st in like:
        if st.dtype != torch.float32 or not st.is_contiguous() or st.numel() != per:
            raise NativeError(f"{what}: each state must be contiguous float32 of {per} values, got "
                              f"{st.dtype} {list(st.shape)}")
    if isinstance(states, SeqTable):
        return [], states.table.data_ptr(), list(states.at)
    return [st.data_ptr() for st in states], 0, []


def _keep_ptr(keep: torch.Tensor | None, n: int, what: str) -> int:
    if keep is None:
        return 0
    if keep.dtype != torch.float32 or not keep.is_contiguous() or keep.numel() < n:
        raise NativeError(f"{what}: keep must be contiguous float32 of at least {n} values")
    return keep.data_ptr()


def cuda_conv_silu_steps(x: torch.Tensor, states: list[torch.Tensor] | SeqTable, w: torch.Tensor,
                         n_tok: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv + SiLU (api.h) over n_tok tokens of each of len(states) sequences in
    one launch: x [S*n_tok, C] (rows s*n_tok + t); states[s] that sequence's [.., C, Kc-1]
    (separate tensors, shifted in place; or a SeqTable of them); keep [n_tok-1, S, C, Kc-1] or
    None: the state after each token but the last -> [S*n_tok, C]."""
    rows, ch = x.shape
    kc = w.shape[1]
    ptrs, table, at = _sequences(states, ch * (kc - 1), "conv_silu_steps")
    if rows != len(states) * n_tok:
        raise NativeError(f"conv_silu_steps: {rows} rows for {len(states)} sequences of {n_tok}")
    y = torch.empty(rows, ch, dtype=torch.float32, device=x.device)
    kp = _keep_ptr(keep, (n_tok - 1) * len(states) * ch * (kc - 1), "conv_silu_steps")
    _cuda.conv_silu_steps(x.data_ptr(), _ld(x, "conv_silu_steps x"), ptrs, w.data_ptr(), ch, kc,
                          n_tok, y.data_ptr(), kp, table, at, _stream(x.device))
    return y


def cuda_delta_rule_steps(y: torch.Tensor, z: torch.Tensor, beta_raw: torch.Tensor,
                          alpha_raw: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor,
                          states: list[torch.Tensor] | SeqTable, norm_w: torch.Tensor,
                          n_k_heads: int, eps: float, n_tok: int,
                          keep: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule + gated norm (api.h) over n_tok tokens of each of len(states)
    sequences in one launch, with one token's arithmetic: y [S*n_tok, q|k|v] after the conv,
    z [.., Hv*dv], beta_raw / alpha_raw [.., Hv], rows s*n_tok + t; states[s] that
    sequence's [.., Hv, dk, dv] (separate tensors, updated in place; or a SeqTable); keep
    [n_tok-1, S, Hv, dk, dv] or None: the state after each token but the last ->
    [S*n_tok, Hv*dv]."""
    hv, dk, dv = (states.like if isinstance(states, SeqTable) else states[0]).shape[-3:]
    ptrs, table, at = _sequences(states, hv * dk * dv, "delta_rule_steps")
    rows = y.shape[0]
    if rows != len(states) * n_tok:
        raise NativeError(f"delta_rule_steps: {rows} rows for {len(states)} sequences of {n_tok}")
    ldg = _ld(beta_raw, "delta_rule_steps beta")
    if _ld(alpha_raw, "delta_rule_steps alpha") != ldg:
        raise NativeError("delta_rule_steps: beta and alpha need the same row stride")
    out = torch.empty(rows, hv * dv, dtype=torch.float32, device=y.device)
    kp = _keep_ptr(keep, (n_tok - 1) * len(states) * hv * dk * dv, "delta_rule_steps")
    _cuda.delta_rule_steps(y.data_ptr(), _ld(y, "delta_rule_steps y"), z.data_ptr(),
                           _ld(z, "delta_rule_steps z"), beta_raw.data_ptr(), alpha_raw.data_ptr(),
                           ldg, ssm_a.data_ptr(), dt_bias.data_ptr(), ptrs, norm_w.data_ptr(), n_tok,
                           n_k_heads, hv, dk, dv, eps, out.data_ptr(), kp, table, at,
                           _stream(y.device))
    return out


def step_route_topk(logits: torch.Tensor, k: int, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> ids [N, k] int32, weights [N, k]: softmax, top-k, renormalised (floor).
    On the logits' device: the CUDA step kernel, or the CPU's."""
    n, e = logits.shape
    ids = torch.empty(n, k, dtype=torch.int32, device=logits.device)
    w = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ext, stream = _step_ext(logits)
    ext.route_topk(logits.data_ptr(), n, _ld(logits, "route_topk"), e, k, floor, ids.data_ptr(),
                   w.data_ptr(), stream)
    return ids, w


def cuda_attention_step(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                        k_norm: torch.Tensor, eps: float, pos: torch.Tensor, n_rot: int, base: float,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, n_head: int,
                        n_attn: int) -> torch.Tensor:
    """One token of gated attention (api.h) for each of B rows at one position: qg [B, Hq*2d]
    (q | gate per head), k, v [B, Hkv*d]; caches [B, n_ctx, Hkv, X] (contiguous f32, f16, q8_0 or
    q4_0 rows of d values, native.kv_cache; d 64, 128, 256 or 512) written at pos (int64 device
    scalar, < n_attn <= n_ctx) -> [B, Hq*d]."""
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise NativeError("attention_step: caches must be contiguous f32, f16, q8_0 or q4_0, pos int64")
    if not 1 <= n_attn <= k_cache.shape[1]:
        raise NativeError(f"attention_step: n_attn must be in [1, n_ctx], got {n_attn}")
    return cuda_attention_many(qg, k, v, q_norm, k_norm, eps, [pos] * k_cache.shape[0], n_rot,
                               base, list(k_cache), list(v_cache), n_head, n_attn)


def cuda_attention_many(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                        k_norm: torch.Tensor, eps: float, pos: list[torch.Tensor], n_rot: int,
                        base: float, k_caches: list[torch.Tensor] | SeqTable,
                        v_caches: list[torch.Tensor] | SeqTable, n_head: int, n_attn: int,
                        write_first: bool = False) -> torch.Tensor:
    """One token of gated attention (api.h) for each of S entries with caches and positions of
    their own, in one launch: rows s of qg [S, Hq*2d], k, v [S, Hkv*d]; k_caches[s], v_caches[s]
    [.., n_ctx, Hkv, X] (contiguous, one KV type of native.kv_cache: f32, f16, q8_0 or q4_0
    rows of d values; or SeqTables of one table); pos[s] int64 device
    scalars; n_attn the most rows any of them attends -> [S, Hq*d]. write_first: every entry's
    k, v rows are written before any entry attends, so entries may share a cache (tokens of one
    sequence)."""
    tabled = isinstance(k_caches, SeqTable)
    if tabled != isinstance(v_caches, SeqTable) or (
            tabled and k_caches.table.data_ptr() != v_caches.table.data_ptr()):
        raise NativeError("attention_steps: K and V caches both as lists or both in one table")
    ks, vs = ([k_caches.like], [v_caches.like]) if tabled else (k_caches, v_caches)
    hkv, width = ks[0].shape[-2:]
    d = k.shape[-1] // hkv
    kvt = _kv_type_or_none(ks[0], d)
    rb = kvt.row_bytes(d) if kvt is not None else 1
    align = min(16, rb & -rb)     # the kernel's widest load of a row: a power of two dividing rb
    if kvt is None or kvt.row_width(d) != width or any(
            c.dtype != ks[0].dtype or c.shape[-2:] != (hkv, width) or not c.is_contiguous()
            or c.data_ptr() % align for c in (*ks, *vs)) or any(p.dtype != torch.int64 for p in pos):
        raise NativeError("attention_steps: caches must be contiguous, aligned f32, f16, q8_0 or "
                          "q4_0 rows of one type and head size, positions int64")
    if not len(pos) == len(k_caches) == len(v_caches) == qg.shape[0]:
        raise NativeError("attention_steps: one row, position and pair of caches a sequence")
    ldkv = _ld(k, "attention_steps k")
    if _ld(v, "attention_steps v") != ldkv:
        raise NativeError("attention_steps: k and v need the same row stride")
    n = len(pos)
    out = torch.empty(n, n_head * d, dtype=torch.float32, device=qg.device)
    work = torch.empty(n * n_head * _cuda.attention_splits(n_attn) * (d + 2), dtype=torch.float32,
                       device=qg.device)
    _cuda.attention_steps(qg.data_ptr(), _ld(qg, "attention_steps qg"), k.data_ptr(), v.data_ptr(),
                          ldkv, q_norm.data_ptr(), k_norm.data_ptr(), eps,
                          [p.data_ptr() for p in pos], n_rot, base,
                          [] if tabled else [c.data_ptr() for c in k_caches],
                          [] if tabled else [c.data_ptr() for c in v_caches], kvt.code,
                          n_attn, n_head, hkv, d, work.data_ptr(), out.data_ptr(), write_first,
                          k_caches.table.data_ptr() if tabled else 0,
                          list(k_caches.at) if tabled else [], list(v_caches.at) if tabled else [],
                          _stream(qg.device))
    return out


def step_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [N, F] views with the same row stride, on their device: the CUDA step
    kernel, or the CPU's (rows over the pool)."""
    n, f = gate.shape
    ld = _ld(gate, "swiglu gate")
    if _ld(up, "swiglu up") != ld:
        raise NativeError("swiglu: gate and up need the same row stride")
    out = torch.empty(n, f, dtype=torch.float32, device=gate.device)
    ext, stream = _step_ext(gate)
    ext.swiglu(gate.data_ptr(), up.data_ptr(), ld, n, f, out.data_ptr(), stream)
    return out


def softmax_tile_available(t: torch.Tensor) -> bool:
    """Whether the CUDA extension has the prompt tiles' softmax kernel for t's device."""
    return t.is_cuda and _cuda is not None and hasattr(_cuda, "softmax_tile")


def softmax_tile_(s: torch.Tensor, m: torch.Tensor, l: torch.Tensor, j0: int = 0,
                  pos: torch.Tensor | None = None) -> torch.Tensor:
    """One tile of a prompt chunk's online softmax, on the GPU (csrc/cuda/softmax_tile.cu).
    s [..., R, n] float32 scores, contiguous; m, l [..., R, 1] contiguous running max and sum.
    In place: s becomes p = exp(s - m_new), m becomes m_new = max(m, row max), l becomes
    l * corr + sum p. pos [T] int64 (rows are g * T + t): row r's columns past pos[r % T] - j0
    are masked. Returns corr = exp(m_old - m_new), shaped as m."""
    rows, n = s.numel() // max(1, s.shape[-1]), s.shape[-1]
    if not (s.is_cuda and s.device == m.device == l.device
            and s.dtype == m.dtype == l.dtype == torch.float32 and s.is_contiguous()
            and m.is_contiguous() and l.is_contiguous() and m.numel() == l.numel() == rows):
        raise NativeError("softmax_tile: scores [.., R, n] and m, l [.., R, 1] must be contiguous "
                          "float32 tensors on one CUDA device")
    if pos is not None and (pos.dtype != torch.int64 or not pos.is_contiguous() or pos.numel() == 0
                            or rows % pos.numel() or pos.device != s.device):
        raise NativeError("softmax_tile: positions must be a contiguous int64 [T] on the scores' "
                          "device, T dividing the rows")
    corr = torch.empty_like(m)
    _cuda.softmax_tile(s.data_ptr(), rows, n, n, m.data_ptr(), l.data_ptr(), corr.data_ptr(),
                       0 if pos is None else pos.data_ptr(), 0 if pos is None else pos.numel(), j0,
                       _stream(s.device))
    return corr
