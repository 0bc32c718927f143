"""The scheduler's cost model: where a missing expert should be computed.

A miss can be fetched over PCIe into a cache slot (then computed on the GPU, and possibly hit
again later) or computed by the CPU where it lies. Both run at once, so the best split makes them
finish together: the link carries a fraction q = p / (p + c) of a layer's expert copies, where p
and c are the link's and the CPU's rates in expert-bytes per second (FreeToken's "q*" rule). That
holds for many misses; for a few, the CPU's one expert takes as long as the link takes for p / c
of them, so the first floor(p / c) misses of a layer always go over the link (else the GPU
waits for the CPU's one expert). The experts a step's guesses copied into
the layer ahead of it are part of the link's share: of nm misses after g guesses, q * (nm + g) - g
are fetched and the CPU takes the rest (guesses left out of the split fill the link while the
CPU idles: docs/BENCHMARKS.md, "Guesses in the link's share"). Rates are measured at start-up
and the CPU rate is updated online from the worker's own timings; the device-side plan kernel
reads both numbers from device memory every step, so a change needs no re-capture.

The scheduler owns no buffers: it decides; placement (the cache) and the model do the rest.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from native.offload_native import MAX_SELECTIONS

from ..config import OffloadPolicy


@dataclass
class Rates:
    link_bytes_per_s: float      # PCIe fetch into a slot (kernel copy from pinned host memory)
    cpu_bytes_per_s: float       # CPU expert FFN over host banks, all cores
    fixed_cpu_s: float = 0.0     # per-layer CPU overhead (hand-off, thread wake), measured


@dataclass
class Scheduler:
    rates: Rates
    fetch_fraction: torch.Tensor            # [2] float32 on the device: q, min_fetch (plan kernel)
    forced: float | None = None             # user override (e.g. 0: CPU only, 1: PCIe only)
    ema: float = OffloadPolicy.cpu_rate_ema  # weight of a new measurement of the CPU rate
    history: list[float] = field(default_factory=list)

    @classmethod
    def create(cls, rates: Rates, device: torch.device, forced: float | None = None,
               ema: float = OffloadPolicy.cpu_rate_ema) -> "Scheduler":
        s = cls(rates, torch.zeros(2, dtype=torch.float32, device=device), forced, ema)
        s.apply()
        return s

    def q(self) -> float:
        """Fraction of misses to send over the link."""
        if self.forced is not None:
            return self.forced
        p, c = self.rates.link_bytes_per_s, self.rates.cpu_bytes_per_s
        return p / (p + c) if p + c > 0 else 0.0

    def min_fetch(self) -> int:
        """Misses of a layer that go over the link before the CPU gets any (none when forced)."""
        if self.forced is not None:
            return 0
        p, c = self.rates.link_bytes_per_s, self.rates.cpu_bytes_per_s
        return int(min(MAX_SELECTIONS, p // c)) if c > 0 else MAX_SELECTIONS

    def apply(self) -> None:
        q = self.q()
        self.fetch_fraction.copy_(torch.tensor([q, float(self.min_fetch())]))
        self.history.append(q)

    def observe_cpu(self, busy_s: float, expert_bytes: float) -> None:
        """Fold the worker's measured time for `expert_bytes` of experts into the CPU rate."""
        if busy_s <= 0 or expert_bytes <= 0:
            return
        rate = expert_bytes / busy_s
        r = self.rates
        r.cpu_bytes_per_s = (1 - self.ema) * r.cpu_bytes_per_s + self.ema * rate
        self.apply()


def measure_rates(cache, bank, config, clock=None) -> Rates:
    """The link's rate (the fetch kernel into layer 0's slots, through the emulated link `clock`
    when there is one) and the CPU's (its expert FFN on two experts a call, as decode hands it 1-3 a
    layer: per-call costs included), with this model's experts; 0 / 1 where there is nothing to
    measure."""
    from native import offload_native as on
    from native.ops import cpu_threads_held
    lay, host = bank.layouts[0], bank.banks[0]
    pool, eb = cache.pools[0], lay.expert_bytes
    link = 0.0
    if bank.pinned and pool.shape[0]:
        n = min(8, pool.shape[0])
        fl = torch.zeros(1 + 2 * MAX_SELECTIONS, dtype=torch.int32)
        fl[0] = n
        fl[1:1 + 2 * n:2] = torch.arange(n)
        fl[2:2 + 2 * n:2] = torch.arange(n)
        fl = fl.to(cache.device)
        scratch = torch.empty((n, pool.shape[1]), dtype=torch.uint8, device=cache.device)
        on.fetch(fl, host, scratch, n, link=clock)
        torch.cuda.synchronize()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        for _ in range(5):
            on.fetch(fl, host, scratch, n, link=clock)
        ev1.record()
        ev1.synchronize()
        link = 5 * n * eb / (ev0.elapsed_time(ev1) / 1e3)
        del scratch
    cpu = 1.0
    if on.cpu_available():
        K, n_cpu = config.n_expert_used, min(2, config.n_expert_used)
        x = torch.randn(1, config.n_embd)
        ids = torch.full((1, K), -1, dtype=torch.int32)
        ids[0, :n_cpu] = torch.arange(n_cpu, dtype=torch.int32)
        w = torch.full((1, K), 1.0 / K)
        y = torch.empty(1, config.n_embd)
        banks = bank.cpu_bank_args(0)   # what the CPU computes from

        def run():
            on.host_moe_ffn(x, ids, w, banks, config.n_expert, y, ff=config.n_ff_exp)
        # The worker holds the pool's threads awake through a step: time the calls so too. The
        # median call: one whose thread was preempted takes a scheduler tick, and a rate that
        # low would keep the CPU out of every plan, so never measured again online.
        with cpu_threads_held(torch.device("cpu")):
            run()
            times = []
            for _ in range(15):
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
        cpu = n_cpu * eb / float(np.median(times))
    return Rates(link, cpu)
