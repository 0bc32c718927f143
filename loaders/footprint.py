"""What a model's metadata implies for memory before anything is allocated (numbers only).

A consistent file can still ask for absurd run-time memory: `ssm.state_size` sets the delta-net
state every sequence carries, the attention keys set the KV cache each position costs. This
module gives those sizes from the config, and `culprit`, which names the metadata key (or the
--ctx flag) that makes an estimate large: the one whose value, brought down to what the
Qwen3.5-35B-A3B has, would shrink the estimate most. The estimate itself (workspaces, how many
sequences, which device) is the runtime's (moe_offload.memory); this module only knows keys.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

# qwen35moe config field -> (metadata key, the Qwen3.5-35B-A3B's value): a real model's sizes,
# the yardstick for "this key is what makes it large"
REFERENCE: dict[str, tuple[str, int]] = {
    "n_layer": ("qwen35moe.block_count", 40),
    "n_embd": ("qwen35moe.embedding_length", 2048),
    "n_vocab": ("token_embd.weight rows (the vocabulary)", 248320),
    "n_expert": ("qwen35moe.expert_count", 256),
    "n_expert_used": ("qwen35moe.expert_used_count", 8),
    "n_ff_exp": ("qwen35moe.expert_feed_forward_length", 512),
    "n_ff_shexp": ("qwen35moe.expert_shared_feed_forward_length", 512),
    "n_head": ("qwen35moe.attention.head_count", 16),
    "n_head_kv": ("qwen35moe.attention.head_count_kv", 2),
    "head_dim": ("qwen35moe.attention.key_length", 256),
    "ssm_d_conv": ("qwen35moe.ssm.conv_kernel", 4),
    "ssm_d_inner": ("qwen35moe.ssm.inner_size", 4096),
    "ssm_d_state": ("qwen35moe.ssm.state_size", 128),
    "ssm_n_v_heads": ("qwen35moe.ssm.time_step_rank", 32),
    "ssm_n_k_heads": ("qwen35moe.ssm.group_count", 16),
}
CTX_REFERENCE = 4096   # the context run, chat and serve choose when none is asked for


def gib(n: int) -> str:
    """A size for a message: GiB (3 significant digits past a PiB: hostile metadata asks for
    absurd sizes) or MiB."""
    if n >= 1 << 50:
        return f"{n / 2**30:.3g} GiB"
    return f"{n / 2**30:.2f} GiB" if n >= 1 << 30 else f"{n / 2**20:.1f} MiB"


def recurrent_state_bytes(c, bytes_per_value: int = 4) -> int:
    """One sequence's delta-net state: conv window + recurrent state S of every delta-net layer
    (S is [Hv, state_size, inner_size / Hv] a layer, so inner_size x state_size values)."""
    conv = (c.ssm_d_conv - 1) * (2 * c.ssm_n_k_heads * c.ssm_d_state + c.ssm_d_inner)
    rec = c.ssm_n_v_heads * c.ssm_d_state * (c.ssm_d_inner // c.ssm_n_v_heads)
    return len(c.recurrent_layers) * (conv + rec) * bytes_per_value


def kv_bytes_per_position(c, bytes_per_value: float) -> int:
    """K and V of one position over every attention layer (bytes_per_value: 1.0625 for q8_0
    blocks, 0.5625 for q4_0)."""
    return int(len(c.attention_layers) * 2 * c.n_head_kv * c.head_dim * bytes_per_value)


def with_value(c, name: str, value: int):
    """The config with one field set to `value` (fewer layers keep the first ones' kinds)."""
    if name == "n_layer":
        return replace(c, n_layer=value, recurrent=tuple(c.recurrent[:value]))
    return replace(c, **{name: value})


@dataclass(frozen=True)
class Culprit:
    key: str          # a metadata key, or "--ctx"
    value: int
    reference: int    # the Qwen3.5-35B-A3B's value (for --ctx: the default context)
    saves: int        # bytes the estimate loses with the key at its reference value

    def describe(self) -> str:
        if self.key == "--ctx":
            return f"--ctx {self.value:,}"
        return f"{self.key} = {self.value:,} (the Qwen3.5-35B-A3B has {self.reference:,})"


def culprit(need: Callable[[Any, int], int], c, n_ctx: int) -> Culprit | None:
    """The key most responsible for `need(config, n_ctx)` bytes: each key above its reference
    value is brought down to it in turn; the one that saves most wins (None: none is above)."""
    base = need(c, n_ctx)
    best: Culprit | None = None
    for name, (key, ref) in REFERENCE.items():
        value = getattr(c, name, None)
        if not isinstance(value, int) or value <= ref:
            continue
        saves = base - need(with_value(c, name, ref), n_ctx)
        if saves > 0 and (best is None or saves > best.saves):
            best = Culprit(key, value, ref, saves)
    if n_ctx > CTX_REFERENCE:
        saves = base - need(c, CTX_REFERENCE)
        if saves > 0 and (best is None or saves > best.saves):
            best = Culprit("--ctx", n_ctx, CTX_REFERENCE, saves)
    return best
