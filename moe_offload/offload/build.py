"""Assembly of the offload runtime, in the order the VRAM cap is planned: the CUDA context, the
dense weights (quantized, on the GPU; the token embedding and on request the head in pinned host
RAM), the MTP head, per-sequence state for the context, workspaces, the host expert banks, the
expert cache from what is left (elastic: it lends VRAM to prompts and a growing KV), the
scheduler's measured rates, the engine and the model. `assemble` returns the parts; on any
failure it gives back what it took (the allocator cap, pinned pages)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from loaders import LoadedModel
from native import offload_native as on
from native import kv_cache, ops
from native.ops import QTensor

from ..config import DRAFT, OffloadPolicy
from ..errors import OffloadError
from ..memory import check_vram, runtime_estimate
from ..models import MODELS
from ..models.weights import upload_weights
from ..state import State
from .budget import SmiPeak, VramLedger, cap_allocator
from .elastic import ElasticVram
from .expert_cache import ExpertCache, load_profile
from .experts import OffloadEngine
from .model_hooks import LayerExperts, ResidentPool, SharedBeside
from .host_bank import HostExpertBank
from .placement import gpu_workspace_bytes, host_weight_names, staging_bytes
from .report import LoadReport
from .scheduler import Rates, Scheduler, measure_rates


@dataclass
class RuntimeOptions:
    """Where the runtime runs and what it holds; how it behaves is the `policy`."""

    vram: int                              # bytes: the hard cap
    n_ctx: int = 4096                      # context the KV cache is sized for
    policy: OffloadPolicy = field(default_factory=OffloadPolicy)
    kv_type: str = "f16"                    # native.kv_cache: f16, q8_0, q4_0
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


class PinnedWeights:
    """Weights kept in pinned host RAM and read by the GPU over PCIe at their host address."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def pin(self, q: QTensor) -> QTensor:
        """A CPU QTensor -> the same weight in pinned host RAM, viewed as a CUDA tensor."""
        host = torch.empty_like(q.data)
        host.copy_(q.data)
        on.pin_host(host)
        self.tensors.append(host)
        return QTensor(on.host_view(host), q.qtype, q.shape, q.name, q.parts)

    def close(self) -> None:
        for t in self.tensors:
            on.unpin_host(t, missing_ok=True)
        self.tensors = []


@dataclass
class Parts:
    """What the runtime is made of (filled in assembly order)."""
    opts: object
    config: object
    device: torch.device
    report: LoadReport = field(default_factory=LoadReport)
    pinned: PinnedWeights = field(default_factory=PinnedWeights)
    smi: SmiPeak | None = None
    states: dict = field(default_factory=dict)   # key -> State (the first; the pool adds more)
    bank: HostExpertBank | None = None
    cache: ExpertCache | None = None
    vram: ElasticVram | None = None
    scheduler: Scheduler | None = None
    engine: OffloadEngine | None = None
    model: object = None
    mtp: object = None

    def close(self) -> None:
        """Give back what assembly took so far (after a failure)."""
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(1.0, self.device.index or 0)
        for part in (self.cache, self.bank):
            if part is not None:
                part.close()
        self.pinned.close()


def assemble(loaded: LoadedModel, opts, progress=None) -> Parts:
    """The runtime's parts for `loaded` under `opts` (RuntimeOptions)."""
    if not torch.cuda.is_available():
        raise OffloadError("--vram needs a CUDA GPU and none is visible; run without --vram "
                           "to use the CPU")
    model_cls = MODELS.get(loaded.arch.name)
    if model_cls is None:
        raise OffloadError(f"architecture {loaded.arch.name!r} has no forward pass; "
                           f"runnable: {', '.join(MODELS)}")
    p = Parts(opts, loaded.config, torch.device(opts.device))
    try:
        _assemble(p, loaded, model_cls, progress)
    except BaseException:
        p.close()
        raise
    return p


def _assemble(p: Parts, loaded: LoadedModel, model_cls, progress) -> None:
    opts, c, dev, rep = p.opts, p.config, p.device, p.report
    pol = opts.policy
    t0 = time.perf_counter()
    # what the metadata implies for the context, before anything is allocated: a file whose
    # keys ask for more than the whole cap is refused here, naming the key
    try:
        kv_bytes = kv_cache.kv_type(opts.kv_type).bytes_per_value(c.head_dim)
    except ValueError as e:
        raise OffloadError(str(e)) from None
    need = runtime_estimate(c, opts.n_ctx, pol, kv_bytes=kv_bytes)
    check_vram(need, opts.vram, f"--vram {opts.vram / 2**30:.2f} GiB", str(loaded.file.path))
    plan = VramLedger(opts.vram)   # the start-up plan; refuses a cap too small, with numbers
    torch.cuda.reset_peak_memory_stats(dev)
    p.smi = SmiPeak()
    # The CUDA context, cuBLAS and kernel images live outside torch's allocator but count in
    # nvidia-smi: measure them once everything is initialised and keep them inside the cap.
    torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    # this process's use now (nvidia-smi), and the device's: later, the change of the device's
    # figure (one cheap call) tells how ours has changed (ElasticVram.measure_outside)
    proc0, dev_used0 = p.smi.sample(), total - free
    outside = max(0, (proc0 or (total - free)) - torch.cuda.memory_reserved(dev))
    outside += pol.context_margin
    plan.reserve("CUDA context + libraries", outside,
                 "the GPU runtime alone needs this much before any weight")
    base = torch.cuda.memory_allocated(dev)
    if ops._cpu is not None:
        ops._cpu.set_threads(opts.cpu_threads or pol.cpu_threads(len(os.sched_getaffinity(0))))

    # 1. dense weights, quantized, on the GPU (experts stay in the file's memory map); the
    # embedding (and on request the head) in pinned host RAM, read by the GPU over PCIe
    on_host = host_weight_names(loaded, opts.host_embedding, opts.host_head)
    tensors, _ = upload_weights(loaded, dev, experts_device="cpu",
                                fuse=model_cls.FUSED_PROJECTIONS, keep_on_host=on_host)
    for name in on_host:
        tensors[name] = p.pinned.pin(tensors[name])
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
        mtp_experts = _place_mtp_experts(p, loaded, mtp_up[1], opts.mtp_experts, plan)
    cap_allocator(opts.vram - outside, dev)

    # 2. per-sequence state for the requested context (B = 1), allocated now so that the
    # cache is sized around it. Elastic: the KV maps memory as the context grows (the cache
    # gives it slots then, and takes them back for the next conversation)
    elastic = pol.elastic and on.elastic_supported()
    probe = State(c, 1, opts.n_ctx, "meta", opts.kv_type)
    plan.reserve("KV + delta-net state", probe.nbytes, need.fix("lower --ctx"))
    most = min(ops.DECODE_MAX_TOKENS, on.MAX_SELECTIONS // c.n_expert_used)   # a step's tokens
    if not 1 <= opts.max_sequences <= most:
        raise OffloadError(f"max_sequences {opts.max_sequences}: a decode step takes 1 to "
                           f"{most} tokens, one a sequence; hold 1 to {most} (--parallel)")
    first = p.states[0] = State(c, 1, opts.n_ctx, dev, opts.kv_type, pol.graph_bucket,
                                kv_alloc=on.ElasticBuffer if elastic else None)
    first.snapshots_on_host = True

    # 3. workspaces: prefill activations + attention for one chunk, graphs, staging
    plan.reserve("workspace", gpu_workspace_bytes(c, opts.n_ctx, pol),
                 "lower --ctx or the prefill chunk")

    # 4. host expert banks
    t1 = time.perf_counter()
    p.bank = HostExpertBank(loaded, progress=(lambda d, t: progress("experts to host RAM", d, t))
                            if progress else None)
    rep.seconds["host banks"] = time.perf_counter() - t1
    rep.seconds["pin"] = p.bank.pin_seconds
    rep.pinned = p.bank.pinned
    t1 = time.perf_counter()
    if p.bank.repack_for_cpu(opts.cpu_repack, progress=(
            lambda d, t: progress("the CPU's repacked experts", d, t)) if progress else None):
        rep.seconds["cpu repack"] = time.perf_counter() - t1
        rep.cpu_repacked_bytes = sum(int(b.numel()) for b in p.bank.cpu_banks)

    # 5. the expert cache from what is left: this many slots even during the largest prefill
    # chunk; while decoding (elastic) it also borrows the prefill workspace and staging
    layouts = p.bank.layouts
    plan.reserve("prefill staging",
                 staging_bytes(max(lay.expert_bytes for lay in layouts), pol.staging_experts),
                 "lower --vram use elsewhere")
    chunk = on.elastic_chunk() if elastic else 0
    slots = ExpertCache.plan_slots(layouts, plan.left, c.n_expert, chunk)
    if opts.cache_slots is not None:  # a smaller cache on purpose (tests, experiments)
        slots = [min(s, opts.cache_slots) for s in slots]
    p.cache = ExpertCache(layouts, slots, c.n_expert, dev, elastic=elastic, policy=pol)
    plan.reserve("expert cache", p.cache.nbytes)
    rep.slots_per_layer = slots
    rep.elastic, rep.cache_outside_torch = p.cache.elastic, p.cache.outside_torch
    p.vram = ElasticVram(opts.vram, outside, p.cache, p.states, pol, dev, p.smi,
                         proc0, dev_used0, opts.cache_slots)
    # the sampler's rows at once: every sequence of a batched step, or a verify step's
    p.vram.sampling = pol.sampling_workspace(c.n_vocab, max(opts.max_sequences,
                                                            1 + DRAFT.k_max if opts.mtp else 1))
    p.vram.cap_torch()

    # 6. scheduler rates, engine, model
    fraction = pol.fetch_fraction
    if not p.bank.pinned and fraction is None:
        fraction = 0.0  # pageable banks: the GPU cannot read them directly
    p.scheduler = Scheduler.create(Rates(1.0, 1.0), dev, forced=fraction, ema=pol.cpu_rate_ema)
    p.engine = OffloadEngine(p.cache, p.bank, p.scheduler, top_k=c.n_expert_used, hidden=c.n_embd,
                             ff=c.n_ff_exp, policy=pol, link_gbps=opts.link_gbps)
    p.model = model_cls(c, tensors, [LayerExperts(p.engine, i) for i in range(c.n_layer)],
                        moe_pair=SharedBeside())
    # the MTP head: eager; its routed experts by the pool kernel, from VRAM or pinned RAM
    from ..models.mtp import MtpHead
    p.mtp = None if mtp_up is None else MtpHead(
        p.model, mtp_up[0], ResidentPool(mtp_experts, top_k=c.n_expert_used,
                                         ff=c.n_ff_exp, max_tok=p.engine.max_tok))
    p.scheduler.rates = measure_rates(p.cache, p.bank, c, p.engine.link)
    p.scheduler.apply()
    if p.cache.elastic:   # the unmapped KV and the prefill workspace, lent to the cache
        p.vram.fit("decode", p.vram.decode_headroom, grow=True)
    rep.decode_slots_per_layer = p.cache.slots
    profile = load_profile(opts.profile, c.n_layer, c.n_expert) if opts.profile else None
    t2 = time.perf_counter()
    p.cache.warm_start(p.bank, profile, top_k=c.n_expert_used)
    torch.cuda.synchronize(dev)
    rep.seconds["warm start"] = time.perf_counter() - t2
    rep.budget = plan.summary()
    rep.seconds["total"] = time.perf_counter() - t0


def _place_mtp_experts(p: Parts, loaded, experts, where: str, plan: VramLedger):
    """The MTP layer's routed experts (CPU banks over the file's map) -> ResidentExperts on the
    GPU, booked in the start-up plan as their own purpose before the cache is sized from what is
    left, or (where="host") in pinned host RAM viewed by the GPU.

    Why not an extra layer of the offload engine: its cache, plan and CPU worker are built per
    trunk layer and a draft call would pay their machinery (and the cache's misses) for one
    layer's top-k; resident, a draft's experts cost one pool kernel, no miss ever. The price is
    VRAM the cache does not get (as much as one trunk layer's experts). "host" costs no VRAM and
    reads a draft token's experts over PCIe instead."""
    from ..models.weights import ResidentExperts, mtp_experts
    if where not in ("gpu", "host"):
        raise OffloadError(f"mtp_experts {where!r}: 'gpu' (resident) or 'host' (pinned RAM)")
    if where == "host":
        return ResidentExperts(*(p.pinned.pin(QTensor(q.data.contiguous(), q.qtype, q.shape, q.name))
                                 for q in (experts.gate, experts.up, experts.down)))
    before = torch.cuda.memory_allocated(p.device)
    on_gpu = mtp_experts(loaded, p.device)
    torch.cuda.synchronize(p.device)
    plan.reserve("MTP experts", torch.cuda.memory_allocated(p.device) - before,
                 "the MTP head's experts do not fit beside the dense weights; "
                 "use --draft 0 or a larger --vram")
    return on_gpu
