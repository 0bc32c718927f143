"""The VRAM budget: what must live on the GPU, and how many experts fit in what is left.

This module starts with the planning arithmetic (used by `ftpatch inspect --vram`); the runtime's
expert cache builds on the same numbers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from loaders import LoadedModel

EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_up_exps.weight",
                   "ffn_down_exps.weight")


def is_expert_tensor(name: str) -> bool:
    return name.endswith(EXPERT_SUFFIXES)


def kv_bytes_per_token(model: LoadedModel, bytes_per_value: int = 2) -> int:
    """KV cache per token over every attention layer (K and V, F16 by default)."""
    c = model.config
    return len(c.attention_layers) * 2 * c.n_head_kv * c.head_dim * bytes_per_value


def recurrent_state_bytes(model: LoadedModel) -> int:
    """Delta-net conv + recurrent state per sequence, F32 (independent of context length)."""
    c = model.config
    conv = (c.ssm_d_conv - 1) * c.ssm_conv_dim
    rec = c.ssm_n_v_heads * c.ssm_d_state * c.ssm_head_v_dim
    return len(c.recurrent_layers) * (conv + rec) * 4


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
    dense_bytes: int          # every non-expert weight, kept quantized
    kv_bytes: int
    state_bytes: int
    workspace_bytes: int      # workspaces, prefill staging and the CUDA context (estimated)
    expert_budget_bytes: int  # what is left for the expert cache (0 if it does not fit)
    expert_bytes_mean: int
    experts_total: int
    experts_fit: int
    fits: bool

    @property
    def experts_fit_fraction(self) -> float:
        return self.experts_fit / self.experts_total if self.experts_total else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["experts_fit_fraction"] = round(self.experts_fit_fraction, 4)
        return d


PREFILL_CHUNK = 2048           # tokens per prefill chunk (the runtime's default)
STAGING_EXPERTS = 32           # experts per prefill staging buffer (two are kept)
# Device memory that appears outside torch's allocator after the runtime measures the context:
# kernel images loaded lazily at their first launch (ours and cuBLAS's), the prefetch stream's
# cuBLAS state. 64 MiB was 10 MiB short at a 6 GiB cap on the H200 (nvidia-smi 6.01 GiB).
CONTEXT_MARGIN = 192 << 20
# context + cuBLAS as the runtime measures them (~676 MiB on the H200) plus that margin
CUDA_CONTEXT_ESTIMATE = (680 << 20) + CONTEXT_MARGIN


def gpu_workspace_bytes(c, n_ctx: int, prefill_chunk: int = PREFILL_CHUNK) -> int:
    """GPU workspaces for config `c`: prefill activations and attention scores for one chunk,
    chunked delta-rule blocks, logits, and the pools of the captured decode graphs."""
    T = prefill_chunk
    fused_ssm_in = c.ssm_conv_dim + c.ssm_d_inner + 2 * c.ssm_n_v_heads  # qwen35moe.SSM_IN as one
    widest = max(2 * c.n_head * c.head_dim, fused_ssm_in, c.n_embd * 2, c.ssm_d_inner * 2)
    act = T * widest * 4 * 8                                  # a few live [T, widest] f32
    attn = c.n_head * T * min(T, n_ctx) * 4 * 2               # scores of one chunk
    delta = c.ssm_n_v_heads * T * 64 * 4 * 4                  # chunked delta-rule blocks
    logits = c.n_vocab * 4 * 4
    graphs = 96 << 20                                          # decode graph pools
    return int(act + attn + delta + logits + graphs)


def staging_bytes(expert_bytes: int, staging_experts: int = STAGING_EXPERTS) -> int:
    """The two prefill staging buffers, each `staging_experts` of the largest expert."""
    return 2 * staging_experts * expert_bytes


def plan_sketch(model: LoadedModel, vram_bytes: int, n_ctx: int = 8192) -> PlanSketch:
    """How a VRAM cap splits: dense part, KV + state for `n_ctx`, workspace, expert cache."""
    dense = sum(w.nbytes for w in model.weights.values() if not is_expert_tensor(w.name))
    kv = kv_bytes_per_token(model) * n_ctx
    state = recurrent_state_bytes(model)
    per_layer = expert_bytes_per_layer(model)
    work = gpu_workspace_bytes(model.config, n_ctx) + CUDA_CONTEXT_ESTIMATE + \
        staging_bytes(max(per_layer.values(), default=0))
    n_layers = len(per_layer)
    total_experts = n_layers * model.config.n_expert
    mean = sum(per_layer.values()) // n_layers if n_layers else 0
    left = vram_bytes - dense - kv - state - work
    fit = min(total_experts, max(0, left) // mean) if mean else 0
    return PlanSketch(vram_bytes, n_ctx, dense, kv, state, work, max(0, left), mean,
                      total_experts, int(fit), left >= 0)
