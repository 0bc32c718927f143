"""The GPU expert cache: per-layer slot pools and the residency tables the kernels index.

Placement only: it holds memory and answers small questions (`resident`, `admit`, `warm_start`
with pinning, `resize`); the scheduler and the device-side plan and prefetch kernels decide what
moves, the runtime decides the size. The tables live on
the device so a captured decode step can look experts up and replace them with no host round
trip. Victims go in order of a decayed score (each choice of an expert weighs
OffloadPolicy.score_decay^age, age in decode steps; defined in csrc/offload_exchange.h, mirrored
by native.offload_native.decayed_scores), then of recency; pinned slots hold a warm-start hot set.

Legend: L MoE layers, E experts, S slots per layer (max).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from native import offload_native as on

from ..errors import OffloadError
from .host_bank import ExpertLayout, HostExpertBank
from ..config import OffloadPolicy

STATS = on.STATS_COLUMNS   # the stats table's columns, as the kernels write them


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
    """`slots[L]` usable slots per layer, in `pools[L]` ([capacity, expert bytes] uint8 views).

    Elastic (the default on GPUs that support CUDA virtual memory): each pool reserves address
    space for every expert of its layer and maps memory only behind the slots in use, so
    `resize` can give VRAM back (to a prefill's workspace) and take it again (for decode) while
    kernels and captured graphs keep the pool's address. Otherwise the pools are fixed tensors.
    On the CPU an elastic cache is simulated with full-size tensors (tests of the bookkeeping).
    """

    def __init__(self, layouts: list[ExpertLayout], slots: list[int], n_expert: int,
                 device: torch.device, elastic: bool | None = None,
                 policy: OffloadPolicy = OffloadPolicy()):
        self.layouts, self.n_expert, self.device = layouts, n_expert, device
        self.policy = policy
        self.n_layer = len(layouts)
        if elastic is None:
            elastic = device.type == "cuda" and on.elastic_supported()
        self.elastic = elastic
        self._buffers: list[on.ElasticBuffer] = []
        self.pools: list[torch.Tensor] = []
        self._slots: list[int] = []
        try:
            for s, lay in zip(slots, layouts):
                s = min(int(s), n_expert)
                if elastic and device.type == "cuda":
                    buf = on.ElasticBuffer(n_expert * lay.expert_bytes, s * lay.expert_bytes)
                    self._buffers.append(buf)
                    self.pools.append(buf.view[:n_expert * lay.expert_bytes].view(n_expert, -1))
                else:
                    rows = n_expert if elastic else s
                    self.pools.append(torch.empty((rows, lay.expert_bytes), dtype=torch.uint8,
                                                  device=device))
                self._slots.append(s)
        except BaseException:
            self.close()
            raise
        L, E, S = self.n_layer, n_expert, max(1, max(p.shape[0] for p in self.pools))
        self.max_slots = S
        i32 = dict(dtype=torch.int32, device=device)
        self.slot_of_expert = torch.full((L, E), -1, **i32)
        self.expert_of_slot = torch.full((L, S), -1, **i32)
        self.slot_last_use = torch.zeros((L, S), **i32)
        self.slot_pinned = torch.zeros((L, S), **i32)
        self.expert_freq = torch.zeros((L, E), **i32)
        # eviction scores: decayed choices, fixed point (native.offload_native.decayed_scores)
        self.expert_score = torch.zeros((L, E), **i32)
        self.expert_seen = torch.zeros((L, E), **i32)
        self.score_decay = torch.from_numpy(on.score_decay_table(policy.score_decay)).to(device)
        self.n_slots = torch.tensor(self._slots, **i32)
        self.stats = torch.zeros((L, len(STATS)), **i32)
        self.cpu_pending = torch.zeros(L, **i32)   # experts the plan gave the CPU this step

    def close(self) -> None:
        """Give the elastic pools' memory and address space back (the cache is unusable after)."""
        for b in self._buffers:
            b.close()
        self._buffers = []

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def slots(self) -> list[int]:
        """Usable slots per layer now."""
        return list(self._slots)

    @property
    def capacity(self) -> list[int]:
        """Most slots each layer can have (its pool's rows)."""
        return [p.shape[0] for p in self.pools]

    @property
    def outside_torch(self) -> bool:
        """Whether the pools' memory is ours (mapped by us) rather than torch's allocator's."""
        return bool(self._buffers)

    @property
    def nbytes(self) -> int:
        """Device memory the pools hold now."""
        if self._buffers:
            return sum(b.mapped for b in self._buffers)
        if self.elastic:  # CPU simulation: count what a device would map
            return sum(s * lay.expert_bytes for s, lay in zip(self._slots, self.layouts))
        return sum(p.numel() for p in self.pools)

    def resize(self, slots: list[int]) -> list[int]:
        """Give each layer `slots[L]` slots (at most its capacity; a fixed cache cannot grow) and
        return what each has now. Elastic pools map whole chunks, so up to a chunk a layer may
        be mapped and unused. Shrinking keeps a layer's most valuable experts -- pinned, then
        those of highest score (the eviction order of the plan kernel), then most recently used,
        then most often chosen -- moving them into the slots that remain; the others leave the
        cache. Growing adds empty slots, which misses fill. Synchronizes the device:
        call it between steps. If the device cannot map more memory (another process took it),
        the layers done so far keep their new size, the rest their old one, and the error is
        raised as an OffloadError: the cache stays consistent and usable."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        eos = self.expert_of_slot.cpu().numpy()
        soe = self.slot_of_expert.cpu().numpy()
        last = self.slot_last_use.cpu().numpy()
        pin = self.slot_pinned.cpu().numpy()
        freq = self.expert_freq.cpu().numpy()
        score, seen = self.expert_score.cpu().numpy(), self.expert_seen.cpu().numpy()
        table = self.score_decay.cpu().numpy()
        try:
            for L, want in enumerate(slots):
                new = max(0, min(int(want), self.capacity[L]))
                if new < self._slots[L]:
                    # scores decay alike: their order is the same at any step, e.g. the latest
                    value = on.decayed_scores(score[L], seen[L], int(seen[L].max()), table)
                    self._compact(L, new, eos[L], soe[L], last[L], pin[L], freq[L], value)
                if self._buffers:
                    try:
                        self._buffers[L].resize(new * self.layouts[L].expert_bytes)
                    except RuntimeError as e:
                        raise OffloadError(f"the expert cache could not grow to {new} slots in "
                                           f"layer {L} ({e})") from None
                self._slots[L] = new
        finally:   # the tables describe what is mapped, whatever happened
            for t, a in ((self.expert_of_slot, eos), (self.slot_of_expert, soe),
                         (self.slot_last_use, last), (self.slot_pinned, pin)):
                t.copy_(torch.from_numpy(a))
            self.n_slots.copy_(torch.tensor(self._slots, dtype=torch.int32))
        return self.slots

    def _compact(self, L: int, n: int, eos, soe, last, pin, freq, value) -> None:
        """Keep layer L's n most valuable experts in slots [0, n) (tables edited in place)."""
        pool = self.pools[L]
        occupied = [s for s in range(self._slots[L]) if eos[s] >= 0]
        occupied.sort(key=lambda s: (-pin[s], -value[eos[s]], -last[s], -freq[eos[s]], s))
        for s in occupied[n:]:          # leave the cache
            soe[eos[s]] = -1
            eos[s], last[s], pin[s] = -1, 0, 0
        movers = [s for s in occupied[:n] if s >= n]
        holes = [s for s in range(n) if eos[s] < 0]
        for src, dst in zip(movers, holes):
            pool[dst].copy_(pool[src])
            e = eos[src]
            eos[dst], last[dst], pin[dst], soe[e] = e, last[src], pin[src], dst
            eos[src], last[src], pin[src] = -1, 0, 0
        eos[n:], last[n:], pin[n:] = -1, 0, 0

    @staticmethod
    def plan_slots(layouts: list[ExpertLayout], budget_bytes: int, n_expert: int,
                   chunk: int = 0) -> list[int]:
        """Split a byte budget into per-layer slot counts: evenly by count, capped at E, then
        what is left buys one more slot for as many layers as it can, first to last (a slot in
        any layer saves PCIe bytes; an even split would leave up to a slot-per-layer's bytes,
        54 MB on the 35B, unused). With pools mapped in `chunk`-byte pieces, each layer's
        rounding up is paid from the budget."""
        per_layer = max(lay.expert_bytes for lay in layouts)
        L = len(layouts)
        n = min(n_expert, max(0, budget_bytes) // (per_layer * L))

        def cost(lay: ExpertLayout, k: int) -> int:
            return on.mapped_size(k * lay.expert_bytes, chunk) if chunk else k * lay.expert_bytes
        while n > 0 and sum(cost(lay, n) for lay in layouts) > budget_bytes:
            n -= 1
        slots = [int(n)] * L
        left = budget_bytes - sum(cost(lay, n) for lay in layouts)
        for i, lay in enumerate(layouts):
            extra = cost(lay, n + 1) - cost(lay, n)
            if n < n_expert and extra <= left:
                slots[i] += 1
                left -= extra
        return slots

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
                   pin_fraction: float | None = None, top_k: int = 8) -> None:
        """Fill every layer: the profile's hottest experts first (the top `pin_fraction` of the
        slots pinned; None: the policy's), else experts 0, 1, 2, ... so decoding starts with a
        full cache."""
        decay = self.policy.score_decay
        if pin_fraction is None:
            pin_fraction = self.policy.warm_pin_share
        for L in range(self.n_layer):
            order = (np.argsort(-profile[L], kind="stable") if profile is not None
                     else np.arange(self.n_expert))
            n = self.slots[L]
            n_pin = int(n * pin_fraction) if profile is not None else 0
            self.admit(L, order[:n_pin].tolist(), bank, pin=True)
            self.admit(L, order[n_pin:n].tolist(), bank)
            if profile is not None:
                self.expert_freq[L].copy_(torch.from_numpy(profile[L].astype(np.int32)))
                # the score an expert chosen at the profile's rate would have settled at
                share = profile[L] * top_k / max(1, profile[L].sum())   # choices a token
                steady = share / (1 - decay) * on.SCORE_ONE
                self.expert_score[L].copy_(torch.from_numpy(np.minimum(steady, on.SCORE_MAX).astype(np.int32)))

    def observe_chunk(self, layer: int, counts: torch.Tensor, n_tokens: int,
                      step: torch.Tensor) -> None:
        """A prefill chunk of n_tokens chose each expert counts[e] times: its frequency, weighed
        as that many decode steps' worth of evidence (the decay's sum over them), joins the
        scores as of `step` (a device scalar: no sync)."""
        decay = self.policy.score_decay
        weight = (1 - decay ** n_tokens) / (1 - decay)          # sum of decay^j, j < n_tokens
        now = on.decayed_scores(self.expert_score[layer], self.expert_seen[layer], step,
                                self.score_decay)
        add = (counts.double() / n_tokens * weight * on.SCORE_ONE).round().long()
        self.expert_score[layer].copy_((now + add).clamp(max=on.SCORE_MAX))
        self.expert_seen[layer].copy_(step.expand_as(self.expert_seen[layer]))

    # -- statistics --------------------------------------------------------------------------------
    def read_stats(self) -> CacheStats:
        s = self.stats.cpu().numpy().astype(np.int64)
        return CacheStats(**{name: s[:, i] for i, name in enumerate(STATS)})

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
