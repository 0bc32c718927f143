"""The GPU expert cache: per-layer slot pools and the residency tables the kernels index.

Placement only: it holds memory and answers small questions (`resident`, `admit`, `warm_start`
with pinning); the scheduler and the device-side plan and prefetch kernels decide what moves.
Sizes are fixed at start (elastic resizing is not built yet). The tables live on
the device so a captured decode step can look experts up and replace them with no host round
trip (recency first, frequency as tie-breaker; pinned slots hold a warm-start hot set).

Legend: L MoE layers, E experts, S slots per layer (max).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import OffloadError
from .host_bank import ExpertLayout, HostExpertBank

STATS = ("hits", "fetched", "cpu", "prefetch_hits", "prefetched")  # csrc/offload_exchange.h


@dataclass
class CacheStats:
    hits: np.ndarray      # [L] expert selections served from VRAM (prefetched ones included)
    fetched: np.ndarray   # [L] misses fetched over PCIe into a slot
    cpu: np.ndarray       # [L] misses computed on the CPU
    prefetched: np.ndarray     # [L] experts copied in ahead of their layer on a guess
    prefetch_hits: np.ndarray  # [L] selections served by such a copy

    @property
    def prefetch_precision(self) -> float:
        """Share of prefetched experts that their layer then used."""
        n = int(self.prefetched.sum())
        return float(self.prefetch_hits.sum()) / n if n else 0.0

    @property
    def prefetch_recall(self) -> float:
        """Share of the would-be misses (prefetch hits + misses) that prefetching turned into hits."""
        n = int(self.prefetch_hits.sum() + self.fetched.sum() + self.cpu.sum())
        return float(self.prefetch_hits.sum()) / n if n else 0.0

    @property
    def selections(self) -> int:
        return int(self.hits.sum() + self.fetched.sum() + self.cpu.sum())

    @property
    def hit_rate(self) -> float:
        n = self.selections
        return float(self.hits.sum()) / n if n else 0.0


class ExpertCache:
    def __init__(self, layouts: list[ExpertLayout], slots: list[int], n_expert: int,
                 device: torch.device):
        self.layouts, self.n_expert, self.device = layouts, n_expert, device
        self.n_layer = len(layouts)
        self.max_slots = max(1, max(slots))
        self.pools = [torch.empty((s, lay.expert_bytes), dtype=torch.uint8, device=device)
                      for s, lay in zip(slots, layouts)]
        L, E, S = self.n_layer, n_expert, self.max_slots
        i32 = dict(dtype=torch.int32, device=device)
        self.slot_of_expert = torch.full((L, E), -1, **i32)
        self.expert_of_slot = torch.full((L, S), -1, **i32)
        self.slot_last_use = torch.zeros((L, S), **i32)
        self.slot_pinned = torch.zeros((L, S), **i32)
        self.expert_freq = torch.zeros((L, E), **i32)
        self.n_slots = torch.tensor(slots, **i32)
        self.stats = torch.zeros((L, len(STATS)), **i32)

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def slots(self) -> list[int]:
        return [p.shape[0] for p in self.pools]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.pools)

    @staticmethod
    def plan_slots(layouts: list[ExpertLayout], budget_bytes: int, n_expert: int) -> list[int]:
        """Split a byte budget into per-layer slot counts, evenly by count, capped at E."""
        per_layer = max(lay.expert_bytes for lay in layouts)
        n = min(n_expert, budget_bytes // (per_layer * len(layouts)))
        return [int(n)] * len(layouts)

    # -- host-driven placement (warm start, tests) -------------------------------------------------
    def resident(self, layer: int) -> np.ndarray:
        """Expert ids resident in `layer` (host copy of the table)."""
        soe = self.slot_of_expert[layer].cpu().numpy()
        return np.nonzero(soe >= 0)[0]

    def admit(self, layer: int, experts: list[int], bank: HostExpertBank, pin: bool = False) -> int:
        """Copy `experts` of `layer` into free slots (warm start); returns how many were placed."""
        eos = self.expert_of_slot[layer].cpu().numpy()
        soe = self.slot_of_expert[layer].cpu().numpy()
        free = [s for s in range(self.slots[layer]) if eos[s] < 0]
        placed = 0
        for e in experts:
            if soe[e] >= 0 or not free:
                continue
            s = free.pop(0)
            self.pools[layer][s].copy_(bank.expert(layer, e), non_blocking=True)
            eos[s], soe[e] = e, s
            if pin:
                self.slot_pinned[layer, s] = 1
            placed += 1
        self.expert_of_slot[layer].copy_(torch.from_numpy(eos))
        self.slot_of_expert[layer].copy_(torch.from_numpy(soe))
        return placed

    def warm_start(self, bank: HostExpertBank, profile: np.ndarray | None = None,
                   pin_fraction: float = 0.25) -> None:
        """Fill every layer: the profile's hottest experts first (the top `pin_fraction` of the
        slots pinned), else experts 0, 1, 2, ... so decoding starts with a full cache."""
        for L in range(self.n_layer):
            order = (np.argsort(-profile[L], kind="stable") if profile is not None
                     else np.arange(self.n_expert))
            n = self.slots[L]
            n_pin = int(n * pin_fraction) if profile is not None else 0
            self.admit(L, order[:n_pin].tolist(), bank, pin=True)
            self.admit(L, order[n_pin:n].tolist(), bank)
            if profile is not None:
                self.expert_freq[L].copy_(torch.from_numpy(profile[L].astype(np.int32)))

    # -- statistics --------------------------------------------------------------------------------
    def read_stats(self) -> CacheStats:
        s = self.stats.cpu().numpy().astype(np.int64)
        return CacheStats(hits=s[:, 0], fetched=s[:, 1], cpu=s[:, 2], prefetch_hits=s[:, 3],
                          prefetched=s[:, 4])

    def reset_stats(self) -> None:
        self.stats.zero_()

    def routing_counts(self) -> np.ndarray:
        """[L, E] selections seen since start: the routing profile to save."""
        return self.expert_freq.cpu().numpy()


def save_profile(path: str | Path, counts: np.ndarray, model_name: str = "") -> None:
    """A routing profile: per layer, how often each expert was chosen."""
    Path(path).write_text(json.dumps({"model": model_name, "counts": counts.tolist()}))


def load_profile(path: str | Path, n_layer: int, n_expert: int) -> np.ndarray:
    try:
        d = json.loads(Path(path).read_text())
        counts = np.asarray(d["counts"], dtype=np.int64)
    except (OSError, ValueError, KeyError) as exc:
        raise OffloadError(f"{path}: not a routing profile ({exc}); write one with "
                           "`ftpatch bench --save-profile`") from None
    if counts.shape != (n_layer, n_expert):
        raise OffloadError(f"{path}: profile is for {counts.shape[0]} layers x {counts.shape[1]} "
                           f"experts, the model has {n_layer} x {n_expert}")
    return counts
