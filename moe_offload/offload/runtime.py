"""The offload runtime: a MoE model under a hard VRAM cap.

    rt = open_runtime("model.gguf", vram="8GiB", policy=OffloadPolicy(), ctx=4096)
    st = rt.new_state(1);  logits = rt.prefill(tokens, st);  logits = rt.decode(token, st)
    rt.stats() -> RuntimeStats;  rt.snapshot(st) / rt.restore(st, snap);  rt.close()
    rt = open_runtime(..., max_sequences=4): up to 4 states, stepped together by
    rt.decode_many(tokens [B], [st, ...]) (each layer's experts fetched once for the batch)

It presents the model's interface (so generation and chat use it unchanged) and assembles:
dense weights on the GPU (kept quantized), KV + delta-net state for the requested context (an
elastic KV maps memory only as the conversation grows), workspaces, host expert banks (pinned),
the GPU expert cache sized from what is left (elastic.py: it lends VRAM to prefill workspaces and
to a growing KV, and takes it back), the scheduler's rates, and the CPU worker. Decode steps are
captured as CUDA graphs (one per attention-length bucket) so a step is one launch with no
per-layer host work. The model class comes from the architecture registry (models.MODELS).
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from loaders import LoadedModel

from native import offload_native as on
from native import ops

from .budget import SmiPeak, VramLedger, allocator_peaks, cap_allocator
from .elastic import ElasticVram
from ..errors import OffloadError
from .expert_cache import ExpertCache, load_profile
from .host_bank import HostExpertBank
from ..models import MODELS
from ..models.weights import upload_weights
from .experts import LayerExperts, OffloadEngine, ResidentPool, SharedBeside
from .placement import gpu_workspace_bytes, host_weight_names, prefill_workspace_bytes, staging_bytes
from ..backend import Backend, Capabilities
from ..config import OffloadPolicy
from .report import LoadReport, RoutingRecorder, RuntimeStats
from .scheduler import Rates, Scheduler, measure_rates
from ..config import DRAFT
from ..state import Snapshot, State


@dataclass
class RuntimeOptions:
    """Where the runtime runs and what it holds; how it behaves is the `policy`."""

    vram: int                              # bytes: the hard cap
    n_ctx: int = 4096                      # context the KV cache is sized for
    policy: OffloadPolicy = field(default_factory=OffloadPolicy)
    kv_dtype: torch.dtype = torch.float16
    profile: str | None = None             # routing profile (JSON) for a warm start
    use_graphs: bool = True                # decode steps as captured CUDA graphs
    cpu_threads: int | None = None         # the CPU pool's size; None: the policy's cpu_threads
    cache_slots: int | None = None         # per layer; None: as many as the budget allows
    host_embedding: bool = True            # token embedding in pinned host RAM (a step reads 1 row)
    host_head: bool = False                # output head in pinned host RAM, read over PCIe each token
    max_sequences: int = 1                 # sequences held at once (decode_many steps them together);
                                           # each beyond the first takes its delta-net state and
                                           # its KV as it grows from the expert cache
    link_gbps: float | None = None         # emulate a slower host-to-GPU link (GB/s): every copy
                                           # of experts waits as long as that link would take
    device: str = "cuda"
    mtp: bool = False                      # load the MTP head (speculative decoding: rt.mtp)
    mtp_experts: str = "gpu"               # its routed experts: "gpu" resident in VRAM (under
                                           # the cap: the cache is sized around them), "host"
                                           # pinned host RAM read over PCIe by the GPU (no VRAM)
    cpu_repack: str = "auto"               # the CPU computes its misses from its own copy of the
                                           # experts in a repacked form where the type has one
                                           # (HostExpertBank.repack_for_cpu): on, off, or auto
                                           # (where host RAM has room for it)


def parse_vram(size: int | str) -> int:
    """8 << 30, "8GiB", "512MiB", "6GB" -> bytes."""
    if isinstance(size, int):
        return size
    from loaders import GGUFError
    from loaders.synth import parse_size
    try:
        return parse_size(str(size))
    except GGUFError as e:
        raise OffloadError(f"vram {size!r}: {e}") from None


def open_runtime(model: LoadedModel | str | Path, vram: int | str, *,
                 policy: OffloadPolicy | None = None, ctx: int = 4096,
                 progress: Callable[[str, int, int], None] | None = None,
                 **options) -> "OffloadRuntime":
    """A model (a LoadedModel, or a GGUF path) under a VRAM cap; `options`: RuntimeOptions'
    other fields (profile, host_head, host_embedding, use_graphs, cpu_threads, kv_dtype, ...)."""
    if not isinstance(model, LoadedModel):
        from loaders import open_model
        model = open_model(model)
    opts = RuntimeOptions(vram=parse_vram(vram), n_ctx=ctx, policy=policy or OffloadPolicy(),
                          **options)
    return OffloadRuntime(model, opts, progress)


class OffloadRuntime(Backend):
    """A MoE model under a VRAM cap (module docstring), a Backend."""

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
        model_cls = MODELS.get(loaded.arch.name)
        if model_cls is None:
            raise OffloadError(f"architecture {loaded.arch.name!r} has no forward pass; "
                               f"runnable: {', '.join(MODELS)}")
        self.opts, self.config, self.policy = opts, loaded.config, opts.policy
        pol = self.policy
        self.device = dev = torch.device(opts.device)
        self.report = rep = LoadReport()
        c = self.config
        t0 = time.perf_counter()
        plan = VramLedger(opts.vram)   # the start-up plan; refuses a cap too small, with numbers
        torch.cuda.reset_peak_memory_stats(dev)
        self.smi = SmiPeak()
        # The CUDA context, cuBLAS and kernel images live outside torch's allocator but count in
        # nvidia-smi: measure them once everything is initialised and keep them inside the cap.
        torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        # this process's use now (nvidia-smi), and the device's: later, the change of the
        # device's figure (one cheap call) tells how ours has changed (ElasticVram.measure_outside)
        proc0, dev_used0 = self.smi.sample(), total - free
        outside = max(0, (proc0 or (total - free)) - torch.cuda.memory_reserved(dev))
        outside += pol.context_margin
        plan.reserve("CUDA context + libraries", outside,
                     "the GPU runtime alone needs this much before any weight")
        base = torch.cuda.memory_allocated(dev)
        from native.ops import _cpu
        if _cpu is not None:
            _cpu.set_threads(opts.cpu_threads or pol.cpu_threads(len(os.sched_getaffinity(0))))

        # 1. dense weights, quantized, on the GPU (experts stay in the file's memory map); the
        # embedding (and on request the head) in pinned host RAM, read by the GPU over PCIe
        on_host = host_weight_names(loaded, opts.host_embedding, opts.host_head)
        tensors, _ = upload_weights(loaded, dev, experts_device="cpu",
                                    fuse=model_cls.FUSED_PROJECTIONS, keep_on_host=on_host)
        self._pinned_weights: list[torch.Tensor] = []
        for name in on_host:
            tensors[name] = self._pin_weight(tensors[name])
            rep.host_weights[name] = tensors[name].data.numel()
        mtp_up = None
        if opts.mtp:   # its dense weights on the GPU (inside the cap), its experts in host RAM
            from ..models.weights import upload_mtp
            mtp_up = upload_mtp(loaded, dev, experts_device="cpu")
            if mtp_up is None:
                raise OffloadError("this model has no MTP block (nextn_predict_layers = 0): "
                                   "speculative decoding needs one; use --draft 0")
        torch.cuda.synchronize(dev)
        dense = torch.cuda.memory_allocated(dev) - base
        rep.seconds["dense upload"] = time.perf_counter() - t0
        plan.reserve("dense weights", dense,
                     "the always-active weights alone exceed the cap; use a smaller quant")
        mtp_experts = None
        if mtp_up is not None:
            mtp_experts = self._place_mtp_experts(loaded, mtp_up[1], opts.mtp_experts, plan)
        cap_allocator(opts.vram - outside, dev)

        # 2. per-sequence state for the requested context (B = 1), allocated now so that the
        # cache is sized around it. Elastic: the KV maps memory as the context grows (the cache
        # gives it slots then, and takes them back for the next conversation)
        elastic = pol.elastic and on.elastic_supported()
        probe = State(c, 1, opts.n_ctx, "meta", opts.kv_dtype)
        plan.reserve("KV + delta-net state", probe.nbytes, "lower --ctx")
        most = min(ops.DECODE_MAX_TOKENS, on.MAX_SELECTIONS // c.n_expert_used)   # a step's tokens
        if not 1 <= opts.max_sequences <= most:
            raise OffloadError(f"max_sequences {opts.max_sequences}: a decode step takes 1 to "
                               f"{most} tokens, one a sequence; hold 1 to {most} (--parallel)")
        self._states: dict[int, State] = {   # the first; more are added as asked (new_state)
            0: State(c, 1, opts.n_ctx, dev, opts.kv_dtype, pol.graph_bucket,
                     kv_alloc=on.ElasticBuffer if elastic else None)}
        self._in_use: set[int] = set()
        self._states[0].snapshots_on_host = True

        # 3. workspaces: prefill activations + attention for one chunk, graphs, staging
        plan.reserve("workspace", gpu_workspace_bytes(c, opts.n_ctx, pol),
                     "lower --ctx or the prefill chunk")

        # 4. host expert banks
        t1 = time.perf_counter()
        self.bank = HostExpertBank(loaded, progress=(lambda d, t: progress("experts to host RAM", d, t))
                                   if progress else None)
        rep.seconds["host banks"] = time.perf_counter() - t1
        rep.seconds["pin"] = self.bank.pin_seconds
        rep.pinned = self.bank.pinned
        t1 = time.perf_counter()
        if self.bank.repack_for_cpu(opts.cpu_repack, progress=(
                lambda d, t: progress("the CPU's repacked experts", d, t)) if progress else None):
            rep.seconds["cpu repack"] = time.perf_counter() - t1
            rep.cpu_repacked_bytes = sum(int(b.numel()) for b in self.bank.cpu_banks)

        # 5. the expert cache from what is left: this many slots even during the largest prefill
        # chunk; while decoding (elastic) it also borrows the prefill workspace and staging
        layouts = self.bank.layouts
        plan.reserve("prefill staging",
                     staging_bytes(max(lay.expert_bytes for lay in layouts), pol.staging_experts),
                     "lower --vram use elsewhere")
        chunk = on.elastic_chunk() if elastic else 0
        slots = ExpertCache.plan_slots(layouts, plan.left, c.n_expert, chunk)
        if opts.cache_slots is not None:  # a smaller cache on purpose (tests, experiments)
            slots = [min(s, opts.cache_slots) for s in slots]
        self.cache = ExpertCache(layouts, slots, c.n_expert, dev, elastic=elastic, policy=pol)
        plan.reserve("expert cache", self.cache.nbytes)
        rep.slots_per_layer = slots
        rep.elastic, rep.cache_outside_torch = self.cache.elastic, self.cache.outside_torch
        self.vram = ElasticVram(opts.vram, outside, self.cache, self._states, pol, dev, self.smi,
                                proc0, dev_used0, opts.cache_slots)
        # the sampler's rows at once: every sequence of a batched step, or a verify step's
        self.vram.sampling = pol.sampling_workspace(c.n_vocab, max(opts.max_sequences,
                                                                   1 + DRAFT.k_max if opts.mtp else 1))
        self.vram.cap_torch()

        # 6. scheduler rates, engine, model
        fraction = pol.fetch_fraction
        if not self.bank.pinned and fraction is None:
            fraction = 0.0  # pageable banks: the GPU cannot read them directly
        self.scheduler = Scheduler.create(Rates(1.0, 1.0), dev, forced=fraction, ema=pol.cpu_rate_ema)
        self.engine = OffloadEngine(self.cache, self.bank, self.scheduler, top_k=c.n_expert_used,
                                    hidden=c.n_embd, ff=c.n_ff_exp, policy=pol,
                                    link_gbps=opts.link_gbps)
        self.model = model_cls(c, tensors, [LayerExperts(self.engine, i) for i in range(c.n_layer)],
                               moe_pair=SharedBeside())
        # the MTP head: eager; its routed experts by the pool kernel, from VRAM or pinned RAM
        from ..models.mtp import MtpHead
        self.mtp = None if mtp_up is None else MtpHead(
            self.model, mtp_up[0], ResidentPool(mtp_experts, top_k=c.n_expert_used,
                                                ff=c.n_ff_exp, max_tok=self.engine.max_tok))
        self.scheduler.rates = measure_rates(self.cache, self.bank, c, self.engine.link)
        self.scheduler.apply()
        self._reguess = False   # _observe found that guessing should start or stop
        if self._guessing_pays():
            self.engine.set_predictor(self.model.router_logits, pol.guesses(c.n_expert_used))
        self._torch_peak = 0
        self.prefill_memory: list[dict] = []
        if self.cache.elastic:   # the unmapped KV and the prefill workspace, lent to the cache
            self.vram.fit("decode", self.vram.decode_headroom, grow=True)
        rep.decode_slots_per_layer = self.cache.slots
        profile = load_profile(opts.profile, c.n_layer, c.n_expert) if opts.profile else None
        t2 = time.perf_counter()
        self.cache.warm_start(self.bank, profile, top_k=c.n_expert_used)
        torch.cuda.synchronize(dev)
        rep.seconds["warm start"] = time.perf_counter() - t2
        self._graphs: dict[tuple, tuple] = {}
        self._captured_sizes: set[int] = set()   # tokens a step of the graphs captured so far
        self.captures = 0   # graphs captured so far (a capture costs many steps: DraftPolicy)
        self.guessing_changes = 0   # times guessing started or stopped after start-up
        self.capture_s = 0.0   # host wall time those captures took
        self._graph_pool = torch.cuda.graph_pool_handle()
        self._since_observe, self._obs_busy, self._obs_experts = 0, 0, 0
        self._recorder: RoutingRecorder | None = None
        self.reset_stats()
        rep.budget = plan.summary()
        rep.seconds["total"] = time.perf_counter() - t0

    def _place_mtp_experts(self, loaded, experts, where: str, plan: VramLedger):
        """The MTP layer's routed experts (CPU banks over the file's map) -> ResidentExperts on
        the GPU, booked in the start-up plan as their own purpose before the cache is sized
        from what is left, or (where="host") in pinned host RAM viewed by the GPU.

        Why not an extra layer of the offload engine: its cache, plan and CPU worker are built
        per trunk layer and a draft call would pay their machinery (and the cache's misses) for
        one layer's top-k; resident, a draft's experts cost one pool kernel, no miss ever. The
        price is VRAM the cache does not get: 256 x 1.35 MB = 346 MB on a 35B-A3B at IQ3_S (as
        much as one trunk layer's experts). "host" costs no VRAM and reads a draft token's 8
        experts (~11 MB) over PCIe instead."""
        from ..models.weights import ResidentExperts, mtp_experts
        if where not in ("gpu", "host"):
            raise OffloadError(f"mtp_experts {where!r}: 'gpu' (resident) or 'host' (pinned RAM)")
        if where == "host":
            from native.ops import QTensor
            return ResidentExperts(*(self._pin_weight(QTensor(q.data.contiguous(), q.qtype, q.shape,
                                                              q.name))
                                     for q in (experts.gate, experts.up, experts.down)))
        dev = self.device
        before = torch.cuda.memory_allocated(dev)
        on_gpu = mtp_experts(loaded, dev)
        torch.cuda.synchronize(dev)
        plan.reserve("MTP experts", torch.cuda.memory_allocated(dev) - before,
                     "the MTP head's experts do not fit beside the dense weights; "
                     "use --draft 0 or a larger --vram")
        return on_gpu

    def _pin_weight(self, q):
        """A CPU QTensor -> the same weight in pinned host RAM, viewed as a CUDA tensor (kernels
        read it over PCIe at its host address)."""
        from native.ops import QTensor
        host = torch.empty_like(q.data)
        host.copy_(q.data)
        on.pin_host(host)
        self._pinned_weights.append(host)
        return QTensor(on.host_view(host), q.qtype, q.shape, q.name, q.parts)

    # -- sequences ---------------------------------------------------------------------------------
    @property
    def caps(self) -> Capabilities:
        n = self.opts.max_sequences
        return Capabilities(max_sequences=n, batched=n > 1, speculative=self.mtp is not None,
                            shared_state=n == 1, offload=True)

    @property
    def max_sequences(self) -> int:
        return self.opts.max_sequences

    def new_state(self, batch: int = 1, n_ctx: int | None = None, kv_dtype=None) -> State:
        """An emptied single-sequence state. With max_sequences = 1 it is always the same one
        (its KV budgeted at start; the captured graphs are bound to its buffers); with more, a
        state not handed out yet while fewer than max_sequences exist (room made in the cache),
        then the first one again: callers that hold several give back the ones they are done
        with (`release`)."""
        n = n_ctx or self.opts.n_ctx
        if n > self.opts.n_ctx:
            raise OffloadError(f"a context of {n} needs more VRAM than was budgeted for "
                               f"{self.opts.n_ctx}; restart with --ctx {n}")
        if batch != 1:
            raise OffloadError("the offload runtime's states hold one sequence each; step several "
                               "together with decode_many")
        st = next((s for k, s in self._states.items() if k not in self._in_use), None)
        if st is None and len(self._states) < self.opts.max_sequences:
            st = self._add_state()
        if st is None:
            raise OffloadError(f"all {self.opts.max_sequences} sequences this runtime holds are in "
                               "use; release one, or open it with more (max_sequences, --parallel)")
        if self.opts.max_sequences > 1:
            self._in_use.add(self._key_of(st))
        self._empty(st)
        return st

    def release(self, state: State) -> None:
        """A state handed out by new_state is free again (its KV memory goes back to the cache)."""
        self._in_use.discard(self._key_of(state))
        self._empty(state)

    def _key_of(self, state: State) -> int:
        for k, s in self._states.items():
            if s is state:
                return k
        raise OffloadError("this state does not belong to this runtime (use its new_state)")

    def _add_state(self) -> State:
        """One more sequence's state: its delta-net state from torch and its elastic KV, the
        cache shrunk first so both fit under the cap beside decode's headroom."""
        c, opts, pol = self.config, self.opts, self.policy
        first = self._states[0]
        recurrent = first.recurrent_nbytes
        kv = first.kv_bytes(1) if first.elastic_kv else first.nbytes - recurrent
        self.vram.keep_free("another sequence", recurrent + kv + self.vram.decode_headroom)
        st = State(c, 1, opts.n_ctx, self.device, opts.kv_dtype, pol.graph_bucket,
                   kv_alloc=on.ElasticBuffer if first.elastic_kv else None)
        st.snapshots_on_host = True
        self._states[len(self._states)] = st
        self.vram.cap_torch()
        return st

    def _empty(self, st: State) -> None:
        st.reset()
        if st.elastic_kv and st.kv_rows > 1:   # an empty conversation: the KV's memory goes back
            torch.cuda.synchronize(self.device)   # to the cache at the next decode step
            st.map_kv(1)
            self.vram.cap_torch()
            self.vram.grow_pending = True

    def snapshot(self, state: State) -> Snapshot:
        """A rewind point for `state` (its recurrent part copied; KV rows below it are kept)."""
        return state.snapshot()

    def restore(self, state: State, snap: Snapshot) -> None:
        """Rewind `state` to a snapshot taken from it (valid while the KV rows below the
        snapshot's position were not rewritten)."""
        state.restore(snap)

    # -- prompts -----------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, state: State, chunk: int | None = None,
                all_logits: bool = False, hidden: bool = False):
        """tokens [B, T] on the device -> last logits [B, V] (or all [B, T, V]); hidden: and
        every position's final-normed hidden state [B, T, H] (the MTP head's input)."""
        chunk = chunk or self.policy.prefill_chunk
        n, past = tokens.shape[1], state.n_past
        if n <= self.policy.short_prompt and not all_logits:
            return self._prefill_in_steps(tokens, state, hidden)
        self._make_room(state, n, chunk, all_logits)
        with self._measured("prefill", n, past, chunk, all_logits):
            out = self.model.prefill(tokens, state, chunk, all_logits, hidden)
        self._lend_staging()
        return out

    def _prefill_in_steps(self, tokens: torch.Tensor, state: State, hidden: bool):
        """A short prompt as decode steps: engine.max_tok tokens at a time as verify steps (a
        graph per attended length, like decode's), the last few tokens as decode steps (decode's
        own graphs; verify steps where the hidden states are wanted). Each layer's misses are
        planned and fetched into the cache (or computed on the CPU) on the device, with no host
        sync, and the cache lends nothing to a workspace. Only the last step's logits are kept:
        decode's headroom under the cap holds one step's, not a prompt's."""
        state.check_room(tokens.shape[1])
        step, n = self.engine.max_tok, tokens.shape[1]
        states = []
        for s in range(0, n, step):
            t = tokens[:, s:s + step]
            last = None   # the previous step's logits go before this step allocates its own
            if t.shape[1] == step or hidden:
                lg, h = self.verify(t, state)
                last = lg[:, -1].clone()   # not a view that keeps all T rows
                states.append(h)
                del lg
            else:
                for j in range(t.shape[1]):
                    last = None
                    last = self.decode(t[:, j], state)
        return (last, torch.cat(states, dim=1)) if hidden else last

    def forward(self, tokens: torch.Tensor, state: State, last_only: bool = False) -> torch.Tensor:
        n, past = tokens.shape[1], state.n_past
        self._make_room(state, n, n, not last_only)
        with self._measured("forward", n, past, n, not last_only):
            out = self.model.forward(tokens, state, last_only)
        self._lend_staging()
        return out

    def _make_room(self, state: State, n: int, chunk: int, all_logits: bool) -> None:
        """Before n prompt tokens: the context must hold them (checked before anything is
        mapped), the KV is mapped that far, and torch gets the chunk's workspace."""
        state.check_room(n)
        self.vram.room_for_kv(state, state.n_past + n)
        eng = self.engine
        self.vram.room_for_prefill(self.config, n, state.n_past, chunk, all_logits,
                                   eng.staging_bytes if eng.staging is None else 0)
        eng.ensure_staging()

    def _lend_staging(self) -> None:
        """After a prompt: an elastic cache takes the prefill staging (87 MB on the 35B, ~1.6
        slots a layer) while decoding; the next prompt makes room for it again."""
        if self.cache.elastic and self.engine.release_staging():
            self.vram.grow_pending = True

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

    # -- decode ------------------------------------------------------------------------------------
    def decode(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """One token per sequence: tokens [B] on the device -> logits [B, V] (a fresh tensor)."""
        B = tokens.shape[0]
        if B != state.batch or B > self.engine.max_tok:
            raise OffloadError(f"a decode step of {B} sequences on a state of {state.batch}: the "
                               "offload runtime decodes one sequence at a time for now")
        state.check_room(1)
        self.vram.room_for_kv(state, state.attn_len(1))   # attention reads up to the bucket's end
        self.vram.regrow()   # the last prefill (or KV) borrowed from the cache: take it back
        run = lambda t: self.model.decode(t, state)   # noqa: E731
        self.engine.position = state.pos
        if not self.opts.use_graphs:
            return self._eager(tokens, B, run, observe=True)
        logits = self._replay((id(state), state.attn_len(1)), tokens, [state], B, run)
        state.n_past += 1       # the captured step advanced the device position only
        state.steps_taken = 0   # (host bookkeeping a replay does not run)
        self._observe()
        return logits.clone()

    def decode_many(self, tokens: torch.Tensor, states: list[State]) -> torch.Tensor:
        """One token for each of B sequences at their own positions, in one decode step: tokens
        [B] on the device, B states from new_state -> logits [B, V] (a fresh tensor). Each
        layer's experts are planned, fetched and computed once for the B tokens (the union of
        their choices); the mixers run per sequence. Captured as a graph per (states, attended
        lengths)."""
        B = tokens.shape[0]
        if len(states) != B or not 1 <= B <= self.engine.max_tok:
            raise OffloadError(f"decode_many takes 1..{self.engine.max_tok} tokens, one a state; "
                               f"got {B} tokens and {len(states)} states")
        if B == 1:
            return self.decode(tokens, states[0])
        if len({id(st) for st in states}) != B:
            raise OffloadError("decode_many got the same state twice; one token a sequence")
        for st in states:
            self._key_of(st)
            st.check_room(1)
        for st in states:
            self.vram.room_for_kv(st, st.attn_len(1))
        self.vram.regrow()
        run = lambda t: self.model.decode_many(t, states)   # noqa: E731
        self.engine.position = None   # several positions: trace rows by step
        if not self.opts.use_graphs:
            return self._eager(tokens, B, run, observe=True)
        key = ("many",) + tuple((id(st), st.attn_len(1)) for st in states)
        # batches come and go, a key per lengths' combination: keep the captured set bounded
        logits = self._replay(key, tokens, states, B, run, bounded=True)
        for st in states:
            st.n_past += 1
            st.steps_taken = 0
        self._observe()
        return logits.clone()

    def _replay(self, key, tokens: torch.Tensor, states: list[State], n_tok: int, run,
                bounded: bool = False):
        """run(tokens) as one decode step of n_tok tokens: the graph captured for `key` (captured
        now if new; `bounded`: all dropped first once policy.max_graphs are kept), replayed on
        tokens. Returns the graph's outputs (its own tensors: callers clone them). The host
        counters of `states` are the caller's to advance."""
        self._follow_guessing()
        g = self._graphs.get(key)
        if g is None:
            if bounded and len(self._graphs) >= self.policy.max_graphs:
                self._drop_graphs()
            g = self._graphs[key] = self._measured_capture(tokens, states, n_tok, run)
        graph, tok_in, out = g
        tok_in.copy_(tokens)
        self.engine.arm(n_tok)
        graph.replay()          # not waited for: the next step's launch queues behind it
        return out

    def _eager(self, tokens: torch.Tensor, n_tok: int, run, observe: bool = False):
        """One decode step of n_tok tokens run eagerly (run(tokens) inside the engine's step)."""
        self._follow_guessing()
        eng = self.engine
        eng.arm(n_tok)
        with eng.decode_step():
            out = run(tokens)
        eng.settle()
        if observe:
            self._observe()
        return out

    def _observe(self) -> None:
        """Every few steps, fold the CPU worker's measured rate into the scheduler (the plan
        kernel reads the new split from device memory: no re-capture)."""
        self._since_observe += 1
        if self._since_observe < self.policy.observe_every:
            return
        self._since_observe = 0
        busy = sum(self.engine.worker.busy_ns())
        n = sum(self.engine.worker.experts())
        d_busy, d_n = busy - self._obs_busy, n - self._obs_experts
        self._obs_busy, self._obs_experts = busy, n
        if d_n >= self.policy.observe_min_experts:   # enough CPU work to trust the rate
            eb = float(np.mean([lay.expert_bytes for lay in self.bank.layouts]))
            self.scheduler.observe_cpu(d_busy / 1e9, d_n * eb)
            self._recheck_guessing()

    def _guessing_pays(self) -> bool:
        """Whether decode steps should guess the next layer's experts. Guesses travel over the
        link: only with pinned banks, and while the link takes at least
        policy.prefetch_min_fetch_share of the misses (once guessing, down to that share less
        prefetch_hysteresis, so that a rate measured near the line does not flip it back and
        forth); always when a number of guesses was asked for (the user's choice)."""
        pol = self.policy
        if not (pol.prefetch and self.bank.pinned):
            return False
        if pol.prefetch_k is not None:
            return True
        guessing = self.engine.predict is not None
        return self.scheduler.q() >= pol.prefetch_min_fetch_share - guessing * pol.prefetch_hysteresis

    def _recheck_guessing(self) -> None:
        """After a new measure of the CPU's rate: start or stop guessing (not while a trace is
        replayed, which guesses nothing), at the next step's start (_follow_guessing)."""
        if self.engine.trace is None and self._guessing_pays() != (self.engine.predict is not None):
            self._reguess = True

    def _follow_guessing(self) -> None:
        """Before a step: apply what _recheck_guessing found. The captured steps hold the guesses'
        kernels, or lack them: they are captured anew."""
        if not self._reguess:
            return
        self._reguess = False
        on = self.engine.predict is None
        self.engine.set_predictor(self.model.router_logits if on else None,
                                  self.policy.guesses(self.config.n_expert_used))
        self.guessing_changes += 1
        torch.cuda.synchronize(self.device)   # no replay of a graph about to go is in flight
        self._drop_graphs(new_kernels=True)   # (guesses' kernels may not have run yet)

    # -- speculative decoding: a verify step of T <= engine.max_tok positions ---------------------
    def keep_steps(self, state: State, depth: int) -> None:
        """State.keep_steps (and the MTP layer's KV) with room made under the cap first."""
        c = self.config
        need = 0
        if depth > 0 and (not state.steps or next(iter(state.steps.values()))[0].shape[0] < depth):
            need += depth * state.recurrent_nbytes
        if state.mtp_k is None and self.mtp is not None:
            need += 2 * state.batch * state.n_ctx * c.n_head_kv * c.head_dim * \
                torch.finfo(state.kv_dtype).bits // 8
        if need:
            self.vram.keep_free("speculative decoding", need + self.vram.decode_headroom)
            self._drop_graphs()   # a new depth is a new verify graph
        state.keep_steps(depth)
        if self.mtp is not None:
            state.add_mtp_kv()
        self.vram.cap_torch()

    def verify(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [1, T] on the device, 1 <= T <= engine.max_tok -> (logits [1, T, V], the
        final-normed hidden states [1, T, H]), fresh tensors. One decode step of T tokens: the
        union of their experts planned and fetched once; captured as a graph per (T, attended
        length). With state.keep_steps the delta-net state after each token is kept (rewind)."""
        T = tokens.shape[1]
        if state.batch != 1 or not 1 <= T <= self.engine.max_tok:
            raise OffloadError(f"a verify step takes 1..{self.engine.max_tok} tokens of one "
                               f"sequence, got {list(tokens.shape)}")
        state.check_room(T)
        self.vram.room_for_kv(state, state.attn_len(T))
        self.vram.regrow()
        depth = next(iter(state.steps.values()))[0].shape[0] if state.steps else 0
        keep = 1 < T <= depth + 1
        run = lambda t: self.model.forward(t, state, hidden=True)   # noqa: E731
        self.engine.position = state.pos
        if not self.opts.use_graphs:
            return self._eager(tokens, T, run, observe=True)
        key = ("verify", id(state), T, state.attn_len(T), keep, depth)
        logits, hidden = self._replay(key, tokens, [state], T, run)
        state.n_past += T       # the captured step advanced the device position only
        state.steps_taken = T if keep else 0
        self._observe()
        return logits.clone(), hidden.clone()

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, state: State, k: int) -> torch.Tensor:
        """k greedy draft ids [k] on the device from the MTP head: first on the trunk's hidden
        states it is owed, hidden [1, T, H], with the tokens that follow them [1, T], then k - 1
        times on its own last state and draft. state.mtp_past moves by T (the drafts' KV rows are
        provisional). Captured as one graph per (state, T, k, attended length) where graphs are
        on and the head's experts are in VRAM: a draft is some 30 small kernels, which launched
        one by one from Python cost several times their GPU time."""
        mtp, T, p = self.mtp, tokens.shape[1], state.mtp_past
        if mtp is None:
            raise OffloadError("this runtime has no MTP head: open it with RuntimeOptions(mtp=True)")
        if p + T + k - 1 > state.n_ctx:
            raise OffloadError(f"the MTP layer's KV holds {state.n_ctx} positions; "
                               f"{p + T + k - 1} needed")
        from ..models.mtp import greedy_drafts
        n_attn = state.rows_attended(p + T + k - 1)
        guess = self._draft_guesses(k)

        def run(toks, h, at):
            out = greedy_drafts(mtp, h, toks, state, k, at=at, n_attn=n_attn, known=guess)
            if guess is not None:
                self.engine.join_draft_guesses()
            return out

        capturable = isinstance(mtp.experts, ResidentPool) and mtp.experts.capturable(T)
        if not (self.opts.use_graphs and capturable):
            return run(tokens, hidden, None)
        out = self._replay_head(("draft", id(state), T, k, n_attn, guess is not None), run,
                                tokens, hidden, state)
        state.mtp_past = p + T
        return out.clone()

    def mtp_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, state: State) -> None:
        """Write the MTP KV rows the head is owed: hidden [1, T, H] (the trunk's final-normed
        states from state.mtp_past on), tokens [1, T] (the tokens after them), T <=
        engine.max_tok. Captured as one graph per (state, attended length) over max_tok rows:
        a shorter call pads its rows, and the padding's KV rows land past state.mtp_past, where
        rows are provisional (the next write covers them) and no real row attends to them. An
        eager call of the head costs ~1.7 ms of launches from Python; a replay ~0.2."""
        mtp, T, p = self.mtp, tokens.shape[1], state.mtp_past
        if mtp is None:
            raise OffloadError("this runtime has no MTP head: open it with RuntimeOptions(mtp=True)")
        n = self.engine.max_tok
        if not (1 <= T <= n and self.opts.use_graphs and mtp.experts.capturable(n)
                and p + n <= state.n_ctx):
            mtp.forward(hidden, tokens, state, logits="none")
            return
        n_attn = state.rows_attended(p + n)

        def run(toks, h, at):
            return mtp.forward(h, toks, state, logits="none", at=at, n_attn=n_attn)[1]

        if T < n:   # padding: the last row again (any values would do)
            hidden = torch.cat((hidden, hidden[:, -1:].expand(1, n - T, hidden.shape[2])), 1)
            tokens = torch.cat((tokens, tokens[:, -1:].expand(1, n - T)), 1)
        self._replay_head(("mtp_rows", id(state), n_attn), run, tokens, hidden, state)
        state.mtp_past = p + T

    def _draft_guesses(self, k: int):
        """known(ids) for greedy_drafts: the verify step's first layers guessed for the tokens
        known while the last draft is computed (policy.draft_guess_layers), or None: off, or
        no guesses at all now (a replayed trace, or the link's share of the misses too low)."""
        n = self.policy.draft_guess_layers
        if not (n and self.prefetching):
            return None
        model, eng = self.model, self.engine
        return lambda ids: eng.guess_while_drafting(
            ids, lambda: model.embedding_moe_inputs(ids, n), n_verify=k + 1)

    def _replay_head(self, key, run, tokens: torch.Tensor, hidden: torch.Tensor, state: State):
        """run(tokens, hidden, at) of the MTP head as the graph captured for `key` (now, if new),
        replayed on these inputs at p = state.mtp_past -> the graph's output (its own tensor).
        state.mtp_past is the caller's to move."""
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture_head(run, tokens, hidden, state, state.mtp_past)
        graph, (tok_in, h_in, at_in), out = g
        tok_in.copy_(tokens)
        h_in.copy_(hidden)
        at_in.fill_(state.mtp_past)
        graph.replay()
        return out

    def _capture_head(self, run, tokens: torch.Tensor, hidden: torch.Tensor, state: State, p: int):
        """run(tokens, hidden, at) as a graph over copies of its inputs, after one eager run (lazy
        inits; it writes the same KV rows the graph will), with the capture's memory measured as
        a decode step's is. -> (graph, inputs, outputs)."""
        inputs = (tokens.clone(), hidden.clone(),
                  torch.full((), p, dtype=torch.long, device=self.device))
        with self._accounted_capture(remeasure=False):
            try:
                run(*inputs)
                state.mtp_past = p
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._graph_pool):
                    out = run(*inputs)
            finally:
                state.mtp_past = p   # the host count moved while capturing; the caller moves it
        return g, inputs, out

    def _measured_capture(self, tokens: torch.Tensor, states: list[State], n_tok: int, run):
        """Capture a decode step, measuring what it costs, so that decode keeps only that much
        free beside the cache (the first capture's figure stands for the later ones; a later
        capture that finds less room under the cap shrinks the cache first)."""
        # a step size captured before has loaded its kernels and lazy state: a new batch of
        # that size (other states, other lengths) needs no eager warm-up and no new measure of
        # the memory outside torch, a large part of what a capture costs
        first = n_tok not in self._captured_sizes
        with self._accounted_capture(remeasure=first):
            g = self._capture(tokens, states, n_tok, run, warm_up=first)
        self._captured_sizes.add(n_tok)
        return g

    @contextlib.contextmanager
    def _accounted_capture(self, remeasure: bool):
        """Around a graph capture: room under the cap first; after it, the memory it took (the
        most any capture took stays free beside the cache; `remeasure`: new kernels were loaded,
        measure the memory outside torch again), its count and its wall time."""
        dev = self.device
        t0 = time.perf_counter()
        self.vram.before_capture()
        self._torch_peak = max(self._torch_peak, torch.cuda.max_memory_reserved(dev))
        torch.cuda.reset_peak_memory_stats(dev)
        yield
        self.captures += 1
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        self.vram.after_capture(torch.cuda.max_memory_reserved(dev) - torch.cuda.memory_reserved(dev),
                                remeasure=remeasure)
        self.capture_s += time.perf_counter() - t0

    def _capture(self, tokens: torch.Tensor, states: list[State], n_tok: int, run,
                 warm_up: bool = True):
        """run(tokens) -> outputs, as a graph over a copy of tokens: (graph, its tokens, outputs)."""
        tok_in = tokens.clone()
        if warm_up:
            # once eagerly (lazy inits, allocator) -- this is a real step, so rewind after
            snaps, stats = [st.snapshot() for st in states], self.cache.stats.clone()
            self._eager(tok_in, n_tok, run)
            for st, snap in zip(states, snaps):
                st.restore(snap)
            self.cache.stats.copy_(stats)  # the warm-up is not a step of the run
        g = torch.cuda.CUDAGraph()
        n_past = [st.n_past for st in states]
        try:
            with torch.cuda.graph(g, pool=self._graph_pool), self.engine.decode_step():
                out = run(tok_in)
        finally:
            for st, n in zip(states, n_past):
                st.n_past = n  # capture ran no kernels; the host counters must not move
        return g, tok_in, out

    def _drop_graphs(self, new_kernels: bool = False) -> None:
        """The next decode steps capture anew (in a new pool: a pool whose graphs are all gone
        cannot be captured into again); `new_kernels`: they run kernels no step has run yet
        (recording, replayed routing), so each size is warmed up again before its capture."""
        if new_kernels:
            self._captured_sizes.clear()
        self.engine.settle()
        self._graphs.clear()
        self._graph_pool = torch.cuda.graph_pool_handle()

    # -- routing: record it, or replay a trace ------------------------------------------------------
    def attach_recorder(self, recorder: RoutingRecorder | None) -> RoutingRecorder | None:
        """Record the ids every later decode step routes into `recorder` (None: stop)."""
        c = self.config
        self.engine.record = (None if recorder is None
                              else recorder.bind(c.n_layer, c.n_expert_used, self.device))
        self._recorder = recorder
        self._drop_graphs(new_kernels=True)
        return recorder

    def replay(self, trace, by_position: bool = False) -> None:
        """Route decode steps by a trace [N, L, K] of expert ids (numpy or torch; step s uses
        row (s - 1) mod N, and token t of a step of several tokens row (s - 1 + t * N / max_tok)
        mod N: sequences stepped together by decode_many follow their own stretches of the trace)
        instead of the model's router; None: the model's routing again.
        by_position: a token at position p uses row p mod N instead (decode and verify steps
        of one sequence; a verify step's T tokens their T rows), so speculative and plain
        decoding route every position alike. Guesses are off while replaying (the router
        cannot guess replayed ids)."""
        self.engine.trace_by_position = by_position
        if trace is not None:
            trace = torch.as_tensor(np.asarray(trace) if not isinstance(trace, torch.Tensor)
                                    else trace).long().to(self.device)
            c = self.config
            if trace.dim() != 3 or tuple(trace.shape[1:]) != (c.n_layer, c.n_expert_used):
                raise OffloadError(f"a routing trace is [steps, {c.n_layer}, {c.n_expert_used}], "
                                   f"got {list(trace.shape)}")
        self.engine.trace = trace
        self._drop_graphs(new_kernels=True)

    @property
    def prefetching(self) -> bool:
        """Whether decode steps guess the next layer's experts now."""
        return self.engine.predict is not None and self.engine.trace is None

    # -- statistics ----------------------------------------------------------------------------------
    def stats(self) -> RuntimeStats:
        """Cache and CPU statistics since the last reset_stats() (a sync point)."""
        self.engine.settle()
        s = self.cache.read_stats()
        busy = (np.asarray(self.engine.worker.busy_ns()) - self._busy0) / 1e9
        cpu_experts = np.asarray(self.engine.worker.experts()) - self._experts0
        eb = self.bank.layouts[0].expert_bytes
        sch = self.scheduler
        return RuntimeStats(
            selections=s.selections, hits=int(s.hits.sum()), fetched=int(s.fetched.sum()),
            cpu=int(s.cpu.sum()), hit_rate=s.hit_rate, prefetched=int(s.prefetched.sum()),
            prefetch_hits=int(s.prefetch_hits.sum()), prefetch_precision=s.prefetch_precision,
            prefetch_recall=s.prefetch_recall,
            pcie_bytes=int(s.fetched.sum() + s.prefetched.sum()) * eb,
            cpu_expert_s=float(busy.sum()), cpu_experts=int(cpu_experts.sum()),
            prefill_streamed=int(self.engine.prefill_streamed.sum()),
            cache_slots=self.cache.slots, cache_bytes=self.cache.nbytes,
            kv_bytes=self.vram.kv_mapped(), fetch_fraction=sch.q(), min_fetch=sch.min_fetch(),
            rates={"link_GBps": sch.rates.link_bytes_per_s / 1e9,
                   "cpu_GBps": sch.rates.cpu_bytes_per_s / 1e9,
                   **({"link_emulated_GBps": self.engine.link.gbps} if self.engine.link else {})},
            per_layer=[{"layer": i, "hits": int(s.hits[i]), "fetched": int(s.fetched[i]),
                        "cpu": int(s.cpu[i]), "cpu_s": float(busy[i]),
                        "prefetched": int(s.prefetched[i]), "prefetch_hits": int(s.prefetch_hits[i])}
                       for i in range(len(s.hits))])

    def reset_stats(self) -> None:
        self.engine.settle()
        self.cache.reset_stats()
        self.engine.prefill_streamed.zero_()
        self._busy0 = np.asarray(self.engine.worker.busy_ns())
        self._experts0 = np.asarray(self.engine.worker.experts())

    def routing_counts(self) -> np.ndarray:
        """[L, E] selections seen since start: the routing profile to save."""
        return self.cache.routing_counts()

    def vram_peaks(self) -> dict:
        d = allocator_peaks(self.device)   # torch's allocator; the elastic cache is outside it
        d["reserved_peak"] = max(d["reserved_peak"], self._torch_peak)
        d["cache_peak"] = self.vram.cache_peak
        self.smi.sample()
        d["nvidia_smi_peak"] = self.smi.peak_bytes
        d["outside_budget"] = self.vram.outside   # context + libraries, as budgeted now
        d["cap"] = self.opts.vram
        return d

    # -- the end -------------------------------------------------------------------------------------
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
        # No GPU memory held after close, even while the object lives on: the next runtime of
        # this process sizes its cache from what is allocated under its cap (one opened while a
        # closed one still held its weights and graph pool got no cache slots at all)
        self.model = self.mtp = self.engine.predict = None
        self._states.clear()
        self._graph_pool = None
        gc.collect()
        # cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it ran on, for the life
        # of the process: each runtime's own streams would leave theirs behind
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()

    def __enter__(self) -> "OffloadRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unpin_weights(self) -> None:
        for t in getattr(self, "_pinned_weights", []):
            on.unpin_host(t, missing_ok=True)
        self._pinned_weights = []
