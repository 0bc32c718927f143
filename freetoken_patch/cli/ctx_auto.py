"""`--ctx auto` for serve and chat (their default): the largest context that fits, up to the
model's trained length, and the start-up line that says what was chosen.

Without --vram the KV of every State lives where the model runs, allocated whole (float32 on
the CPU, as the plain model's States keep it): the context is what host RAM (or the GPU's free
memory) holds for `n_states` of them once the weights are in, keeping some free
(moe_offload.memory.auto_context_host). Under --vram the runtime's KV grows in VRAM
as it fills and takes its room from the expert cache: the context is the largest that leaves
the cache a stated share of its room and a prompt's workspace room to run
(moe_offload.offload.placement.auto_context_under_cap). --kv-type auto then takes f16 if its
KV at that context leaves the cache that share, else q8_0, else q4_0 (auto_kv_type): a context
given by number goes to a narrower KV before it shrinks the cache. The numbers are
moe_offload's CONTEXT."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .model_args import context_size


def ctx_arg(text: str):
    """argparse type of --ctx: a token count, or auto."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens or auto") \
            from None


@dataclass(frozen=True)
class ContextChoice:
    n_ctx: int
    kv_type: str              # f32, f16, q8_0, q4_0
    kv_bytes: int             # one sequence's KV at n_ctx
    n_states: int             # sequences that may hold a KV at once
    auto: bool
    kv_auto: bool = False     # the KV type chosen by --kv-type auto

    def describe(self) -> str:
        """'context 131072 (auto: KV q8_0 (auto), 1.3 GiB)', with the sequences when several
        hold one."""
        size = _gib(self.kv_bytes)
        per = f"{size} a sequence, up to {self.n_states}" if self.n_states > 1 else size
        how = "auto: " if self.auto else ""
        kv = f"{self.kv_type} (auto)" if self.kv_auto else self.kv_type
        return f"context {self.n_ctx} ({how}KV {kv}, {per})"

    def as_meta(self) -> dict:
        return {"n_ctx": self.n_ctx, "kv_type": self.kv_type, "kv_bytes": self.kv_bytes,
                "ctx_auto": self.auto, "kv_type_auto": self.kv_auto}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 1 << 30 else f"{n / 2**20:.0f} MiB"


def choose_context(args, loaded, dev, n_states: int) -> ContextChoice:
    """--ctx for `loaded` on `dev` (args.vram: under the runtime), with `n_states` sequences
    holding a KV at once (serve: --parallel plus the prefix cache; chat: 1); sets args.ctx to
    the number."""
    import torch

    from moe_offload import CONTEXT, DEFAULT_N_CTX, auto_context_host, auto_context_under_cap
    from .model_args import kv_type_for
    c = loaded.config
    train = c.n_ctx_train
    vram = getattr(args, "vram", None)
    asked = getattr(args, "kv_type", None) or "auto"
    # an automatic context is sized with the KV type asked for (f16 under --vram, f32 on the
    # plain model, when that is auto too); the type is then resolved for that context
    sizing = asked if asked != "auto" else ("f16" if vram is not None else "f32")
    auto = args.ctx in (None, "auto")
    if not auto:    # checked as every command checks --ctx
        n = context_size(int(args.ctx), train, args.allow_long_ctx)
    elif vram is not None:
        n = auto_context_under_cap(loaded, vram, n_seq=n_states, kv_type=sizing)
    else:
        resident = sum(w.nbytes for w in loaded.weights.values())
        available = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
        n = auto_context_host(train, _per_token(c, sizing, args), n_states, available, resident,
                              floor=min(train, DEFAULT_N_CTX), step=CONTEXT.step)
    args.ctx = n
    kv = kv_type_for(args, loaded, n, n_states)
    return ContextChoice(n, kv, _per_token(c, kv, args) * n, n_states, auto,
                         asked == "auto" and vram is not None)


def _per_token(c, kv_type: str, args) -> int:
    """KV bytes a position of kv_type (the MTP layer's KV too with --draft)."""
    from moe_offload import kv_bytes_per_token
    per = kv_bytes_per_token(c, kv_type)
    if getattr(args, "draft", 0):     # the MTP layer keeps a KV of its own
        per = per * (len(c.attention_layers) + 1) // len(c.attention_layers)
    return per
