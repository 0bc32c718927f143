"""The elastic VRAM policy: the expert cache takes what the cap leaves, and gives it back.

Under the cap live the CUDA context and libraries (measured), torch's allocator (dense weights,
activations, graph pools), the KV (mapped as the conversation grows) and the expert cache (mapped
slot by slot). The cache is sized from the `VramLedger`: before a prompt it lends a workspace to
torch, before a step that reaches new positions it lends memory to the KV, and while decoding it
keeps only what a graph capture needs free beside it; each time the ledger says how much room
the rest leaves, and the cache shrinks or grows to that (`ExpertCache.resize` keeps the experts
of highest score). Torch's allocator is capped at what the cache and KV leave it.
"""
from __future__ import annotations

import warnings

import torch

from native import offload_native as on

from .budget import SmiPeak, VramLedger, cap_allocator
from ..errors import OffloadError
from .expert_cache import ExpertCache
from .placement import prefill_workspace_bytes
from ..config import OffloadPolicy


class ElasticVram:
    """Sizes one runtime's expert cache under its cap (the runtime's states are read live)."""

    def __init__(self, cap: int, outside: int, cache: ExpertCache, states: dict, policy: OffloadPolicy,
                 device: torch.device, smi: SmiPeak, proc0: int | None, dev_used0: int,
                 cache_slots: int | None = None):
        self.cap, self.cache, self.states, self.policy, self.device = cap, cache, states, policy, device
        self.smi, self._proc0, self._dev_used0 = smi, proc0, dev_used0
        self.cache_slots = cache_slots   # a smaller cache on purpose (tests, experiments)
        self.chunk = on.elastic_chunk() if cache.elastic and cache.outside_torch else 0
        self.ledger = VramLedger(cap)
        self.outside_budget = outside   # context + libraries as budgeted at start-up
        self.ledger.set("CUDA context + libraries", outside)
        self.grow_pending = False       # the cache lent memory that decode should take back
        self.capture_need: int | None = None   # torch memory a decode capture needs (measured)
        self.cache_peak = cache.nbytes
        self.sampling = 0               # torch memory sampling needs beside a decode step
        self.torch_peak = 0             # torch's reserved peak before the last reset (vram_peaks)

    # -- the ledger's live entries -----------------------------------------------------------------
    @property
    def outside(self) -> int:
        return self.ledger.items["CUDA context + libraries"]

    def kv_mapped(self) -> int:
        return sum(st.kv_mapped for st in self.states.values())

    def _count(self, torch_bytes: int) -> VramLedger:
        """The ledger with torch's figure (reserved or allocated, as the caller asks), the KV and
        the cache (when its memory is ours) as they are now."""
        led = self.ledger
        led.set("torch", torch_bytes)
        led.set("KV", self.kv_mapped())
        led.set("expert cache", self.cache.nbytes if self.cache.outside_torch else 0)
        return led

    @property
    def decode_headroom(self) -> int:
        """What torch keeps free beside the grown cache while decoding: the policy's estimate until
        a decode step has been captured, then what a capture was measured to need, with slack
        (measured_capture checks it before each later capture); and room to sample the step's
        logits outside the graph."""
        if self.capture_need is None:
            return self.policy.decode_headroom + self.sampling
        return self.policy.capture_headroom(self.capture_need) + self.sampling

    # -- verbs -------------------------------------------------------------------------------------
    def fit(self, purpose: str, nbytes: int, grow: bool) -> None:
        """Lend `purpose` nbytes beside what torch holds now (its cached free blocks given back)
        and resize the cache to the room left; only shrink unless `grow`. Then cap torch."""
        dev, cache = self.device, self.cache
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        led = self._count(torch.cuda.memory_reserved(dev))
        led.reclaim()
        led.lend(purpose, nbytes)
        room = led.free_under_cap("expert cache")
        # never more than the device has free: on a laptop, other programs use the GPU too
        room = min(room, cache.nbytes + torch.cuda.mem_get_info(dev)[0] - self.policy.context_margin)
        plan = ExpertCache.plan_slots(cache.layouts, room, cache.n_expert, self.chunk)
        if self.cache_slots is not None:
            plan = [min(n, self.cache_slots) for n in plan]
        want = plan if grow else [min(n, s) for n, s in zip(plan, cache.slots)]
        if want != cache.slots:
            try:
                cache.resize(want)
            except OffloadError as e:   # growing is an optimisation: decode on with what we have
                if not grow:
                    raise
                warnings.warn(f"{e}; decoding on with the cache as it is")
        self.cap_torch()
        self.cache_peak = max(self.cache_peak, cache.nbytes)

    def cap_torch(self) -> None:
        """Torch's allocator may use the cap less the context and what we map ourselves: the
        cache (when elastic) and the elastic KV."""
        led = self._count(0)
        cap_allocator(led.free_under_cap("torch", loans=False), self.device)

    def keep_free(self, purpose: str, nbytes: int) -> None:
        """Shrink the cache if the cap does not leave `nbytes` free beside what torch reserves."""
        led = self._count(torch.cuda.memory_reserved(self.device))
        if led.free_under_cap(loans=False) < nbytes:
            self.fit(purpose, nbytes, grow=False)

    def room_for_kv(self, state, rows: int) -> None:
        """Before a step that reaches position `rows`: map the elastic KV that far, shrinking the
        cache first if the cap cannot hold both (decode grows it back only as far as the cap
        allows, so the slots stay with the KV until the state is emptied)."""
        if state.kv_rows >= rows:
            return
        self.keep_free("KV growth + decode", state.kv_bytes(rows) - state.kv_mapped + self.decode_headroom)
        torch.cuda.synchronize(self.device)
        state.map_kv(rows)
        self.cap_torch()

    def room_for_prefill(self, config, n_tokens: int, n_past: int, chunk: int, all_logits: bool,
                         staging_lent: int) -> None:
        """Before a prefill: shrink the cache if torch could not hold the chunk's workspace (and
        the staging buffers, when they were lent to the cache) beside it; decode takes the memory
        back (grow_pending)."""
        if not self.cache.elastic:
            return
        need = prefill_workspace_bytes(config, min(n_tokens, chunk), n_past + n_tokens,
                                       all_logits) + staging_lent
        # what torch may still allocate: its cap (the pools are ours, outside it) less its live
        # tensors (cached free blocks are reusable)
        led = self._count(torch.cuda.memory_allocated(self.device))
        if led.free_under_cap(loans=False) < need:
            self.fit("prefill workspace", need, grow=False)
            self.grow_pending = True

    def regrow(self) -> None:
        """Before a decode step: take back what the last prompt (or KV) borrowed."""
        if self.grow_pending:
            self.grow_pending = False
            self.fit("decode", self.decode_headroom, grow=True)

    def reset_torch_peak(self) -> None:
        """Fold torch's reserved peak into torch_peak and start measuring anew (before a
        measured prompt or capture, which reads the peak above what was held before it)."""
        self.torch_peak = max(self.torch_peak, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def before_capture(self) -> None:
        """A later capture that finds less room than the first one measured shrinks the cache."""
        if self.capture_need is not None and self.cache.elastic:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.keep_free("decode", self.decode_headroom)

    def after_capture(self, need: int, remeasure: bool = True) -> None:
        """A capture needed `need` bytes of torch: remember the most; with `remeasure` (a step
        size not captured before: new kernels loaded) measure the outside again."""
        self.capture_need = max(self.capture_need or 0, need)
        if remeasure:
            self.measure_outside()
        self.grow_pending = True   # the cache takes what the estimates held back

    def measure_outside(self) -> None:
        """After a capture every kernel of decode (and of the prompts so far) is loaded: measure
        the memory outside torch's allocator and our pools (context, libraries, kernel images)
        and budget the policy's late-load margin above it instead of the start-up margin --
        never more than the start-up budget, so another program's memory can only make this
        more careful. nvidia-smi's figure for this process where there is one (a subprocess,
        but captures are rare: one per attention bucket), else the change in the device's used
        memory."""
        if self._proc0 is None:   # no per-process figure to start from: keep the margin
            return
        dev = self.device
        torch.cuda.synchronize(dev)
        ours = self.smi.sample()
        if ours is None:
            free, total = torch.cuda.mem_get_info(dev)
            ours = self._proc0 + (total - free) - self._dev_used0
        led = self._count(torch.cuda.memory_reserved(dev))
        led.set("expert cache", self.cache.nbytes)
        outside = ours - led.held("CUDA context + libraries")
        led.set("CUDA context + libraries",
                min(self.outside_budget, outside + self.policy.late_load_margin))
