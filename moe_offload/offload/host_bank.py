"""Host expert banks: every routed expert's gate, up and down blocks contiguous in host RAM.

One uint8 tensor per MoE layer, [E, expert_bytes]; an expert is [gate | up | down], each part
256-byte aligned, so one copy moves one expert and the GPU's cache slots use the same layout.
Types may differ per layer and per projection, as in published files. The banks are filled
from the GGUF's memory map by parallel threads and page-locked (pinned) for the GPU, which then
reads them directly over PCIe; where pinning fails they stay pageable, with a warning. They live
in one anonymous mapping advised to use 2 MiB pages where the kernel allows: the GPU's reads then
need fewer address translations (docs/BENCHMARKS.md has the figures).

Legend: E experts, F expert ff, H hidden.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from loaders import LoadedModel, Weight
from loaders.quants import QuantType

from ..errors import OffloadError
from .. import memory

ALIGN = 256
HUGE_PAGE = 2 << 20


def host_buffer(nbytes: int) -> torch.Tensor:
    """nbytes of host memory as a flat uint8 tensor, from an anonymous mapping advised to use
    huge pages and aligned to one (plain torch memory where the system offers no such advice)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)
    except OSError:   # THP disabled ("never"): 4 KiB pages, as torch would give
        pass
    flat = torch.frombuffer(mapping, dtype=torch.uint8)   # keeps the mapping alive
    skip = (-flat.data_ptr()) % HUGE_PAGE
    return flat[skip:skip + nbytes]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ProjLayout:
    """Where one projection of an expert sits inside the expert's bytes."""

    qtype: QuantType
    rows: int          # output features (F for gate/up, H for down)
    cols: int          # input features
    offset: int        # bytes from the expert's start
    nbytes: int        # rows * row_bytes


@dataclass(frozen=True)
class ExpertLayout:
    """One layer's expert byte layout (shared by host banks and GPU cache slots)."""

    gate: ProjLayout
    up: ProjLayout
    down: ProjLayout
    expert_bytes: int  # gate + up + down, each aligned

    def banks(self, base: int, stride: int) -> tuple[tuple[int, int, int], ...]:
        """(type id, address, expert stride) of gate, up and down for experts laid out from
        address `base`, one every `stride` bytes (a host bank row, a cache slot, a staging row)."""
        return tuple((p.qtype.type_id, base + p.offset, stride) for p in (self.gate, self.up, self.down))

    @property
    def key(self) -> tuple:
        """Layers with equal keys can share a slot pool."""
        return tuple((p.qtype.name, p.rows, p.cols) for p in (self.gate, self.up, self.down))


def _expert_sources(model: LoadedModel, layer: int) -> tuple[list, ExpertLayout]:
    """[(np view [E, rows, row_bytes] of each projection)], layout. Fused gate_up is split."""
    b = f"blk.{layer}."
    w = model.weights
    c = model.config
    E, F, H = c.n_expert, c.n_ff_exp, c.n_embd

    def view(wt: Weight, rows: int, row0: int = 0) -> np.ndarray:
        rows_total = wt.shape[1]
        arr = wt.data.reshape(E, rows_total, -1)
        return arr[:, row0:row0 + rows]

    if b + "ffn_gate_up_exps.weight" in w:
        gu = w[b + "ffn_gate_up_exps.weight"]
        srcs = [(gu.qtype, view(gu, F, 0)), (gu.qtype, view(gu, F, F))]
    else:
        g, u = w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"]
        srcs = [(g.qtype, view(g, F)), (u.qtype, view(u, F))]
    d = w[b + "ffn_down_exps.weight"]
    srcs.append((d.qtype, view(d, H)))
    lay = _layout([(qt, rows, cols) for (qt, _), (rows, cols) in zip(srcs, ((F, H), (F, H), (H, F)))])
    return [a for _, a in srcs], lay


def _layout(projs: list[tuple[QuantType, int, int]]) -> ExpertLayout:
    """The layout of an expert's gate, up and down, given as (type, rows, cols): each part
    256-byte aligned, in that order."""
    off, parts = 0, []
    for qt, rows, cols in projs:
        nbytes = rows * qt.row_bytes(cols)
        parts.append(ProjLayout(qt, rows, cols, off, nbytes))
        off += _align(nbytes)
    return ExpertLayout(*parts, expert_bytes=off)


class HostExpertBank:
    """All layers' expert banks in host RAM (pinned where possible)."""

    def __init__(self, model: LoadedModel, *, pin: bool = True, threads: int | None = None,
                 progress: Callable[[int, int], None] | None = None):
        c = model.config
        self.n_layer, self.n_expert = c.n_layer, c.n_expert
        srcs, self.layouts = [], []
        for L in range(c.n_layer):
            s, lay = _expert_sources(model, L)
            srcs.append(s)
            self.layouts.append(lay)
        self.nbytes = sum(lay.expert_bytes * self.n_expert for lay in self.layouts)
        avail = memory.host_ram_available()
        if avail is not None and self.nbytes > avail * 0.9:
            raise OffloadError(
                f"the expert banks need {self.nbytes / 2**30:.1f} GiB of host RAM but only "
                f"{avail / 2**30:.1f} GiB is available; close other programs or use a smaller "
                "quantization")
        t0 = time.perf_counter()
        self._flat = flat = host_buffer(self.nbytes)   # pinned as one range (pages are shared
        self.banks, at = [], 0                          # where two layers' banks meet)
        for lay in self.layouts:   # each layer's bank starts 256-byte aligned (expert_bytes is)
            n = self.n_expert * lay.expert_bytes
            self.banks.append(flat[at:at + n].view(self.n_expert, lay.expert_bytes))
            at += n
        self._fill(srcs, threads, progress)
        self.load_seconds = time.perf_counter() - t0
        self.pinned = False
        self.pin_seconds = 0.0
        self.cpu_banks: list[torch.Tensor] | None = None   # repack_for_cpu's copy
        self.cpu_layouts: list[ExpertLayout] | None = None
        if pin and torch.cuda.is_available():
            self._pin()

    # -- loading ---------------------------------------------------------------------------------
    def _fill(self, srcs: list, threads: int | None, progress) -> None:
        jobs = []
        step = 32  # experts per job: ~40 MB at the 35B shapes
        for L, (bank, lay) in enumerate(zip(self.banks, self.layouts)):
            dst = bank.numpy()
            for e0 in range(0, self.n_expert, step):
                jobs.append((L, e0, min(self.n_expert, e0 + step), dst, srcs[L], lay))
        total, done = self.nbytes, 0
        lock = threading.Lock()

        def copy(job) -> int:
            L, e0, e1, dst, src, lay = job
            for arr, p in zip(src, (lay.gate, lay.up, lay.down)):
                part = arr[e0:e1].reshape(e1 - e0, -1)  # [n, rows*row_bytes] (copies if strided)
                dst[e0:e1, p.offset:p.offset + p.nbytes] = part
            return (e1 - e0) * lay.expert_bytes

        n = threads or min(16, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=n) as pool:
            for nbytes in pool.map(copy, jobs):
                with lock:
                    done += nbytes
                if progress:
                    progress(done, total)

    def _pin(self) -> None:
        from native import offload_native
        t0 = time.perf_counter()
        try:
            offload_native.pin_host(self._flat)
            self.pinned = True
        except Exception as exc:  # page-locking can fail (ulimit -l, containers): run pageable
            offload_native.unpin_host(self._flat, missing_ok=True)
            warnings.warn(f"could not page-lock the expert banks ({exc}); running from pageable "
                          "memory: the GPU cannot read experts over PCIe, so misses run on the CPU "
                          "and prefill copies at ~19 GB/s instead of ~50", RuntimeWarning)
        self.pin_seconds = time.perf_counter() - t0

    # -- the CPU's copy -----------------------------------------------------------------------------
    def repack_for_cpu(self, mode: str = "auto", progress: Callable[[int, int], None] | None = None) -> bool:
        """Give the CPU its own copy of the experts whose types have a repacked CPU form
        (native.ops.cpu_form: IQ3_S -> IQ3_S_N4, same bits, no table lookups, 22% more bytes).
        The GPU keeps reading the file's form from the pinned banks. mode "on", "off", or
        "auto": only where host RAM keeps room beside it (max(4 GiB, a tenth of RAM) left).
        Returns whether a copy was made; `cpu_layouts` / `cpu_bank_args` then describe it."""
        from native import ops
        if mode not in ("auto", "on", "off"):
            raise OffloadError(f"cpu_repack {mode!r}: give auto, on or off")
        if mode == "off":
            return False
        forms = [tuple(ops.cpu_form(p.qtype) for p in (lay.gate, lay.up, lay.down)) for lay in self.layouts]
        if not any(f for fs in forms for f in fs):
            return False
        layouts = [_layout([(f or p.qtype, p.rows, p.cols) for p, f in zip((lay.gate, lay.up, lay.down), fs)])
                   for lay, fs in zip(self.layouts, forms)]
        nbytes = sum(lay.expert_bytes * self.n_expert for lay in layouts)
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if mode == "auto" and not memory.host_ram_keeps(nbytes, max(4 << 30, total // 10)):
            return False
        flat = host_buffer(nbytes)
        banks, at, done = [], 0, 0
        for L, (lay, cl) in enumerate(zip(self.layouts, layouts)):
            n = self.n_expert * cl.expert_bytes
            banks.append(flat[at:at + n].view(self.n_expert, cl.expert_bytes))
            at += n
            for p, c in zip((lay.gate, lay.up, lay.down), (cl.gate, cl.up, cl.down)):
                src = self.banks[L][:, p.offset:p.offset + p.nbytes]
                dst = banks[L][:, c.offset:c.offset + c.nbytes]
                if c.qtype is p.qtype:
                    dst.copy_(src)
                    continue
                ops._cpu.repack(p.qtype.type_id, src.data_ptr(), p.nbytes // p.qtype.block_bytes,
                                dst.data_ptr(), self.n_expert, lay.expert_bytes, cl.expert_bytes)
            done += n
            if progress:
                progress(done, nbytes)
        self._cpu_flat, self.cpu_banks, self.cpu_layouts = flat, banks, layouts
        return True

    def cpu_bank_args(self, layer: int) -> tuple[tuple[int, int, int], ...]:
        """(type id, address, expert stride) of gate, up and down of `layer` as the CPU computes
        them: its repacked copy where repack_for_cpu made one, else the pinned banks."""
        banks, layouts = ((self.banks, self.layouts) if self.cpu_banks is None
                          else (self.cpu_banks, self.cpu_layouts))
        lay = layouts[layer]
        return lay.banks(banks[layer].data_ptr(), lay.expert_bytes)

    # -- access ------------------------------------------------------------------------------------
    def expert(self, layer: int, e: int) -> torch.Tensor:
        """Expert `e` of `layer` as its uint8 bytes [expert_bytes] (a view)."""
        return self.banks[layer][e]

    def __del__(self) -> None:  # pages must be unlocked before torch frees the memory
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        if getattr(self, "pinned", False):
            from native import offload_native
            offload_native.unpin_host(self._flat, missing_ok=True)
            self.pinned = False
        self.cpu_banks = self.cpu_layouts = self._cpu_flat = None
