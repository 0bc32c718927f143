"""Prompts under the cap, for the offload runtime (runtime.py delegates here): a long prompt
takes the model's prefill path (experts streamed through staging buffers) in chunks its
reserved workspace holds; a short one (policy.short_prompt) runs as decode-sized steps, the
decode path's plan, fetches and graphs; beside a batch of decoding sequences, a short prompt
goes in pieces that fill a step (prompt_piece). Functions of the runtime `rt`."""
from __future__ import annotations

import contextlib

import torch

from ..state import State
from .placement import prefill_workspace_bytes, prompt_chunk


def prefill(rt, tokens: torch.Tensor, state: State, chunk: int | None = None,
            all_logits: bool = False, hidden: bool = False):
    """tokens [B, T] on the device -> last logits [B, V] (or all [B, T, V]); hidden: and
    every position's final-normed hidden state [B, T, H] (the MTP head's input). chunk:
    tokens a chunk (None: as large as the reserved workspace holds, placement.prompt_chunk)."""
    n = tokens.shape[1]
    chunk = chunk or prompt_chunk(rt.config, n, state.n_past + n, rt.opts.n_ctx, rt.policy,
                                  all_logits)
    if n <= rt.policy.short_prompt and not all_logits:
        return in_steps(rt, tokens, state, hidden)
    with scope(rt, "prefill", n, state, chunk, all_logits):
        return rt.model.prefill(tokens, state, chunk, all_logits, hidden)


def forward(rt, tokens: torch.Tensor, state: State, last_only: bool = False) -> torch.Tensor:
    n = tokens.shape[1]
    with scope(rt, "forward", n, state, n, not last_only):
        return rt.model.forward(tokens, state, last_only)


def prompt_piece(rt, remaining: int, chunk: int, beside: int = 0) -> int:
    """A prompt short enough to run as decode-sized steps (policy.short_prompt) goes in
    pieces that fill a step beside the `beside` sequences decoding (engine.max_tok tokens
    in all: decode_many_with_prompt), or, with none beside or fewer tokens left than that,
    one step of its own: the streams decoding beside it wait one step's time, not the
    whole prompt's."""
    if remaining <= rt.policy.short_prompt:
        room = rt.engine.max_tok - beside
        return min(remaining, room if room > 0 else rt.engine.max_tok)
    return min(remaining, chunk)


def in_steps(rt, tokens: torch.Tensor, state: State, hidden: bool):
    """A short prompt as decode steps: engine.max_tok tokens at a time as verify steps (a
    graph per attended length, like decode's), the last few tokens as decode steps (decode's
    own graphs; verify steps where the hidden states are wanted). Each layer's misses are
    planned and fetched into the cache (or computed on the CPU) on the device, with no host
    sync, and the cache lends nothing to a workspace. Only the last step's logits are kept:
    decode's headroom under the cap holds one step's, not a prompt's."""
    state.check_room(tokens.shape[1])
    step, n = rt.engine.max_tok, tokens.shape[1]
    states = []
    for s in range(0, n, step):
        t = tokens[:, s:s + step]
        last = None   # the previous step's logits go before this step allocates its own
        if t.shape[1] == step or hidden:
            lg, h = rt.verify(t, state)
            last = lg[:, -1].clone()   # not a view that keeps all T rows
            states.append(h)
            del lg
        else:
            for j in range(t.shape[1]):
                last = None
                last = rt.decode(t[:, j], state)
    return (last, torch.cat(states, dim=1)) if hidden else last


@contextlib.contextmanager
def scope(rt, what: str, n: int, state: State, chunk: int, all_logits: bool):
    """Around n prompt tokens: the context must hold them (checked before anything is
    mapped), the KV is mapped that far, torch gets the chunk's workspace; after, torch's
    peak above what it held (`prefill_memory`, beside the estimate the cache made room
    for), and an elastic cache takes the prefill staging back while decoding."""
    dev, eng, past = rt.device, rt.engine, state.n_past
    state.check_room(n)
    rt.vram.room_for_kv(state, past + n)
    rt.vram.room_for_prefill(rt.config, n, past, chunk, all_logits,
                             eng.staging_bytes if eng.staging is None else 0)
    eng.ensure_staging()
    rt.vram.reset_torch_peak()
    before = torch.cuda.memory_allocated(dev)
    yield
    rt.prefill_memory.append({
        "what": what, "tokens": n, "past": past,
        "estimate": prefill_workspace_bytes(rt.config, min(n, chunk), past + n, all_logits),
        "used": torch.cuda.max_memory_allocated(dev) - before})
    del rt.prefill_memory[:-64]
    if rt.cache.elastic and eng.release_staging():
        rt.vram.grow_pending = True
