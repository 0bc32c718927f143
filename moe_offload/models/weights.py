"""Weights on a device: QTensors for everything a matmul reads, float tensors for the vectors
used elementwise, and the routed-expert banks behind an injectable call.

The expert interface the offload runtime implements (one object per layer):

    experts[layer](x, ids, weights) -> y
        x [N, H] float32 (on the model's device), ids [N, K] int64, weights [N, K] float32
        -> y [N, H] float32 on x's device: sum_k weights[n,k] * expert_{ids[n,k]}(x[n])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import numpy as np
import torch

from loaders import LoadedModel
from native import ops
from native.ops import QTensor

# Tensors used elementwise (never by a matmul): kept as float32 tensors.
_ELEMENTWISE = ("norm.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a")
_EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_up_exps.weight",
            "ffn_down_exps.weight")


class Experts(Protocol):
    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class ResidentExperts:
    """All experts of one layer in one place: gate, up [E, F, H], down [E, H, F].

    If the banks live on another device than x (experts left on the host), x goes there and the
    result comes back: the plain, unscheduled offload path.
    """

    gate: QTensor
    up: QTensor
    down: QTensor

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        dev = self.gate.device
        if x.device == dev:
            return ops.moe_ffn(x, self.gate, self.up, self.down, ids, weights)
        y = ops.moe_ffn(x.to(dev), self.gate, self.up, self.down, ids.to(dev), weights.to(dev))
        return y.to(x.device)


def split_gate_up(gate_up: QTensor) -> tuple[QTensor, QTensor]:
    """A fused bank [E, 2F, H] (gate rows first, then up, per expert) -> gate, up [E, F, H].

    Strided views when native.ops supports them (`QTensor.rows`), else one contiguous copy.
    """
    E, F2, H = gate_up.shape
    half = F2 // 2
    if hasattr(gate_up, "rows"):
        return gate_up.rows(0, half), gate_up.rows(half, F2)
    rows = gate_up.data.view(E, F2, -1)
    name = gate_up.name.replace("gate_up", "{}")
    return tuple(QTensor(rows[:, s:s + half].reshape(E * half, -1).contiguous(), gate_up.qtype,
                         (E, half, H), name.format(part))
                 for s, part in ((0, "gate"), (half, "up")))


def repack_cpu_weights(tensors: dict, experts: Sequence[ResidentExperts], mode: str = "auto"
                       ) -> tuple[dict, list[ResidentExperts]]:
    """The host-RAM weights the CPU multiplies -- expert banks, the layers' projections, the
    output head; not the token embedding, which is read by rows -- rewritten into the CPU's
    repacked form of their type where it has one (native.ops.cpu_form: IQ3_S -> IQ3_S_N4; the
    same bits from every kernel, no table lookups, 22% more bytes, in new memory: the file's
    pages can then leave the page cache). mode "off", "on", or "auto": unless host RAM would keep
    less than 2 GiB free. Returns new (tensors, experts); the inputs are left as they were."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"cpu_repack {mode!r}: give auto, on or off")

    def wanted(q) -> bool:
        return (isinstance(q, QTensor) and q.device.type == "cpu" and len(q.shape) in (2, 3)
                and ops.cpu_form(q.qtype) is not None)
    dense = [k for k, q in tensors.items() if k != "token_embd.weight" and wanted(q)]
    banks = [(i, k, q) for i, ex in enumerate(experts) for k, q in
             (("gate", ex.gate), ("up", ex.up), ("down", ex.down)) if wanted(q)]
    if mode == "off" or not (dense or banks):
        return tensors, list(experts)
    if mode == "auto":
        from ..memory import host_ram_keeps
        todo = [tensors[k] for k in dense] + [q for _, _, q in banks]
        need = sum(int(np.prod(q.shape[:-1])) * ops.cpu_form(q.qtype).row_bytes(q.shape[-1]) for q in todo)
        if not host_ram_keeps(need, 2 << 30):
            return tensors, list(experts)
    tensors = {**tensors, **{k: ops.repack_for_cpu(tensors[k]) for k in dense}}
    out = [dict(gate=ex.gate, up=ex.up, down=ex.down) for ex in experts]
    for i, k, q in banks:
        out[i][k] = ops.repack_for_cpu(q)
    return tensors, [ResidentExperts(**d) for d in out]


ARENA_ALIGN = 256   # bytes: every dtype's alignment, and what the kernels' vector loads want


def _pack(tensors: dict, names: Sequence[str], device: torch.device) -> None:
    """Copy the named CPU weights into one device allocation and replace them (in `tensors`)
    by views of it. Uploaded one by one, each 1-10 MB weight would sit in a 20 MiB segment of
    the caching allocator, and the pieces left between them stay reserved: 122 MiB of 1,066
    on the 35B, two expert-cache slots a layer."""
    def raw(t) -> torch.Tensor:
        return t.data if isinstance(t, QTensor) else t
    offsets, total = [], 0
    for n in names:
        offsets.append(total)
        total += -(-raw(tensors[n]).nbytes // ARENA_ALIGN) * ARENA_ALIGN
    arena = torch.empty(total, dtype=torch.uint8, device=device)
    for n, off in zip(names, offsets):
        t = tensors[n]
        src = raw(t).contiguous()
        dst = arena[off:off + src.nbytes].view(src.dtype).view(src.shape)
        dst.copy_(src)
        tensors[n] = QTensor(dst, t.qtype, t.shape, t.name, t.parts) if isinstance(t, QTensor) else dst


def _fuse_rows(model: LoadedModel, fuse: Mapping[str, Sequence[str]]
               ) -> tuple[dict[str, QTensor], set[str]]:
    """({"blk.N.<key>": QTensor}, the member names it replaces) for every layer holding all projections of a `fuse` group
    (key -> member names) with one type and input width: their rows concatenated on the host,
    so one matmul replaces several and the device never holds both forms."""
    out: dict[str, QTensor] = {}
    replaced: set[str] = set()
    for layer in range(model.config.n_layer):
        p = f"blk.{layer}."
        for key, members in fuse.items():
            ws = [model.weights.get(p + m) for m in members]
            if any(w is None for w in ws) or len({(w.qtype.name, w.shape[-1]) for w in ws}) != 1:
                continue
            rows = [int(np.prod(w.shape[:-1], dtype=np.int64)) if len(w.shape) > 1 else 1 for w in ws]
            data = np.concatenate([np.asarray(w.data).view(np.uint8).reshape(r, -1)
                                   for w, r in zip(ws, rows)])
            out[p + key] = QTensor(torch.from_numpy(data), ws[0].qtype,
                                   (sum(rows), int(ws[0].shape[-1])), p + key, tuple(rows))
            replaced.update(p + m for m in members)
    return out, replaced


def upload_weights(model: LoadedModel, device: torch.device | str = "cpu",
                   experts_device: torch.device | str | None = None,
                   fuse: Mapping[str, Sequence[str]] | None = None,
                   keep_on_host: Sequence[str] = ()
                   ) -> tuple[dict[str, QTensor | torch.Tensor], list[ResidentExperts]]:
    """LoadedModel -> ({GGUF name: QTensor or f32 vector}, per-layer ResidentExperts).

    Dense weights go to `device` (zero-copy from the file's memory map on the CPU); expert
    banks to `experts_device` (default: the same device; "cpu" keeps them in host RAM).
    `fuse` (key -> names of projections of one input): such groups are uploaded as one weight
    "blk.N.<key>" (QTensor.parts gives the split) in place of their members; on the CPU that
    copies them out of the memory map, so callers fuse for GPUs only. Weights named in
    `keep_on_host` stay CPU QTensors over the memory map (the offload runtime pins them).
    """
    device = torch.device(device)
    edev = torch.device(experts_device) if experts_device is not None else device
    cpu = torch.device("cpu")
    tensors: dict[str, QTensor | torch.Tensor] = {}
    banks: dict[int, dict[str, QTensor]] = {}
    fused, members = _fuse_rows(model, fuse) if fuse else ({}, set())
    tensors.update(fused)
    for name, w in model.weights.items():   # dense weights on the CPU first, then packed
        if name in members:
            continue
        if name.endswith(_EXPERTS):
            layer, kind = int(name.split(".")[1]), name.split(".")[2]
            banks.setdefault(layer, {})[kind] = QTensor.from_weight(w, edev)
        elif name.endswith(_ELEMENTWISE):
            t = ops.dequantize(w.data, w.qtype, w.shape)
            tensors[name] = t.to(dtype=torch.float32, copy=True)
        elif name.endswith("ffn_gate_inp_shexp.weight"):  # [H] or [1, H]: a one-row matmul
            tensors[name] = QTensor.from_numpy(w.data, w.qtype, (1, w.shape[-1]), name)
        else:
            tensors[name] = QTensor.from_weight(w, cpu)
    if device.type != "cpu":
        _pack(tensors, [n for n in tensors if n not in keep_on_host], device)
    experts = []
    for layer in range(model.config.n_layer):
        b = banks[layer]
        if "ffn_gate_up_exps" in b:
            gate, up = split_gate_up(b["ffn_gate_up_exps"])
        else:
            gate, up = b["ffn_gate_exps"], b["ffn_up_exps"]
        experts.append(ResidentExperts(gate, up, b["ffn_down_exps"]))
    return tensors, experts


def upload_mtp(model: LoadedModel, device: torch.device | str = "cpu",
               experts_device: torch.device | str | None = None
               ) -> tuple[dict[str, QTensor | torch.Tensor], ResidentExperts] | None:
    """The MTP / NextN block the loader kept aside (loaders.model.mtp_weights checks it) ->
    ({name after "blk.N.": QTensor or f32 vector}, its ResidentExperts), or None when the file
    has none. Same conventions as upload_weights (no fusing: one layer, few launches)."""
    from loaders.model import mtp_weights
    ws = mtp_weights(model)
    if not ws:
        return None
    device = torch.device(device)
    edev = torch.device(experts_device) if experts_device is not None else device
    prefix = next(iter(ws))[:next(iter(ws)).index(".", 4) + 1]
    tensors: dict[str, QTensor | torch.Tensor] = {}
    for name, w in ws.items():
        key = name[len(prefix):]
        if name.endswith(_EXPERTS):
            continue
        elif name.endswith(_ELEMENTWISE):
            tensors[key] = ops.dequantize(w.data, w.qtype, w.shape).to(dtype=torch.float32,
                                                                       copy=True)
        elif name.endswith("ffn_gate_inp_shexp.weight"):
            tensors[key] = QTensor.from_numpy(w.data, w.qtype, (1, w.shape[-1]), name)
        else:
            tensors[key] = QTensor.from_weight(w, torch.device("cpu"))
    if device.type != "cpu":
        _pack(tensors, list(tensors), device)
    return tensors, mtp_experts(model, edev)


def mtp_experts(model: LoadedModel, device: torch.device | str = "cpu") -> ResidentExperts | None:
    """The MTP block's routed expert banks on `device` ("cpu": over the file's memory map), or
    None when the file has none."""
    from loaders.model import mtp_weights
    bank = {name.split(".")[2]: QTensor.from_weight(w, device)
            for name, w in mtp_weights(model).items() if name.endswith(_EXPERTS)}
    if not bank:
        return None
    if "ffn_gate_up_exps" in bank:
        gate, up = split_gate_up(bank["ffn_gate_up_exps"])
    else:
        gate, up = bank["ffn_gate_exps"], bank["ffn_up_exps"]
    return ResidentExperts(gate, up, bank["ffn_down_exps"])
