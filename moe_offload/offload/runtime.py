"""The offload runtime: a MoE model under a hard VRAM cap, a Backend.

    rt = open_runtime("model.gguf", vram="8GiB", policy=OffloadPolicy(), ctx=4096)
    st = rt.new_state(1);  logits = rt.prefill(tokens, st);  logits = rt.decode(token, st)
    rt.stats() -> RuntimeStats;  rt.snapshot(st) / rt.restore(st, snap);  rt.close()
    rt = open_runtime(..., max_sequences=4): up to 4 states, stepped together by
    rt.decode_many(tokens [B], [st, ...]) (each layer's experts fetched once for the batch)

Its parts are assembled by build.py; this file is the public face and the one bracket every
decode step goes through (`_step`): room for the KV under the cap, the cache's memory taken
back, guessing switched as measured, then the step eager or as a captured graph (graphs.py),
then the host's counters. Prompts longer than policy.short_prompt take the model's prefill
path (experts streamed through staging buffers), shorter ones run as decode steps.
"""
from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from loaders import LoadedModel

from ..backend import Backend, Capabilities
from ..config import OffloadPolicy
from ..errors import OffloadError
from ..state import State, StateTable
from .budget import allocator_peaks
from .build import RuntimeOptions, assemble
from . import mtp_steps
from .graphs import GraphCache, GraphKey
from .guessing import Guessing
from .placement import prefill_workspace_bytes, prompt_chunk
from .report import RoutingRecorder, RuntimeStats
from .sequences import StatePool


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
    """A MoE model under a VRAM cap (module docstring)."""

    def __init__(self, loaded: LoadedModel, opts: RuntimeOptions,
                 progress: Callable[[str, int, int], None] | None = None):
        p = assemble(loaded, opts, progress)
        self.opts, self.config, self.policy, self.device = opts, p.config, opts.policy, p.device
        self.report, self.smi, self.pinned = p.report, p.smi, p.pinned
        self.bank, self.cache, self.vram = p.bank, p.cache, p.vram
        self.scheduler, self.engine, self.model, self.mtp = p.scheduler, p.engine, p.model, p.mtp
        self.pool = StatePool(p.states, opts, p.config, p.device, p.vram)
        self.graphs = GraphCache(p.device, p.vram, p.engine, opts.policy.max_graphs)
        try:   # (a number of guesses the step cannot take is refused here)
            self.guessing = Guessing(p.engine, p.scheduler, p.bank, p.model, p.config,
                                     opts.policy, p.device)
        except BaseException:
            p.close()
            raise
        self.prefill_memory: list[dict] = []   # each prompt's workspace: estimate and use
        self._recorder: RoutingRecorder | None = None
        self.reset_stats()

    @property
    def caps(self) -> Capabilities:
        n = self.opts.max_sequences
        return Capabilities(max_sequences=n, batched=n > 1, speculative=self.mtp is not None,
                            shared_state=n == 1, offload=True)

    @property
    def captures(self) -> int:
        return self.graphs.captures

    @property
    def capture_s(self) -> float:
        return self.graphs.capture_s

    @property
    def guessing_changes(self) -> int:
        return self.guessing.changes

    @property
    def prefetching(self) -> bool:
        """Whether decode steps guess the next layer's experts now."""
        return self.guessing.active

    # -- sequences ---------------------------------------------------------------------------------
    @property
    def max_sequences(self) -> int:
        return self.opts.max_sequences

    def new_state(self, batch: int = 1, n_ctx: int | None = None, kv_dtype=None) -> State:
        return self.pool.new_state(batch, n_ctx)

    def release(self, state: State) -> None:
        self.pool.release(state)

    @property
    def in_use(self) -> set[int]:
        return self.pool.in_use

    # -- prompts -----------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, state: State, chunk: int | None = None,
                all_logits: bool = False, hidden: bool = False):
        """tokens [B, T] on the device -> last logits [B, V] (or all [B, T, V]); hidden: and
        every position's final-normed hidden state [B, T, H] (the MTP head's input). chunk:
        tokens a chunk (None: as large as the reserved workspace holds, placement.prompt_chunk)."""
        n = tokens.shape[1]
        chunk = chunk or prompt_chunk(self.config, n, state.n_past + n, self.opts.n_ctx,
                                      self.policy, all_logits)
        if n <= self.policy.short_prompt and not all_logits:
            return self._prefill_in_steps(tokens, state, hidden)
        with self._prompt("prefill", n, state, chunk, all_logits):
            return self.model.prefill(tokens, state, chunk, all_logits, hidden)

    def prepare_batches(self, states: list[State]) -> None:
        """Capture the decode steps of 1..len(states) sequences and a short prompt's verify
        step now: through the table, any States run them later, so requests joining and
        leaving a batch capture nothing while every sequence attends within the first
        bucket (policy.graph_bucket positions; each later bucket captures once a size)."""
        if not self.opts.use_graphs or self.opts.max_sequences < 2 or not states:
            return
        ids = torch.zeros(self.engine.max_tok, dtype=torch.long, device=self.device)
        for b in range(1, len(states) + 1):
            self.decode_many(ids[:b], states[:b])
        self.verify(ids[None], states[0])
        for st in states:
            self.pool.empty(st)

    def prompt_piece(self, remaining: int, chunk: int) -> int:
        """A prompt short enough to run as decode-sized steps (policy.short_prompt) goes in one
        such step (engine.max_tok tokens) between two batched decode steps, so the streams
        decoding beside it wait one step's time, not the whole prompt's."""
        if remaining <= self.policy.short_prompt:
            return min(remaining, self.engine.max_tok)
        return min(remaining, chunk)

    def forward(self, tokens: torch.Tensor, state: State, last_only: bool = False) -> torch.Tensor:
        n = tokens.shape[1]
        with self._prompt("forward", n, state, n, not last_only):
            return self.model.forward(tokens, state, last_only)

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

    @contextlib.contextmanager
    def _prompt(self, what: str, n: int, state: State, chunk: int, all_logits: bool):
        """Around n prompt tokens: the context must hold them (checked before anything is
        mapped), the KV is mapped that far, torch gets the chunk's workspace; after, torch's
        peak above what it held (`prefill_memory`, beside the estimate the cache made room
        for), and an elastic cache takes the prefill staging back while decoding."""
        dev, eng, past = self.device, self.engine, state.n_past
        state.check_room(n)
        self.vram.room_for_kv(state, past + n)
        self.vram.room_for_prefill(self.config, n, past, chunk, all_logits,
                                   eng.staging_bytes if eng.staging is None else 0)
        eng.ensure_staging()
        self.vram.reset_torch_peak()
        before = torch.cuda.memory_allocated(dev)
        yield
        self.prefill_memory.append({
            "what": what, "tokens": n, "past": past,
            "estimate": prefill_workspace_bytes(self.config, min(n, chunk), past + n, all_logits),
            "used": torch.cuda.max_memory_allocated(dev) - before})
        del self.prefill_memory[:-64]
        if self.cache.elastic and eng.release_staging():
            self.vram.grow_pending = True

    # -- decode steps ------------------------------------------------------------------------------
    def decode(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """One token per sequence: tokens [B] on the device -> logits [B, V] (a fresh tensor)."""
        B = tokens.shape[0]
        if B != state.batch or B > self.engine.max_tok:
            raise OffloadError(f"a decode step of {B} sequences on a state of {state.batch}: the "
                               "offload runtime decodes one sequence at a time for now")
        return self._step(tokens, [state], 1, lambda t, table: (
            self.model.decode(t, state) if table is None
            else self.model.decode_many(t, [state], table)))

    def decode_many(self, tokens: torch.Tensor, states: list[State]) -> torch.Tensor:
        """One token for each of B sequences at their own positions, in one decode step: tokens
        [B] on the device, B states from new_state -> logits [B, V] (a fresh tensor). Each
        layer's experts are planned, fetched and computed once for the B tokens (the union of
        their choices); the mixers run per sequence."""
        B = tokens.shape[0]
        if len(states) != B or not 1 <= B <= self.engine.max_tok:
            raise OffloadError(f"decode_many takes 1..{self.engine.max_tok} tokens, one a state; "
                               f"got {B} tokens and {len(states)} states")
        if B == 1:
            return self.decode(tokens, states[0])
        if len({id(st) for st in states}) != B:
            raise OffloadError("decode_many got the same state twice; one token a sequence")
        for st in states:
            self.pool.key_of(st)
        return self._step(tokens, states, 1,
                          lambda t, table: self.model.decode_many(t, states, table))

    def verify(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [1, T] on the device, 1 <= T <= engine.max_tok -> (logits [1, T, V], the
        final-normed hidden states [1, T, H]), fresh tensors. One decode step of T tokens: the
        union of their experts planned and fetched once. With state.keep_steps the delta-net
        state after each token is kept (rewind)."""
        T = tokens.shape[1]
        if state.batch != 1 or not 1 <= T <= self.engine.max_tok:
            raise OffloadError(f"a verify step takes 1..{self.engine.max_tok} tokens of one "
                               f"sequence, got {list(tokens.shape)}")
        depth = next(iter(state.steps.values()))[0].shape[0] if state.steps else 0
        keep = 1 < T <= depth + 1
        tabled = not keep   # (a step keeping per-token states is bound to its State's buffers)
        return self._step(tokens, [state], T,
                          lambda t, table: self.model.forward(t, state, hidden=True, table=table),
                          kind="verify", detail=(keep, depth), keeps=T if keep else 0,
                          tabled=tabled)

    def _step(self, tokens: torch.Tensor, states: list[State], T: int, run, *,
              kind: str = "decode", detail: tuple = (), keeps: int = 0, tabled: bool = True):
        """The bracket of every decode step: T tokens of each of `states` by run(tokens, table),
        eager or as the graph captured for its key; fresh output tensors.

        A runtime of several sequences passes the States to the step through a StateTable
        (`tabled`): its graphs are keyed by the batch size and the longest attended bucket, not
        by which States they run, so requests joining and leaving a batch capture nothing. A
        runtime of one sequence binds its graphs to its one State (table None)."""
        for st in states:
            st.check_room(T)
        for st in states:   # attention reads up to the bucket's end
            self.vram.room_for_kv(st, st.attn_len(T))
        self.vram.regrow()   # the last prompt (or KV) borrowed from the cache: take it back
        tabled = tabled and self.opts.max_sequences > 1
        # (a replayed trace's rows by position: steps bound to one State)
        self.engine.position = states[0].pos if len(states) == 1 and not tabled else None
        n_tok = T * len(states)
        inputs = [tokens, StateTable.stack(states)] if tabled else [tokens]
        call = (lambda t, rows: run(t, StateTable(rows, states[0]))) if tabled else \
            (lambda t: run(t, None))
        if not self.opts.use_graphs:
            out = self._eager(inputs, n_tok, call)
            if tabled:
                self._advance(states, T)
            self.guessing.observe()
            return out
        self.guessing.follow(self.graphs.drop)
        if tabled:
            key = GraphKey(kind, (), T, (max(st.attn_len(T) for st in states),),
                           (len(states), *detail))
        else:
            key = GraphKey(kind, tuple(id(st) for st in states), T,
                           tuple(st.attn_len(T) for st in states), detail)
        out = self.graphs.replay(
            key, inputs, call, step_size=n_tok, bounded=len(states) > 1,
            warm_up=lambda copies: self._warm_up(copies, states, n_tok, call),
            around=lambda: self._capturing(states),
            before_replay=lambda: self.engine.arm(n_tok))
        for st in states:       # the captured step advanced the device positions only
            st.n_past += T
            st.steps_taken = keeps
        if tabled:              # ... and through a table, not even those
            self._advance(states, T)
        self.guessing.observe()
        return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()

    @staticmethod
    def _advance(states: list[State], T: int) -> None:
        """The device positions of States a step reached through a table (one launch)."""
        torch._foreach_add_([st.pos for st in states], T)

    def _eager(self, inputs: list, n_tok: int, run):
        """One decode step of n_tok tokens run eagerly (run(*inputs) inside the engine's step)."""
        self.guessing.follow(self.graphs.drop)
        eng = self.engine
        eng.arm(n_tok)
        with eng.decode_step():
            out = run(*inputs)
        eng.settle()
        return out

    def _warm_up(self, inputs: list, states: list[State], n_tok: int, run) -> None:
        """A step run once eagerly before its first capture (lazy inits, the allocator): a real
        step, so the states and the cache's statistics are rewound after it."""
        snaps, stats = [st.snapshot() for st in states], self.cache.stats.clone()
        self._eager(inputs, n_tok, run)
        for st, snap in zip(states, snaps):
            st.restore(snap)
        self.cache.stats.copy_(stats)

    @contextlib.contextmanager
    def _capturing(self, states: list[State]):
        """Around a step's capture: the engine's decode step; the host counters stay (a capture
        runs no kernels)."""
        n_past = [st.n_past for st in states]
        try:
            with self.engine.decode_step():
                yield
        finally:
            for st, n in zip(states, n_past):
                st.n_past = n

    # -- speculative decoding's MTP head -------------------------------------------------------------
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
            self.graphs.drop()   # a new depth is a new verify graph
        state.keep_steps(depth)
        if self.mtp is not None:
            state.add_mtp_kv()
        self.vram.cap_torch()

    def draft(self, hidden: torch.Tensor, tokens: torch.Tensor, state: State, k: int) -> torch.Tensor:
        """k greedy draft ids [k] on the device from the MTP head (mtp_steps.draft)."""
        return mtp_steps.draft(self, hidden, tokens, state, k)

    def mtp_rows(self, hidden: torch.Tensor, tokens: torch.Tensor, state: State) -> None:
        """Write the MTP KV rows the head is owed (mtp_steps.mtp_rows)."""
        mtp_steps.mtp_rows(self, hidden, tokens, state)

    # -- routing: record it, or replay a trace ------------------------------------------------------
    def attach_recorder(self, recorder: RoutingRecorder | None) -> RoutingRecorder | None:
        """Record the ids every later decode step routes into `recorder` (None: stop)."""
        c = self.config
        self.engine.record = (None if recorder is None
                              else recorder.bind(c.n_layer, c.n_expert_used, self.device))
        self._recorder = recorder
        self.graphs.drop(new_kernels=True)
        return recorder

    def replay(self, trace, by_position: bool = False) -> None:
        """Route decode steps by a trace [N, L, K] of expert ids (numpy or torch; step s uses
        row (s - 1) mod N, and token t of a step of several tokens row (s - 1 + t * N / max_tok)
        mod N: sequences stepped together by decode_many follow their own stretches of the trace)
        instead of the model's router; None: the model's routing again.
        by_position: a token at position p uses row p mod N instead (decode and verify steps
        of a runtime of one sequence; a verify step's T tokens their T rows), so speculative
        and plain decoding route every position alike. Guesses are off while replaying (the router
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
        self.graphs.drop(new_kernels=True)

    # -- statistics ----------------------------------------------------------------------------------
    def stats(self) -> RuntimeStats:
        """Cache and CPU statistics since the last reset_stats() (a sync point)."""
        self.engine.settle()
        return RuntimeStats.collect(self, self._busy0, self._experts0)

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
        d["reserved_peak"] = max(d["reserved_peak"], self.vram.torch_peak)
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
        self.graphs.close()
        torch.cuda.synchronize(self.device)
        self.engine.settle()
        self.pool.close()
        self.cache.close()
        self.bank.close()
        self.pinned.close()
        torch.cuda.set_per_process_memory_fraction(1.0, self.device.index or 0)
        # No GPU memory held after close, even while the object lives on: the next runtime of
        # this process sizes its cache from what is allocated under its cap
        self.model = self.mtp = self.engine.predict = None
        gc.collect()
        # cuBLAS keeps a workspace for every stream it ran on, for the life of the process:
        # each runtime's own streams would leave theirs behind
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
