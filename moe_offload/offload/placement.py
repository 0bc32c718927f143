"""The VRAM budget: what must live on the GPU, and how many experts fit in what is left.

This module starts with the planning arithmetic (used by `ftpatch inspect --vram`); the runtime's
expert cache builds on the same numbers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from loaders import LoadedModel
from loaders import footprint
from native import kv_cache, ops

from ..config import PREFILL
from ..config import OffloadPolicy

EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_up_exps.weight",
                   "ffn_down_exps.weight")


def is_expert_tensor(name: str) -> bool:
    return name.endswith(EXPERT_SUFFIXES)


KV_CHUNK_ESTIMATE = 2 << 20   # the driver's mapping granularity on the GPUs we measured


def kv_bytes_per_token(model, kv_type="f16") -> int:
    """KV cache per token over every attention layer (K and V of `kv_type`, a native.kv_cache
    type or its name; a number: bytes a value); `model` a LoadedModel or its config."""
    c = getattr(model, "config", model)
    per_value = kv_type if isinstance(kv_type, (int, float)) else \
        kv_cache.kv_type(kv_type).bytes_per_value(c.head_dim)
    return footprint.kv_bytes_per_position(c, per_value)


def recurrent_state_bytes(model: LoadedModel) -> int:
    """Delta-net conv + recurrent state per sequence, F32 (independent of context length)."""
    return footprint.recurrent_state_bytes(model.config)


def expert_bytes_per_layer(model: LoadedModel) -> dict[int, int]:
    """Bytes of one routed expert (gate + up + down) in each layer."""
    out: dict[int, int] = {}
    for w in model.weights.values():
        if is_expert_tensor(w.name):
            layer = int(w.name.split(".")[1])
            out[layer] = out.get(layer, 0) + w.nbytes // w.shape[0]
    return out


@dataclass(frozen=True)
class PlanSketch:
    vram_bytes: int
    n_ctx: int
    dense_bytes: int          # non-expert weights on the GPU, kept quantized
    host_bytes: int           # non-expert weights the runtime keeps in host RAM (the embedding)
    kv_bytes: int
    state_bytes: int
    workspace_bytes: int      # workspaces, prefill staging and the CUDA context (estimated)
    expert_budget_bytes: int  # what is left for the expert cache (0 if it does not fit)
    expert_bytes_mean: int
    experts_total: int
    experts_fit: int          # during the largest prefill chunk
    decode_experts_fit: int   # while decoding a short conversation: the elastic cache also holds
                              # the prefill workspace and the KV not yet used
    fits: bool
    kv_type: str = "f16"      # the KV's type (native.kv_cache)

    @property
    def experts_fit_fraction(self) -> float:
        return self.experts_fit / self.experts_total if self.experts_total else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["experts_fit_fraction"] = round(self.experts_fit_fraction, 4)
        return d


# context + cuBLAS as the runtime measures them on a Hopper GPU: the sketch's stand-in for that
# measurement (the policy's context margin is added to it)
CUDA_CONTEXT_MEASURED = 680 << 20



def prefill_workspace_bytes(c, n_tokens: int, kv_len: int, all_logits: bool = False) -> int:
    """Torch memory one prefill chunk of `n_tokens` needs beyond the weights and state, attending
    over `kv_len` positions. The phases of a layer do not overlap, so it is what lives through the
    layer plus the largest phase; +25% and 64 MiB for the allocator's rounding and fragmentation
    (a 2,048-token prefill at 8 GiB failed with 298 MiB reserved but unusable). Measured on the
    35B (peak allocated above the start): 194 MiB at 16 tokens, 790 MiB at 2,048, and as one
    chunk at the start of a sequence 1,152 MiB at 3,000 tokens, 3,800 MiB at 10,000, where the
    delta net's chunked rule is the largest phase (the runtime records the estimate and the use
    for every prefill: `prefill_memory`). Nothing in it grows with the context past one tile of
    attention: a prompt whose KV fits runs in chunks of the planned size."""
    T, H = n_tokens, c.n_embd
    fused_ssm_in = c.ssm_conv_dim + c.ssm_d_inner + 2 * c.ssm_n_v_heads  # qwen35moe.SSM_IN as one
    widest = max(2 * c.n_head * c.head_dim, fused_ssm_in, c.n_embd * 2, c.ssm_d_inner * 2)
    live = T * H * 4 * 4                                       # residual stream, norms, mixer out
    proj = T * widest * 4 * 3 + widest * H * 2                 # a projection: out, bf16 weight
    # attention reads the cache in tiles (attention.attention_tiled): its queries, sums and
    # output, and one tile's scores (twice: the mask beside them) and dequantized rows
    L = min(kv_len, PREFILL.attention_tile(T, c.n_head, c.n_head_kv * c.head_dim))
    G = c.n_head // max(1, c.n_head_kv)
    attn = T * c.n_head * c.head_dim * 4 * 6 + \
        L * (T * c.n_head * 4 * 2 + T * G + c.n_head_kv * c.head_dim * 4 * 6)
    # the chunked delta rule: about 16 [T, delta_chunk] f32 blocks per value head live at its
    # peak (queries, keys, their decayed copies, the in-chunk products), and the mixer's input
    delta = c.ssm_n_v_heads * T * PREFILL.delta_chunk * 4 * 16 + T * fused_ssm_in * 4 * 2
    # routed experts (native.ops.cuda_prefill_moe): a group of 32 experts dequantized to bf16,
    # the T*K token copies (bf16 in, f32 out), their gate/up/activation rows; a short prompt
    # runs the decode kernels instead (no dequantized copy)
    N, F = T * c.n_expert_used, c.n_ff_exp
    gemm = T > ops.PREFILL_MOE_MIN_TOKENS
    moe = (3 * 32 * F * H * 2 if gemm else 0) + N * H * 12 + N * F * 12
    logits = c.n_vocab * 4 * (T if all_logits else 4)
    return int(1.25 * (live + max(proj, attn, delta, moe)) + logits + (64 << 20))


def gpu_workspace_bytes(c, n_ctx: int, policy: OffloadPolicy = OffloadPolicy()) -> int:
    """The workspace a cap must always leave besides the expert cache: the worst prefill chunk
    (a full chunk attending over the whole context) and the decode graph pools."""
    return prefill_workspace_bytes(c, min(policy.prefill_chunk, n_ctx), n_ctx) + policy.decode_graphs


def prompt_chunk(c, n_tokens: int, kv_end: int, n_ctx: int, policy: OffloadPolicy,
                 all_logits: bool = False) -> int:
    """Tokens a chunk of an n_tokens prompt whose last token lands at kv_end: the fewest chunks,
    of even size, whose workspace is no larger than the one the plan reserves (policy's chunk
    attending over all n_ctx). Under a cap every chunk streams the cold experts it routes to,
    so an uneven tail chunk would cost a stream for a few tokens. (Attention reads the cache
    in tiles, so past one tile of context the workspace no longer depends on kv_end.)"""
    base = max(1, min(policy.prefill_chunk, n_ctx))
    if n_tokens <= base:
        return base
    budget = prefill_workspace_bytes(c, base, n_ctx, all_logits)
    lo, hi = base, n_tokens                       # the estimate grows with the chunk
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefill_workspace_bytes(c, mid, kv_end, all_logits) <= budget:
            lo = mid
        else:
            hi = mid - 1
    pieces = -(-n_tokens // lo)
    return -(-n_tokens // pieces)


def staging_bytes(expert_bytes: int, staging_experts: int = OffloadPolicy.staging_experts) -> int:
    """The two prefill staging buffers, each `staging_experts` of the largest expert."""
    return 2 * staging_experts * expert_bytes


def host_weight_names(model: LoadedModel, host_embedding: bool = True,
                      host_head: bool = False) -> list[str]:
    """Dense weights the offload runtime keeps in pinned host RAM. The embedding by default: a
    decode step reads one row of it. The head only on request: a step reads all of it (its bytes
    over the link). A tied head (no output.weight) is the embedding: it stays with the head."""
    names = []
    tied = "output.weight" not in model.weights
    if host_embedding and (not tied or host_head):
        names.append("token_embd.weight")
    if host_head and not tied:
        names.append("output.weight")
    return names


def plan_sketch(model: LoadedModel, vram_bytes: int, n_ctx: int = 8192,
                policy: OffloadPolicy = OffloadPolicy(), kv_type="f16") -> PlanSketch:
    """How a VRAM cap splits (the runtime's defaults): dense part, KV (of `kv_type`) + state for
    `n_ctx`, workspace, expert cache during prefill and while decoding."""
    on_host = set(host_weight_names(model))
    dense = host = 0
    for w in model.weights.values():
        if not is_expert_tensor(w.name):
            if w.name in on_host:
                host += w.nbytes
            else:
                dense += w.nbytes
    kv = kv_bytes_per_token(model, kv_type) * n_ctx
    state = recurrent_state_bytes(model)
    per_layer = expert_bytes_per_layer(model)
    ws = gpu_workspace_bytes(model.config, n_ctx, policy)
    work = ws + CUDA_CONTEXT_MEASURED + policy.context_margin + \
        staging_bytes(max(per_layer.values(), default=0), policy.staging_experts)
    n_layers = len(per_layer)
    total_experts = n_layers * model.config.n_expert
    mean = sum(per_layer.values()) // n_layers if n_layers else 0
    left = vram_bytes - dense - kv - state - work
    fit = min(total_experts, max(0, left) // mean) if mean else 0
    # decoding a short conversation lends the cache the workspace and the KV not yet used (an
    # elastic KV maps about one 2 MiB chunk per K and V tensor to begin with)
    kv_start = min(kv, 2 * len(model.config.attention_layers) * KV_CHUNK_ESTIMATE)
    decode_left = left + ws + kv - kv_start - policy.decode_headroom
    decode_fit = min(total_experts, max(0, decode_left) // mean) if mean else 0
    return PlanSketch(vram_bytes, n_ctx, dense, host, kv, state, work, max(0, left), mean,
                      total_experts, int(fit), int(decode_fit), left >= 0,
                      kv_cache.kv_type(kv_type).name)


def _cache_rooms(model: LoadedModel, vram_bytes: int, n: int, n_seq: int, kv_type,
                 policy: OffloadPolicy) -> tuple[int, int]:
    """The expert cache's room under the cap with n_seq sequences' KV of kv_type mapped for n
    positions: (decoding, while a prompt chunk attending over them runs)."""
    s = plan_sketch(model, vram_bytes, n, policy)
    prompt = (vram_bytes - s.dense_bytes - s.workspace_bytes - n_seq * s.state_bytes
              - kv_bytes_per_token(model, kv_type) * n_seq * n)
    ws = gpu_workspace_bytes(model.config, n, policy)
    return prompt + ws - policy.decode_headroom, prompt


def _fits_share(model, vram_bytes: int, n: int, n_seq: int, kv_type, policy, need: float) -> bool:
    decode, prompt = _cache_rooms(model, vram_bytes, n, n_seq, kv_type, policy)
    return decode >= need and prompt >= 0


def _share_needed(model, vram_bytes: int, n_seq: int, policy, expert_share, base) -> tuple:
    from ..config import CONTEXT, DEFAULT_N_CTX
    share = CONTEXT.expert_share if expert_share is None else expert_share
    base = min(model.config.n_ctx_train, base or DEFAULT_N_CTX)
    return share * _cache_rooms(model, vram_bytes, base, n_seq, "f16", policy)[0], base


def auto_kv_type(model: LoadedModel, vram_bytes: int, n_ctx: int, *, n_seq: int = 1,
                 policy: OffloadPolicy = OffloadPolicy(), expert_share: float | None = None) -> str:
    """--kv-type auto under a VRAM cap: the widest of f16, q8_0 and q4_0 whose KV, the context
    full, leaves the expert cache CONTEXT.expert_share of its room at the default context (the
    rule --ctx auto sizes the context by): a short context keeps f16, a long one gives up KV
    precision before decode speed. q4_0 when none does; f16 when the cap has no room for
    experts even at the default context (the runtime then says what does not fit)."""
    need, _ = _share_needed(model, vram_bytes, n_seq, policy, expert_share, None)
    if need <= 0:
        return "f16"
    for name in ("f16", "q8_0", "q4_0"):
        if model.config.head_dim % 32 and name != "f16":
            break
        if _fits_share(model, vram_bytes, n_ctx, n_seq, name, policy, need):
            return name
    return "f16" if model.config.head_dim % 32 else "q4_0"


def auto_context_under_cap(model: LoadedModel, vram_bytes: int, *, n_seq: int = 1,
                           kv_type="f16", policy: OffloadPolicy = OffloadPolicy(),
                           expert_share: float | None = None, base: int | None = None,
                           step: int | None = None) -> int:
    """--ctx auto under a VRAM cap: the largest context, up to the model's trained length, at
    which (1) decoding with the context full -- `n_seq` sequences' KV of `kv_type` (the
    runtime's) mapped -- leaves the expert cache `expert_share` (CONTEXT.expert_share) of its
    room at the `base` context (min(trained, DEFAULT_N_CTX)), and (2) a prompt chunk attending
    over the whole context still fits its workspace beside the dense weights and the KV (the
    cache lends it the room while the prompt runs), as plan_sketch counts them. A multiple of
    `step` or the trained length; `base` when even that does not fit (the runtime then says
    what does not)."""
    from ..config import CONTEXT
    step = step or CONTEXT.step
    train = model.config.n_ctx_train
    need, base = _share_needed(model, vram_bytes, n_seq, policy, expert_share, base)
    if need <= 0:
        return base

    def fits(n: int) -> bool:
        return _fits_share(model, vram_bytes, n, n_seq, kv_type, policy, need)

    if fits(train):
        return train
    lo, hi = 0, train // step          # fits(lo * step), not fits(hi * step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return max(base, lo * step)
