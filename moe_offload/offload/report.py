"""What the runtime tells its callers: how it loaded, what decoding did, the routing it saw.

Plain objects, no behaviour: `LoadReport` (filled once at start-up), `RuntimeStats` (a snapshot
of the counters since the last reset), `RoutingRecorder` (the expert ids each decode step
routed, written on the device inside the captured step).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch


@dataclass
class LoadReport:
    seconds: dict[str, float] = field(default_factory=dict)
    budget: dict[str, int] = field(default_factory=dict)              # the start-up plan, by purpose
    slots_per_layer: list[int] = field(default_factory=list)          # kept through any prefill
    decode_slots_per_layer: list[int] = field(default_factory=list)   # elastic: while decoding
    pinned: bool = False
    host_weights: dict[str, int] = field(default_factory=dict)   # name -> bytes kept in host RAM
    elastic: bool = False             # the cache lends VRAM to prompts and the KV
    cache_outside_torch: bool = False  # the cache's memory is mapped by us, not torch's allocator
    cpu_repacked_bytes: int = 0       # the CPU's own repacked copy of the experts (0: none)


@dataclass
class RuntimeStats:
    """Counters since the last reset_stats() (decode selections; prefill's streamed experts)."""

    selections: int          # expert choices of decode steps (tokens x MoE layers x top-k)
    hits: int                # served from VRAM (guessed ones included)
    fetched: int             # misses fetched over PCIe into a slot
    cpu: int                 # misses computed on the CPU
    hit_rate: float
    prefetched: int          # experts copied ahead of their layer on a guess
    prefetch_hits: int       # selections served by such a copy
    prefetch_precision: float
    prefetch_recall: float
    pcie_bytes: int          # fetched + prefetched expert bytes
    cpu_expert_s: float      # CPU worker's compute time
    cpu_experts: int         # experts the CPU worker computed
    prefill_streamed: int    # experts prefill streamed through staging (not cached)
    cache_slots: list[int]   # per layer, now
    cache_bytes: int
    kv_bytes: int            # elastic KV mapped now (0: allocated whole)
    fetch_fraction: float    # the scheduler's PCIe share of misses now
    min_fetch: int           # misses a layer always fetches
    rates: dict[str, float]  # link_GBps, cpu_GBps
    per_layer: list[dict]    # layer, hits, fetched, cpu, cpu_s, prefetched, prefetch_hits

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def collect(cls, rt, busy0: np.ndarray, experts0: np.ndarray) -> "RuntimeStats":
        """An OffloadRuntime's counters since the worker read busy0 / experts0 (settled first)."""
        s = rt.cache.read_stats()
        eng, sch = rt.engine, rt.scheduler
        busy = (np.asarray(eng.worker.busy_ns()) - busy0) / 1e9
        cpu_experts = np.asarray(eng.worker.experts()) - experts0
        eb = rt.bank.layouts[0].expert_bytes
        return cls(
            selections=s.selections, hits=int(s.hits.sum()), fetched=int(s.fetched.sum()),
            cpu=int(s.cpu.sum()), hit_rate=s.hit_rate, prefetched=int(s.prefetched.sum()),
            prefetch_hits=int(s.prefetch_hits.sum()), prefetch_precision=s.prefetch_precision,
            prefetch_recall=s.prefetch_recall,
            pcie_bytes=int(s.fetched.sum() + s.prefetched.sum()) * eb,
            cpu_expert_s=float(busy.sum()), cpu_experts=int(cpu_experts.sum()),
            prefill_streamed=int(eng.prefill_streamed.sum()),
            cache_slots=rt.cache.slots, cache_bytes=rt.cache.nbytes,
            kv_bytes=rt.vram.kv_mapped(), fetch_fraction=sch.q(), min_fetch=sch.min_fetch(),
            rates={"link_GBps": sch.rates.link_bytes_per_s / 1e9,
                   "cpu_GBps": sch.rates.cpu_bytes_per_s / 1e9,
                   **({"link_emulated_GBps": eng.link.gbps} if eng.link else {})},
            per_layer=[{"layer": i, "hits": int(s.hits[i]), "fetched": int(s.fetched[i]),
                        "cpu": int(s.cpu[i]), "cpu_s": float(busy[i]),
                        "prefetched": int(s.prefetched[i]), "prefetch_hits": int(s.prefetch_hits[i])}
                       for i in range(len(s.hits))])


class RoutingRecorder:
    """The expert ids each decode step routes (its first token's), one row a step: row
    (step - 1) mod `rows`, so the last `rows` steps are kept. Attach with
    `OffloadRuntime.attach_recorder`; rows never written stay -1. `ids` [rows, L, K] int32 on
    the device (read it after the runtime's next sync point, e.g. stats())."""

    def __init__(self, rows: int = 256):
        if rows < 1:
            raise ValueError(f"a routing recorder needs at least one row, got {rows}")
        self.rows = rows
        self.ids: torch.Tensor | None = None

    def bind(self, n_layer: int, top_k: int, device: torch.device) -> torch.Tensor:
        self.ids = torch.full((self.rows, n_layer, top_k), -1, dtype=torch.int32, device=device)
        return self.ids

    def numpy(self):
        """The recorded rows as an int32 array [rows, L, K]."""
        return self.ids.cpu().numpy()
