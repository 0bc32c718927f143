"""What runs a model: one interface for the plain model (CPU, or the whole model on one GPU)
and the offload runtime (a MoE model under a VRAM cap).

    be = open_backend(loaded, device="cpu" | "cuda", vram=None | "8GiB", n_ctx=4096, mtp=False)
    st = be.new_state();  logits = be.prefill(ids [1, T], st);  logits = be.decode(ids [1], st)
    be.decode_many(ids [B], [st, ...])       one token for each of B states in one step
    be.verify / be.draft / be.mtp_rows       speculative decoding with the MTP head (caps.speculative)
    be.caps                                  what it can do: ask it, never probe for methods

Generation (gen/), speculative decoding (spec/), the CLI and the server take a Backend. A bare
model object (Qwen35Moe, or a test's stand-in) is wrapped by `as_backend`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .config import PREFILL
from .errors import OffloadError
from .state import Snapshot, State


@dataclass(frozen=True)
class Capabilities:
    max_sequences: int      # states handed out at once (decode_many steps up to this many)
    batched: bool           # decode_many computes several sequences in one step
    speculative: bool       # an MTP head is loaded: verify, draft and mtp_rows work
    shared_state: bool      # new_state hands out the same State each time (one sequence)
    offload: bool           # a VRAM cap: stats() reports the expert cache, captures count graphs


class Backend:
    """The interface (its methods' contracts are the plain model's; the runtime keeps them).
    Subclasses set `caps`, `config`, `device` and `mtp` (the MTP head, or None)."""

    caps: Capabilities
    mtp = None
    captures = 0            # decode graphs captured so far (a capture costs many steps)
    capture_s = 0.0         # host wall time those captures took

    def new_state(self, batch: int = 1, n_ctx: int | None = None) -> State:
        raise NotImplementedError

    def release(self, state: State) -> None:
        """A state from new_state is free again."""

    def prefill(self, tokens: torch.Tensor, state: State, chunk: int | None = None,
                all_logits: bool = False, hidden: bool = False):
        """tokens [1, T] -> last logits [1, V] (all [1, T, V]); hidden: and the final-normed
        hidden states [1, T, H] (the MTP head's input)."""
        raise NotImplementedError

    def prepare_batches(self, states: list[State]) -> None:
        """Make the batched steps of 1..len(states) sequences ready before the first request
        (the offload runtime captures their graphs now); the states are emptied after."""

    def prompt_piece(self, remaining: int, chunk: int, beside: int = 0) -> int:
        """How many of a prompt's `remaining` tokens to feed in one batched step, beside
        `beside` sequences decoding (decode_many_with_prompt; the others wait that long), at
        most `chunk`."""
        return min(remaining, chunk)

    def decode_many_with_prompt(self, tokens: torch.Tensor, states: list[State],
                                prompt: torch.Tensor, state: State):
        """decode_many of `states` and the next tokens of another state's prompt (prompt
        [1, T]) -> (logits [B, V], the prompt's last logits [1, V]); here one after the
        other (the offload runtime runs them as one step where it can)."""
        return self.decode_many(tokens, states), self.prefill(prompt, state)

    def decode(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """One token: tokens [1] on the device -> logits [1, V]."""
        raise NotImplementedError

    def decode_many(self, tokens: torch.Tensor, states: list[State]) -> torch.Tensor:
        """One token for each of B states at their own positions: tokens [B] -> logits [B, V]."""
        raise NotImplementedError

    def verify(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """T positions of one state (speculative decoding's check): tokens [1, T] -> (logits
        [1, T, V], final-normed hidden states [1, T, H]); with state.keep_steps the delta-net
        state after each token is kept for a rewind."""
        raise NotImplementedError

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, state: State, k: int) -> torch.Tensor:
        """k greedy draft ids [k] on the device from the MTP head, first on the trunk's hidden
        states it is owed (hidden [1, T, H], the tokens after them [1, T])."""
        raise NotImplementedError

    def mtp_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, state: State) -> None:
        """Write the MTP KV rows the head is owed (hidden [1, T, H], tokens [1, T])."""
        self._need_mtp().forward(hidden, tokens, state, logits="none")

    def keep_steps(self, state: State, depth: int) -> None:
        """Keep the delta-net state after each of up to depth + 1 verified tokens (a rewind)."""
        state.keep_steps(depth)

    def snapshot(self, state: State) -> Snapshot:
        return state.snapshot()

    def restore(self, state: State, snap: Snapshot) -> None:
        state.restore(snap)

    def stats(self):
        """What the backend measured (the runtime's RuntimeStats), or None."""
        return None

    def close(self) -> None:
        """Give back what it holds (the runtime: the VRAM cap, pinned pages, threads)."""

    def _need_mtp(self):
        if self.mtp is None:
            raise OffloadError("this model has no MTP head loaded: speculative decoding needs "
                               "one (open it with mtp=True; the file needs nextn_predict_layers 1)")
        return self.mtp

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PlainBackend(Backend):
    """A model on one device (every weight there): Qwen35Moe, or anything with its forward,
    prefill, decode, decode_many and new_state."""

    def __init__(self, model, mtp=None, n_ctx: int | None = None, kv_type: str = "f32"):
        self.model, self.mtp, self.n_ctx, self.kv_type = model, mtp, n_ctx, kv_type
        self.config = getattr(model, "config", None)
        self.device = torch.device(model.device)
        self.caps = Capabilities(max_sequences=1 << 30, batched=True, speculative=mtp is not None,
                                 shared_state=False, offload=False)

    def new_state(self, batch: int = 1, n_ctx: int | None = None) -> State:
        return self.model.new_state(batch, n_ctx or self.n_ctx, self.kv_type)

    def prefill(self, tokens, state, chunk=None, all_logits=False, hidden=False):
        flags = {k: True for k, on in (("all_logits", all_logits), ("hidden", hidden)) if on}
        return self.model.prefill(tokens, state, chunk=chunk or PREFILL.default_chunk, **flags)

    def forward(self, tokens, state, last_only=False, hidden=False):
        return self.model.forward(tokens, state, last_only=last_only, hidden=hidden)

    def decode(self, tokens, state):
        return self.model.decode(tokens, state)

    def decode_many(self, tokens, states):
        return self.model.decode_many(tokens, states)

    def verify(self, tokens, state):
        return self.model.forward(tokens, state, hidden=True)

    def draft(self, hidden, tokens, state, k):
        from .models.mtp import greedy_drafts
        return greedy_drafts(self._need_mtp(), hidden, tokens, state, k)


def as_backend(model, mtp=None) -> Backend:
    """`model` if it is a Backend, else the plain model wrapped (with `mtp` as its MTP head)."""
    if isinstance(model, Backend):
        return model
    return PlainBackend(model, mtp)


def open_backend(loaded, *, device: torch.device | str = "cpu", vram: int | str | None = None,
                 n_ctx: int = 4096, mtp: bool = False, cpu_repack: str = "auto",
                 cpu_threads: int | None = None, kv_type: str | None = None,
                 progress: Callable[[str, int, int], None] | None = None, **runtime_options) -> Backend:
    """A validated LoadedModel, ready to run: on one device (vram None), or under the offload
    runtime with a VRAM cap (`runtime_options`: RuntimeOptions' other fields: max_sequences,
    host_head, host_embedding, link_gbps, policy, ...). mtp: load the MTP head (speculative
    decoding). cpu_threads: the CPU kernels' pool (default: every core, under a cap all but the
    policy's spare cores). kv_type: the KV cache's (native.kv_cache; default f32 on one device,
    under a cap RuntimeOptions' f16)."""
    device = torch.device(device)
    if vram is not None:
        if device.type != "cuda":
            raise OffloadError(f"a VRAM cap needs a CUDA device, not {device}")
        from .offload.runtime import open_runtime
        if kv_type is not None:
            runtime_options["kv_type"] = kv_type
        return open_runtime(loaded, vram, ctx=n_ctx, device=str(device), mtp=mtp,
                            cpu_repack=cpu_repack, cpu_threads=cpu_threads, progress=progress,
                            **runtime_options)
    if runtime_options:
        raise OffloadError(f"{', '.join(sorted(runtime_options))}: options of the offload "
                           "runtime; give a VRAM cap (vram=) to use them")
    if device.type == "cpu":
        # torch runs only glue here (RoPE, casts); its own threads would spin on the cores of
        # the kernels' pool between its calls
        torch.set_num_threads(1)
    if cpu_threads:
        from native.ops import _cpu
        if device.type != "cpu":
            torch.set_num_threads(cpu_threads)
        if _cpu is not None:
            _cpu.set_threads(cpu_threads)
    from .models import build_model
    model = build_model(loaded, device, cpu_repack=cpu_repack)
    head = None
    if mtp:
        from .models.mtp import MtpHead
        head = MtpHead.load(loaded, model)
        if head is None:
            raise OffloadError("this model has no MTP block (nextn_predict_layers = 0): "
                               "speculative decoding needs one; run without drafting")
    return PlainBackend(model, head, n_ctx, kv_type or "f32")
