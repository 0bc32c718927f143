"""The offload runtime: a qwen35moe model under a hard VRAM cap.

    OffloadRuntime(loaded, vram=8 << 30)  ->  .new_state() / .prefill() / .decode() / .stats()

It presents the model's interface (so generation and chat use it unchanged) and assembles:
dense weights on the GPU (kept quantized), KV + delta-net state for the requested context (an
elastic KV maps memory only as the conversation grows), workspaces, host expert banks (pinned),
the GPU expert cache sized from what is left (elastic: it lends VRAM to prefill workspaces and
to a growing KV, and takes it back), the scheduler's rates, and the CPU worker. Decode steps are
captured as CUDA graphs (one per attention-length bucket) so a step is one launch with no
per-layer host work.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from loaders import LoadedModel

from native import offload_native as on

from .budget import SmiPeak, VramBudget, allocator_peaks, cap_allocator
from .errors import OffloadError
from .expert_cache import ExpertCache, load_profile
from .host_bank import HostExpertBank
from .models import Qwen35Moe
from .models.qwen35moe import FUSED_PROJECTIONS
from .models.weights import upload_weights
from .offload_experts import LayerExperts, OffloadEngine
from .placement import (CONTEXT_MARGIN, DECODE_HEADROOM, LATE_LOAD_MARGIN, PREFILL_CHUNK,
                        STAGING_EXPERTS, gpu_workspace_bytes,
                        host_weight_names, prefill_workspace_bytes, staging_bytes)
from .scheduler import Rates, Scheduler
from .state import State

# Guesses a token makes per layer while decoding, one layer ahead, as a fraction of the top-k
PREFETCH_AHEAD = 6 / 8
GRAPH_BUCKET = 256          # attention-length bucket per captured decode graph


@dataclass
class RuntimeOptions:
    vram: int                              # bytes: the hard cap
    n_ctx: int = 4096                      # context the KV cache is sized for
    kv_dtype: torch.dtype = torch.float16
    profile: str | None = None             # routing profile (JSON) for a warm start
    fetch_fraction: float | None = None    # force the PCIe share of misses (None: from rates)
    use_graphs: bool = True
    prefill_chunk: int = PREFILL_CHUNK
    staging_experts: int = STAGING_EXPERTS  # per prefill staging buffer (two are kept)
    cpu_threads: int | None = None
    cache_slots: int | None = None         # per layer; None: as many as the budget allows
    elastic: bool = True                   # the cache lends VRAM to prefill and to the KV (which
                                           # maps memory as the context grows), takes it back after
    host_embedding: bool = True            # token embedding in pinned host RAM (a step reads 1 row)
    host_head: bool = False                # output head in pinned host RAM, read over PCIe each token
    prefetch: bool = True                  # guess layer L+1's experts during layer L (decode)
    prefetch_k: int | None = None          # experts guessed per token one layer ahead (None:
                                           # PREFETCH_AHEAD of the top-k)
    overlap_misses: bool = True            # a layer's resident experts compute while its misses
                                           # cross PCIe (False: fetch first, then all at once)
    device: str = "cuda"


@dataclass
class LoadReport:
    seconds: dict[str, float] = field(default_factory=dict)
    budget: dict[str, int] = field(default_factory=dict)
    slots_per_layer: list[int] = field(default_factory=list)          # kept through any prefill
    decode_slots_per_layer: list[int] = field(default_factory=list)   # elastic: while decoding
    pinned: bool = False
    host_weights: dict[str, int] = field(default_factory=dict)   # name -> bytes kept in host RAM


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


class OffloadRuntime:
    def __init__(self, loaded: LoadedModel, opts: RuntimeOptions,
                 progress: Callable[[str, int, int], None] | None = None):
        try:
            self._build(loaded, opts, progress)
        except BaseException:   # leave nothing behind: the allocator cap, pinned pages
            if torch.cuda.is_available():
                torch.cuda.set_per_process_memory_fraction(1.0, torch.device(opts.device).index or 0)
            for part in (getattr(self, "cache", None), getattr(self, "bank", None)):
                if part is not None:
                    part.close()
            self._unpin_weights()
            raise

    def _build(self, loaded: LoadedModel, opts: RuntimeOptions, progress) -> None:
        if not torch.cuda.is_available():
            raise OffloadError("--vram needs a CUDA GPU and none is visible; run without --vram "
                               "to use the CPU")
        self.opts, self.config = opts, loaded.config
        self.device = dev = torch.device(opts.device)
        self.report = rep = LoadReport()
        c = self.config
        t0 = time.perf_counter()
        self.budget = VramBudget(opts.vram)
        torch.cuda.reset_peak_memory_stats(dev)
        self.smi = SmiPeak()
        # The CUDA context, cuBLAS and kernel images live outside torch's allocator but count in
        # nvidia-smi: measure them once everything is initialised and keep them inside the cap.
        torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        # this process's use now (nvidia-smi), and the device's: later, the change of the
        # device's figure (one cheap call) tells how ours has changed (_measure_outside)
        self._proc0, self._dev_used0 = self.smi.sample(), total - free
        outside = max(0, (self._proc0 or (total - free)) - torch.cuda.memory_reserved(dev))
        outside += CONTEXT_MARGIN
        self._outside = self._outside_budget = outside   # _measure_outside may lower the first
        self.budget.reserve("CUDA context + libraries", outside,
                            "the GPU runtime alone needs this much before any weight")
        base = torch.cuda.memory_allocated(dev)
        if opts.cpu_threads:
            from native.ops import _cpu
            if _cpu is not None:
                _cpu.set_threads(opts.cpu_threads)

        # 1. dense weights, quantized, on the GPU (experts stay in the file's memory map); the
        # embedding (and on request the head) in pinned host RAM, read by the GPU over PCIe
        on_host = host_weight_names(loaded, opts.host_embedding, opts.host_head)
        tensors, _ = upload_weights(loaded, dev, experts_device="cpu", fuse=FUSED_PROJECTIONS,
                                    keep_on_host=on_host)
        self._pinned_weights: list[torch.Tensor] = []
        for name in on_host:
            tensors[name] = self._pin_weight(tensors[name])
            rep.host_weights[name] = tensors[name].data.numel()
        torch.cuda.synchronize(dev)
        dense = torch.cuda.memory_allocated(dev) - base
        rep.seconds["dense upload"] = time.perf_counter() - t0
        self.budget.reserve("dense weights", dense,
                            "the always-active weights alone exceed the cap; use a smaller quant")
        cap_allocator(opts.vram - outside, dev)

        # 2. per-sequence state for the requested context (B = 1), allocated now so that the
        # cache is sized around it. Elastic: the KV maps memory as the context grows (the cache
        # gives it slots then, and takes them back for the next conversation)
        elastic = opts.elastic and on.elastic_supported()
        probe = State(c, 1, opts.n_ctx, "meta", opts.kv_dtype)
        self.budget.reserve("KV + delta-net state", probe.nbytes, "lower --ctx")
        self._states: dict[int, State] = {
            1: State(c, 1, opts.n_ctx, dev, opts.kv_dtype, GRAPH_BUCKET,
                     kv_alloc=on.ElasticBuffer if elastic else None)}

        # 3. workspaces: prefill activations + attention for one chunk, graphs, staging
        ws = gpu_workspace_bytes(c, opts.n_ctx, opts.prefill_chunk)
        self.budget.reserve("workspace", ws, "lower --ctx or the prefill chunk")

        # 4. host expert banks
        t1 = time.perf_counter()
        self.bank = HostExpertBank(loaded, progress=(lambda d, t: progress("experts to host RAM", d, t))
                                   if progress else None)
        rep.seconds["host banks"] = time.perf_counter() - t1
        rep.seconds["pin"] = self.bank.pin_seconds
        rep.pinned = self.bank.pinned

        # 5. the expert cache from what is left: this many slots even during the largest prefill
        # chunk; while decoding (elastic) it also borrows the prefill workspace and staging
        layouts = self.bank.layouts
        staging = staging_bytes(max(lay.expert_bytes for lay in layouts), opts.staging_experts)
        self.budget.reserve("prefill staging", staging, "lower --vram use elsewhere")
        self._chunk = on.elastic_chunk() if elastic else 0
        slots = ExpertCache.plan_slots(layouts, self.budget.left, c.n_expert, self._chunk)
        if opts.cache_slots is not None:  # a smaller cache on purpose (tests, experiments)
            slots = [min(s, opts.cache_slots) for s in slots]
        self.cache = ExpertCache(layouts, slots, c.n_expert, dev, elastic=elastic)
        self.budget.reserve("expert cache", self.cache.nbytes)
        rep.slots_per_layer = slots
        self._cap_torch()
        self._cache_peak = self.cache.nbytes

        # 6. scheduler rates, engine, model
        fraction = opts.fetch_fraction
        if not self.bank.pinned and fraction is None:
            fraction = 0.0  # pageable banks: the GPU cannot read them directly
        self.scheduler = Scheduler.create(Rates(1.0, 1.0), dev, forced=fraction)
        self.engine = OffloadEngine(self.cache, self.bank, self.scheduler, top_k=c.n_expert_used,
                                    hidden=c.n_embd, ff=c.n_ff_exp,
                                    staging_experts=opts.staging_experts,
                                    overlap_misses=opts.overlap_misses)
        self.model = Qwen35Moe(c, tensors, [LayerExperts(self.engine, i) for i in range(c.n_layer)])
        if opts.prefetch and self.bank.pinned and fraction != 0.0:  # guesses travel over PCIe
            K = c.n_expert_used
            self.engine.set_predictor(
                self.model.router_logits,
                opts.prefetch_k if opts.prefetch_k is not None else max(1, int(PREFETCH_AHEAD * K)))
        self._calibrate()
        self._grow_pending = False
        self._torch_peak = 0
        self._capture_need: int | None = None   # torch memory a decode capture needs (measured)
        self.prefill_memory: list[dict] = []
        if self.cache.elastic:   # the unmapped KV and the prefill workspace, lent to the cache
            self._fit_cache(self._decode_headroom, grow=True)
        rep.decode_slots_per_layer = self.cache.slots
        profile = load_profile(opts.profile, c.n_layer, c.n_expert) if opts.profile else None
        t2 = time.perf_counter()
        self.cache.warm_start(self.bank, profile, top_k=c.n_expert_used)
        torch.cuda.synchronize(dev)
        rep.seconds["warm start"] = time.perf_counter() - t2
        self._graphs: dict[tuple, tuple] = {}
        self._since_observe, self._obs_busy, self._obs_experts = 0, 0, 0
        self.reset_stats()
        self._graph_pool = torch.cuda.graph_pool_handle()
        rep.budget = self.budget.summary()
        rep.seconds["total"] = time.perf_counter() - t0

    # -- placement ------------------------------------------------------------------------------------
    def _pin_weight(self, q):
        """A CPU QTensor -> the same weight in pinned host RAM, viewed as a CUDA tensor (kernels
        read it over PCIe at its host address)."""
        from native.ops import QTensor
        host = torch.empty_like(q.data)
        host.copy_(q.data)
        on.pin_host(host)
        self._pinned_weights.append(host)
        return QTensor(on.host_view(host), q.qtype, q.shape, q.name, q.parts)

    # -- sizing ----------------------------------------------------------------------------------------
    @property
    def _decode_headroom(self) -> int:
        """What torch keeps free beside the grown cache while decoding: until a decode step has
        been captured, the estimate DECODE_HEADROOM; then what a capture was measured to need
        (the next attention bucket's), +25% and 16 MiB (_measured_capture checks it before each)."""
        return DECODE_HEADROOM if self._capture_need is None else \
            self._capture_need * 5 // 4 + (16 << 20)

    def _fit_cache(self, torch_extra: int, grow: bool) -> None:
        """Resize the elastic cache to what the cap leaves once torch holds what it holds now
        (its cached free blocks given back) plus `torch_extra` bytes; only shrink unless `grow`.
        Then cap torch's allocator at the rest."""
        dev, cache = self.device, self.cache
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        room = (self.opts.vram - self._outside - torch.cuda.memory_reserved(dev) - torch_extra
                - self._kv_mapped())
        # never more than the device has free: on a laptop, other programs use the GPU too
        room = min(room, cache.nbytes + torch.cuda.mem_get_info(dev)[0] - CONTEXT_MARGIN)
        plan = ExpertCache.plan_slots(cache.layouts, room, cache.n_expert, self._chunk)
        if self.opts.cache_slots is not None:
            plan = [min(n, self.opts.cache_slots) for n in plan]
        want = plan if grow else [min(n, s) for n, s in zip(plan, cache.slots)]
        if want != cache.slots:
            try:
                cache.resize(want)
            except OffloadError as e:   # growing is an optimisation: decode on with what we have
                if not grow:
                    raise
                warnings.warn(f"{e}; decoding on with the cache as it is")
        self._cap_torch()
        self._cache_peak = max(self._cache_peak, cache.nbytes)

    def _cap_torch(self) -> None:
        """Torch's allocator may use the cap less the context and what we map ourselves: the
        cache (when elastic) and the elastic KV."""
        cache = self.cache
        cap_allocator(self.opts.vram - self._outside - (cache.nbytes if cache.outside_torch else 0)
                      - self._kv_mapped(), self.device)

    def _kv_mapped(self) -> int:
        return sum(st.kv_mapped for st in getattr(self, "_states", {}).values())

    def _keep_free(self, nbytes: int) -> None:
        """Shrink the cache if the cap does not leave `nbytes` free beside what torch reserves."""
        free = (self.opts.vram - self._outside - self.cache.nbytes - self._kv_mapped()
                - torch.cuda.memory_reserved(self.device))
        if free < nbytes:
            self._fit_cache(nbytes, grow=False)

    def _room_for_kv(self, state: State, rows: int) -> None:
        """Before a step that reaches position `rows`: map the elastic KV that far, shrinking the
        cache first if the cap cannot hold both (decode grows it back only as far as the cap
        allows, so the slots stay with the KV until the state is emptied)."""
        if state.kv_rows >= rows:
            return
        self._keep_free(state.kv_bytes(rows) - state.kv_mapped + self._decode_headroom)
        torch.cuda.synchronize(self.device)
        state.map_kv(rows)
        self._cap_torch()

    def _room_for_prefill(self, n_tokens: int, n_past: int, chunk: int, all_logits: bool) -> None:
        """Before a prefill: shrink the elastic cache if torch could not hold the chunk's
        workspace beside it; decode takes the memory back (_grow_pending)."""
        if not self.cache.elastic:
            return
        need = prefill_workspace_bytes(self.config, min(n_tokens, chunk), n_past + n_tokens,
                                       all_logits)
        if self.engine.staging is None:   # lent to the cache while decoding
            need += self.engine.staging_bytes
        # what torch may still allocate: its cap (the pools are ours, outside it) less its live
        # tensors (cached free blocks are reusable)
        free = (self.opts.vram - self._outside - self.cache.nbytes - self._kv_mapped()
                - torch.cuda.memory_allocated(self.device))
        if free < need:
            self._fit_cache(need, grow=False)
            self._grow_pending = True

    def _calibrate(self) -> None:
        """Measure the link (fetch kernel) and CPU (expert FFN) rates with this model's experts."""
        from native.ops import _cpu
        lay, host = self.bank.layouts[0], self.bank.banks[0]
        pool = self.cache.pools[0]
        eb = lay.expert_bytes
        link = 0.0
        if self.bank.pinned and pool.shape[0]:
            n = min(8, pool.shape[0])
            fl = torch.zeros(1 + 2 * 64, dtype=torch.int32)
            fl[0] = n
            fl[1:1 + 2 * n:2] = torch.arange(n)
            fl[2:2 + 2 * n:2] = torch.arange(n)
            fl = fl.to(self.device)
            scratch = torch.empty((n, pool.shape[1]), dtype=torch.uint8, device=self.device)
            on.fetch(fl, host, scratch, n)
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            for _ in range(5):
                on.fetch(fl, host, scratch, n)
            ev1.record()
            ev1.synchronize()
            link = 5 * n * eb / (ev0.elapsed_time(ev1) / 1e3)
            del scratch
        cpu = 1.0
        if _cpu is not None:
            # two experts a call, as decode hands the CPU (1-3 a layer): per-call costs included
            K, n_cpu = self.config.n_expert_used, min(2, self.config.n_expert_used)
            x = torch.randn(1, self.config.n_embd)
            ids = torch.full((1, K), -1, dtype=torch.int32)
            ids[0, :n_cpu] = torch.arange(n_cpu, dtype=torch.int32)
            w = torch.full((1, K), 1.0 / K)
            y = torch.empty(1, self.config.n_embd)
            args = [v for b in lay.banks(host.data_ptr(), eb) for v in b]

            def run():
                _cpu.moe_ffn(x.data_ptr(), 1, self.config.n_embd, self.config.n_ff_exp,
                             self.config.n_expert, ids.data_ptr(), w.data_ptr(), K, *args,
                             y.data_ptr(), 0)
            run()
            t = time.perf_counter()
            for _ in range(5):
                run()
            cpu = 5 * n_cpu * eb / (time.perf_counter() - t)
        self.scheduler.rates = Rates(link, cpu)
        self.scheduler.apply()

    # -- the model interface ---------------------------------------------------------------------------
    def new_state(self, batch: int = 1, n_ctx: int | None = None, kv_dtype=None) -> State:
        """The runtime's state for `batch` sequences, emptied. There is one per batch size: its
        KV was budgeted at start, and the captured decode graphs are bound to its buffers."""
        n = n_ctx or self.opts.n_ctx
        if n > self.opts.n_ctx:
            raise OffloadError(f"a context of {n} needs more VRAM than was budgeted for "
                               f"{self.opts.n_ctx}; restart with --ctx {n}")
        if batch != 1:
            raise OffloadError("the offload runtime decodes one sequence at a time for now")
        st = self._states.get(batch)
        if st is None:
            st = self._states[batch] = State(self.config, batch, self.opts.n_ctx, self.device,
                                             self.opts.kv_dtype, GRAPH_BUCKET)
        st.reset()
        if st.elastic_kv and st.kv_rows > 1:   # an empty conversation: the KV's memory goes back
            torch.cuda.synchronize(self.device)   # to the cache at the next decode step
            st.map_kv(1)
            self._cap_torch()
            self._grow_pending = True
        return st

    def prefill(self, tokens: torch.Tensor, state: State, chunk: int | None = None,
                all_logits: bool = False) -> torch.Tensor:
        self.engine.in_step = False
        chunk = chunk or self.opts.prefill_chunk
        n, past = tokens.shape[1], state.n_past
        self._make_room(state, n, chunk, all_logits)
        with self._measured("prefill", n, past, chunk, all_logits):
            out = self.model.prefill(tokens, state, chunk, all_logits)
        self._lend_staging()
        return out

    def forward(self, tokens: torch.Tensor, state: State, last_only: bool = False) -> torch.Tensor:
        self.engine.in_step = False
        n, past = tokens.shape[1], state.n_past
        self._make_room(state, n, n, not last_only)
        with self._measured("forward", n, past, n, not last_only):
            out = self.model.forward(tokens, state, last_only)
        self._lend_staging()
        return out

    def _lend_staging(self) -> None:
        """After a prompt: an elastic cache takes the prefill staging (87 MB on the 35B, ~1.6
        slots a layer) while decoding; the next prompt makes room for it again."""
        if self.cache.elastic and self.engine.release_staging():
            self._grow_pending = True

    def _make_room(self, state: State, n: int, chunk: int, all_logits: bool) -> None:
        """Before n prompt tokens: the context must hold them (checked before anything is
        mapped), the KV is mapped that far, and torch gets the chunk's workspace."""
        state.check_room(n)
        self._room_for_kv(state, state.n_past + n)
        self._room_for_prefill(n, state.n_past, chunk, all_logits)
        self.engine.ensure_staging()

    @contextlib.contextmanager
    def _measured(self, what: str, n: int, past: int, chunk: int, all_logits: bool):
        """Record torch's peak use above what it held before, next to the workspace estimate
        the elastic cache made room for (`prefill_memory`: the check of that estimate)."""
        dev = self.device
        self._torch_peak = max(self._torch_peak, torch.cuda.max_memory_reserved(dev))
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        yield
        self.prefill_memory.append({
            "what": what, "tokens": n, "past": past,
            "estimate": prefill_workspace_bytes(self.config, min(n, chunk), past + n, all_logits),
            "used": torch.cuda.max_memory_allocated(dev) - before})
        del self.prefill_memory[:-64]

    def decode(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """One token per sequence: tokens [B] on the device -> logits [B, V] (a fresh tensor)."""
        B = tokens.shape[0]
        if B > self.engine.max_tok:
            raise OffloadError(f"a decode step of {B} sequences exceeds {self.engine.max_tok}")
        state.check_room(1)
        self._room_for_kv(state, state.attn_len(1))   # attention reads up to the bucket's end
        if self._grow_pending:   # the last prefill (or KV) borrowed from the cache: take it back
            self._grow_pending = False
            self._fit_cache(self._decode_headroom, grow=True)
        if not self.opts.use_graphs:
            return self._eager_step(tokens, state)
        key = (id(state), state.attn_len(1))
        g = self._graphs.get(key)
        if g is None:
            g = self._measured_capture(tokens, state)
            self._graphs[key] = g
        graph, tok_in, logits = g
        tok_in.copy_(tokens)
        self.engine.arm(B)
        graph.replay()          # not waited for: the next step's launch queues behind it
        state.n_past += 1       # the captured step advanced the device position only
        self._observe()
        return logits.clone()

    def _observe(self, every: int = 16) -> None:
        """Every `every` steps, fold the CPU worker's measured rate into the scheduler (the plan
        kernel reads the new split from device memory: no re-capture)."""
        self._since_observe += 1
        if self._since_observe < every:
            return
        self._since_observe = 0
        busy = sum(self.engine.worker.busy_ns())
        n = sum(self.engine.worker.experts())
        d_busy, d_n = busy - self._obs_busy, n - self._obs_experts
        self._obs_busy, self._obs_experts = busy, n
        if d_n >= 8:  # enough CPU work in the window to trust the rate (decode hands it 2-3 a token)
            eb = float(np.mean([lay.expert_bytes for lay in self.bank.layouts]))
            self.scheduler.observe_cpu(d_busy / 1e9, d_n * eb)

    def _eager_step(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        eng = self.engine
        eng.arm(tokens.shape[0])
        eng.in_step = True
        try:
            eng.begin_device_step()
            out = self.model.decode(tokens, state)
            eng.end_device_step()
        finally:
            eng.in_step = False
        eng.settle()
        self._observe()
        return out

    def _measured_capture(self, tokens: torch.Tensor, state: State):
        """Capture a decode step, measuring what it costs, so that decode keeps only that much
        free beside the cache (the first capture's figure stands for the later ones; a later
        capture that finds less room under the cap shrinks the cache first)."""
        dev = self.device
        if self._capture_need is not None and self.cache.elastic:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            self._keep_free(self._decode_headroom)
        self._torch_peak = max(self._torch_peak, torch.cuda.max_memory_reserved(dev))
        torch.cuda.reset_peak_memory_stats(dev)
        g = self._capture(tokens, state)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        need = torch.cuda.max_memory_reserved(dev) - torch.cuda.memory_reserved(dev)
        self._capture_need = max(self._capture_need or 0, need)
        self._measure_outside()
        self._grow_pending = True   # the cache takes what the estimates held back
        return g

    def _measure_outside(self) -> None:
        """After a capture every kernel of decode (and of the prompts so far) is loaded: measure
        the memory outside torch's allocator and our pools (context, libraries, kernel images)
        and budget LATE_LOAD_MARGIN above it instead of the start-up margin -- never more than
        the start-up budget, so another program's memory can only make this more careful.
        nvidia-smi's figure for this process where there is one (a subprocess, but captures are
        rare: one per 256 positions), else the change in the device's used memory."""
        if self._proc0 is None:   # no per-process figure to start from: keep the margin
            return
        dev = self.device
        torch.cuda.synchronize(dev)
        ours = self.smi.sample()
        if ours is None:
            free, total = torch.cuda.mem_get_info(dev)
            ours = self._proc0 + (total - free) - self._dev_used0
        outside = (ours - torch.cuda.memory_reserved(dev) - self.cache.nbytes
                   - self._kv_mapped())
        self._outside = min(self._outside_budget, outside + LATE_LOAD_MARGIN)

    def _capture(self, tokens: torch.Tensor, state: State):
        eng = self.engine
        tok_in = tokens.clone()
        # warm up once eagerly (lazy inits, allocator) -- this is a real step, so rewind after
        snap, stats = state.snapshot(), self.cache.stats.clone()
        self._eager_step(tok_in, state)
        state.restore(snap)
        self.cache.stats.copy_(stats)  # the warm-up is not a step of the run
        g = torch.cuda.CUDAGraph()
        n_past = state.n_past
        eng.in_step = True
        try:
            with torch.cuda.graph(g, pool=self._graph_pool):
                eng.begin_device_step()
                logits = self.model.decode(tok_in, state)
                eng.end_device_step()
        finally:
            eng.in_step = False
            state.n_past = n_past  # capture ran no kernels; the host counter must not move
        return g, tok_in, logits

    # -- statistics ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Cache and CPU statistics since the last reset_stats()."""
        self.engine.settle()
        s = self.cache.read_stats()
        busy = (np.asarray(self.engine.worker.busy_ns()) - self._busy0) / 1e9
        cpu_experts = np.asarray(self.engine.worker.experts()) - self._experts0
        per_layer = [{"layer": i, "hits": int(s.hits[i]), "fetched": int(s.fetched[i]),
                      "cpu": int(s.cpu[i]), "cpu_s": float(busy[i])} for i in range(len(s.hits))]
        eb = self.bank.layouts[0].expert_bytes
        return {
            "hit_rate": s.hit_rate, "selections": s.selections,
            "hits": int(s.hits.sum()), "fetched": int(s.fetched.sum()), "cpu": int(s.cpu.sum()),
            "pcie_bytes": int(s.fetched.sum() + s.prefetched.sum()) * eb,
            "cpu_expert_s": float(busy.sum()),
            "cpu_experts": int(cpu_experts.sum()),
            "prefill_streamed": int(self.engine.prefill_streamed.sum()),
            "cache_slots": self.cache.slots, "cache_bytes": self.cache.nbytes,
            "kv_bytes": self._kv_mapped(),
            "fetch_fraction": self.scheduler.q(), "min_fetch": self.scheduler.min_fetch(),
            "prefetched": int(s.prefetched.sum()), "prefetch_hits": int(s.prefetch_hits.sum()),
            "prefetch_precision": s.prefetch_precision, "prefetch_recall": s.prefetch_recall,
            "rates": {"link_GBps": self.scheduler.rates.link_bytes_per_s / 1e9,
                      "cpu_GBps": self.scheduler.rates.cpu_bytes_per_s / 1e9},
            "per_layer": per_layer,
        }

    def reset_stats(self) -> None:
        self.engine.settle()
        self.cache.reset_stats()
        self.engine.prefill_streamed.zero_()
        self._busy0 = np.asarray(self.engine.worker.busy_ns())
        self._experts0 = np.asarray(self.engine.worker.experts())

    def vram_peaks(self) -> dict:
        d = allocator_peaks(self.device)   # torch's allocator; the elastic cache is outside it
        d["reserved_peak"] = max(d["reserved_peak"], self._torch_peak)
        d["cache_peak"] = self._cache_peak
        self.smi.sample()
        d["nvidia_smi_peak"] = self.smi.peak_bytes
        d["outside_budget"] = self._outside   # context + libraries, as budgeted now
        d["cap"] = self.opts.vram
        return d

    def close(self) -> None:
        """Give back what the runtime took: the allocator cap, pinned pages, the worker."""
        self.smi.stop()
        self._graphs.clear()
        torch.cuda.synchronize(self.device)
        self.engine.settle()
        for st in self._states.values():
            st.close()
        self.cache.close()
        self.bank.close()
        self._unpin_weights()
        torch.cuda.set_per_process_memory_fraction(1.0, self.device.index or 0)

    def _unpin_weights(self) -> None:
        for t in getattr(self, "_pinned_weights", []):
            on.unpin_host(t, missing_ok=True)
        self._pinned_weights = []
