"""FreeToken's GGUF expert banks, filled by parallel threads from our GGUF parser.

A drop-in for `freetoken.models.gguf.experts.load_gguf_expert_banks` (same signature, same
`ExpertBanks`, the same bytes in the same bank shapes, the same pin pipeline): FreeToken copies
one layer after another; here the layers' banks are allocated up front and filled by a pool of
threads, a job being a run of experts of one layer, and each layer goes to the pin pipeline as
soon as its last job lands. The model path may be any shard of a split set or a folder.
On a 2-core machine this fills no faster than FreeToken's serial copy (the copy is bound by
faulting in the banks' pages there; pr_notes/1-gguf-header-reader/evidence/bank_load_35b.json),
so it is not offered to FreeToken; more cores and an NVMe queue are where threads can help, not
measured yet.

What FreeToken's own loader still handles (we delegate): `dummy=True` (nothing to read) and
NVFP4 experts with per-expert scale tensors. Gate and up experts of different types are refused
as FreeToken refuses them (its bank holds both in one row shape).

Legend: E experts, I expert ff, H hidden, R row bytes.
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np
import torch

from loaders import open_gguf

THREADS_ENV = "FTPATCH_FT_BANK_THREADS"
JOB_BYTES = 32 << 20   # bytes per job: enough to amortise the thread hand-off, small enough to balance


def bank_threads() -> int:
    env = os.environ.get(THREADS_ENV, "").strip()
    return max(1, int(env)) if env else min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class _Source:
    array: np.ndarray   # [E, rows, R] uint8 view of the mapped file
    path: str
    offset: int
    nbytes: int


@dataclass
class _Layer:
    parts: list[_Source]    # gate, up (or the fused gate_up), placed side by side in gate_up
    down: _Source
    gate_type: int
    down_type: int
    k_gate: int             # input features of gate/up (H)
    k_down: int             # input features of down (I)


def _source(g, name: str) -> tuple[_Source, int, tuple[int, ...]]:
    t = g.tensors[name]
    k, rows, experts = t.ne
    arr = g.data(name).reshape(experts, rows, t.nbytes // (experts * rows))
    return _Source(arr, str(g.paths[t.shard]), t.offset, t.nbytes), t.type_id, t.ne


def _plan(g, num_layers: int, first_layer: int) -> list[_Layer]:
    layers = []
    for layer in range(num_layers):
        blk = f"blk.{first_layer + layer}"
        down, down_type, down_ne = _source(g, f"{blk}.ffn_down_exps.weight")
        if f"{blk}.ffn_gate_up_exps.weight" in g:
            gu, gt, gne = _source(g, f"{blk}.ffn_gate_up_exps.weight")
            parts = [gu]
        else:
            gate, gt, gne = _source(g, f"{blk}.ffn_gate_exps.weight")
            up, ut, _ = _source(g, f"{blk}.ffn_up_exps.weight")
            if gt != ut:
                raise NotImplementedError(f"{blk}: gate and up experts have different ggml types")
            parts = [gate, up]
        layers.append(_Layer(parts, down, gt, down_type, gne[0], down_ne[0]))
    return layers


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """A writable numpy view of a CPU bank's bytes, [E, rows, R]."""
    return t.view(torch.uint8).numpy()


def _drop_page_cache(src: _Source) -> None:
    # as FreeToken does once a layer is copied: the file's pages are not needed twice
    try:
        fd = os.open(src.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, src.offset, src.nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass


def _jobs(layer: int, spec: _Layer, dst: dict[str, torch.Tensor]) -> list[tuple]:
    """(layer, e0, e1, copies) with copies = [(dst [n, rows, R], src [n, rows, R])]."""
    experts = spec.down.array.shape[0]
    per_expert = sum(s.array[0].nbytes for s in (*spec.parts, spec.down))
    step = max(1, JOB_BYTES // max(1, per_expert))
    jobs = []
    for e0 in range(0, experts, step):
        e1 = min(experts, e0 + step)
        copies, col = [], 0
        for s in spec.parts:
            rows = s.array.shape[1]
            copies.append((dst["gate_up"], slice(col, col + rows), s.array[e0:e1]))
            col += rows
        copies.append((dst["down"], slice(None), spec.down.array[e0:e1]))
        jobs.append((layer, e0, e1, copies))
    return jobs


def _run_job(job: tuple, on_cpu: bool) -> int:
    layer, e0, e1, copies = job
    for bank, rows, src in copies:
        if on_cpu:
            np.copyto(_byte_view(bank)[e0:e1, rows], src)
        else:
            raw = torch.from_numpy(np.ascontiguousarray(src))
            view = bank[e0:e1, rows]
            view.copy_(raw.view(view.dtype).view(view.shape))
    return layer


def load_gguf_expert_banks(model_path: str, num_layers: int, *, first_layer: int = 0,
                           dummy: bool = False, device: torch.device | None = None):
    """FreeToken's `ExpertBanks` for a GGUF, the layers filled in parallel (see the module doc)."""
    from freetoken.layers.quantization import QuantKind
    from freetoken.layers.quantization.ggml_types import (float_dtype, has_expert_scales,
                                                          mmq_tail_bytes, type_name)
    from freetoken.models.gguf import experts as ft_experts
    from freetoken.moe.expert_banks import ExpertBanks
    from freetoken.moe.host_banks import HostBank, PinPipeline

    from . import hooks

    original = hooks.original("freetoken.models.gguf.experts", "load_gguf_expert_banks")
    g = open_gguf(model_path)
    if dummy or has_expert_scales({t.name: t.type_id for t in g}):
        return original(str(g.paths[0]), num_layers, first_layer=first_layer, dummy=dummy,
                        device=device)
    plan = _plan(g, num_layers, first_layer)

    banks: list[dict[str, torch.Tensor]] = []
    hosts: list[dict] = []
    tags, tails = [], {"gate_up": [], "down": []}
    for spec in plan:
        gsrc = spec.parts[0].array
        experts, row = gsrc.shape[0], gsrc.shape[2]
        gate_up_shape = (experts, sum(s.array.shape[1] for s in spec.parts), row)
        down_shape = tuple(spec.down.array.shape)
        gdt = float_dtype(spec.gate_type) or torch.uint8
        ddt = float_dtype(spec.down_type) or torch.uint8
        # float experts: rows of K elements, not of R bytes
        gate_up_shape = gate_up_shape[:2] + (row // torch.empty((), dtype=gdt).element_size(),)
        down_shape = down_shape[:2] + (down_shape[2] // torch.empty((), dtype=ddt).element_size(),)
        if device is None:
            host = {"gate_up": HostBank(gate_up_shape, gdt), "down": HostBank(down_shape, ddt)}
            hosts.append(host)
            banks.append({role: b.tensor for role, b in host.items()})
        else:
            banks.append({
                "gate_up": ft_experts._device_bank(gate_up_shape, spec.gate_type, spec.k_gate, gdt, device),
                "down": ft_experts._device_bank(down_shape, spec.down_type, spec.k_down, ddt, device),
            })
        tags.append(("ggml", type_name(spec.gate_type), type_name(spec.down_type)))
        tails["gate_up"].append(mmq_tail_bytes(spec.gate_type, spec.k_gate))
        tails["down"].append(mmq_tail_bytes(spec.down_type, spec.k_down))

    on_cpu = device is None or torch.device(device).type == "cpu"
    jobs = [j for layer, spec in enumerate(plan) for j in _jobs(layer, spec, banks[layer])]
    left = [0] * num_layers
    for j in jobs:
        left[j[0]] += 1
    pins = PinPipeline() if device is None else contextlib.nullcontext()
    with pins, ThreadPoolExecutor(max_workers=bank_threads(),
                                  thread_name_prefix="ftpatch-banks") as pool:
        for fut in as_completed([pool.submit(_run_job, j, on_cpu) for j in jobs]):
            layer = fut.result()
            left[layer] -= 1
            if left[layer] == 0:
                for src in (*plan[layer].parts, plan[layer].down):
                    _drop_page_cache(src)
                if device is None:
                    pins(layer, hosts[layer])
    sources = {role: [b[role] for b in banks] for role in ("gate_up", "down")}
    from freetoken.utils import init_logger
    gib = sum(t.numel() * t.element_size() for ts in sources.values() for t in ts) / 2**30
    init_logger(__name__).info_rank0(
        f"GGUF expert banks (ftpatch, {bank_threads()} threads): {gib:.1f} GiB of {num_layers} "
        f"layers {'in host RAM' if device is None else f'on {device}'}")
    return ExpertBanks("gguf", sources, kind=QuantKind.GGUF, kernel="ggml", layout=None,
                       layer_tags=tags, row_tail_bytes=tails)
