"""The offload runtime: a MoE model under a hard VRAM cap, a Backend.

    rt = open_runtime("model.gguf", vram="8GiB", policy=OffloadPolicy(), ctx=4096)
    st = rt.new_state(1);  logits = rt.prefill(tokens, st);  logits = rt.decode(token, st)
    rt.stats() -> RuntimeStats;  rt.snapshot(st) / rt.restore(st, snap);  rt.close()
    rt = open_runtime(..., max_sequences=4): up to 4 states, stepped together by
    rt.decode_many(tokens [B], [st, ...]) (each layer's experts fetched once for the batch)

Its parts are assembled by build.py; this file is the public face and the one bracket every
decode step goes through (`_step`): room for the KV under the cap, the cache's memory taken
back, guessing switched as measured, then the step eager or as a captured graph (graphs.py),
then the host's counters. Prompts: prompts.py (longer than policy.short_prompt by the model's
prefill path, experts streamed through staging buffers; shorter ones as decode steps).
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
from . import mtp_steps, prompts
from .graphs import GraphCache, GraphKey
from .guessing import Guessing
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
    other fields (profile, host_head, host_embedding, use_graphs, cpu_threads, kv_type, ...)."""
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
                                     opts.policy)
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

    def new_state(self, batch: int = 1, n_ctx: int | None = None, kv_type=None) -> State:
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
        tokens a chunk (None: as large as the reserved workspace holds, placement.prompt_chunk).
        prompts.prefill: long prompts by the model's prefill path, short ones as decode steps."""
        return prompts.prefill(self, tokens, state, chunk, all_logits, hidden)

    def forward(self, tokens: torch.Tensor, state: State, last_only: bool = False) -> torch.Tensor:
        return prompts.forward(self, tokens, state, last_only)

    def prompt_piece(self, remaining: int, chunk: int, beside: int = 0) -> int:
        return prompts.prompt_piece(self, remaining, chunk, beside)

    def prepare_batches(self, states: list[State]) -> None:
        """Capture now the decode steps of 1..len(states) sequences, those of 1..len(states)-1
        with a prompt's piece beside them (decode_many_with_prompt) and a short prompt's verify
        step, guessing and not where guessing may change at run time: through the table, any
        States run them later, so requests joining and leaving a batch capture nothing while
        every sequence attends within the first bucket (policy.graph_bucket positions; each
        later bucket captures once a size)."""
        if not self.opts.use_graphs or self.opts.max_sequences < 2 or not states:
            return
        top = self.engine.max_tok
        ids = torch.zeros(top, dtype=torch.long, device=self.device)
        now = self.guessing.active
        for guess in [now, not now] if self.guessing.may_change else [now]:
            self.guessing.set(guess)   # (the steps of both modes: guessing changes as measured)
            for b in range(1, len(states) + 1):
                self.decode_many(ids[:b], states[:b])
                if b < len(states) and b < top:
                    self.decode_many_with_prompt(ids[:b], states[:b], ids[None, :top - b],
                                                 states[b])
            self.verify(ids[None], states[0])
            for st in states:
                self.pool.empty(st)
        self.guessing.set(now)

    # -- decode steps ------------------------------------------------------------------------------
    def decode(self, tokens: torch.Tensor, state: State) -> torch.Tensor:
        """One token per sequence: tokens [B] on the device -> logits [B, V] (a fresh tensor)."""
        B = tokens.shape[0]
        if B != state.batch or B > self.engine.max_tok:
            raise OffloadError(f"a decode step of {B} sequences on a state of {state.batch}: the "
                               "offload runtime decodes one sequence at a time for now")
        return self._step(tokens, [state], [1], lambda t, table: (
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
        return self._step(tokens, states, [1] * B,
                          lambda t, table: self.model.decode_many(t, states, table))

    def decode_many_with_prompt(self, tokens: torch.Tensor, states: list[State],
                                prompt: torch.Tensor, state: State):
        """decode_many of `states` and the next T tokens of `state`'s prompt (prompt [1, T])
        in one step when B + T = engine.max_tok (the steps prepare_batches captures): the
        union of all their experts planned and fetched once -> (logits [B, V], the prompt's
        last logits [1, V]), fresh tensors. Otherwise, or on a runtime of one sequence, the
        two run one after the other."""
        B, T = tokens.shape[0], prompt.shape[1]
        if self.opts.max_sequences < 2 or B < 1 or B + T != self.engine.max_tok \
                or state.steps or len(states) != B:
            return super().decode_many_with_prompt(tokens, states, prompt, state)
        every = [*states, state]
        if len({id(st) for st in every}) != B + 1:
            raise OffloadError("decode_many_with_prompt got the same state twice")
        for st in every:
            self.pool.key_of(st)
        out = self._step(torch.cat([tokens, prompt[0]]), every, [1] * B + [T],
                         lambda t, table: self.model.decode_many(t, every, table, prompt_tokens=T),
                         kind="decode+prompt")
        return out[:B], out[B:]

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
        return self._step(tokens, [state], [T],
                          lambda t, table: self.model.forward(t, state, hidden=True, table=table),
                          kind="verify", detail=(keep, depth), keeps=T if keep else 0,
                          tabled=tabled)

    def _step(self, tokens: torch.Tensor, states: list[State], counts: list[int], run, *,
              kind: str = "decode", detail: tuple = (), keeps: int = 0, tabled: bool = True):
        """The bracket of every decode step: counts[i] tokens of states[i] (one each, T of one
        for a verify step, or one each and a prompt's piece) by run(tokens, table), eager or as
        the graph captured for its key; fresh output tensors.

        A runtime of several sequences passes the States to the step through a StateTable
        (`tabled`): its graphs are keyed by the batch size and the longest attended bucket, not
        by which States they run, so requests joining and leaving a batch capture nothing. A
        runtime of one sequence binds its graphs to its one State (table None)."""
        for st, n in zip(states, counts):
            st.check_room(n)
        for st, n in zip(states, counts):   # attention reads up to the bucket's end
            self.vram.room_for_kv(st, st.attn_len(n))
        self.vram.regrow()   # the last prompt (or KV) borrowed from the cache: take it back
        tabled = tabled and self.opts.max_sequences > 1
        # (a replayed trace's rows by position: steps bound to one State)
        self.engine.position = states[0].pos if len(states) == 1 and not tabled else None
        n_tok = sum(counts)
        inputs = [tokens, StateTable.stack(states)] if tabled else [tokens]
        call = (lambda t, rows: run(t, StateTable(rows, states[0]))) if tabled else \
            (lambda t: run(t, None))
        if not self.opts.use_graphs:
            out = self._eager(inputs, n_tok, call)
            if tabled:
                self._advance(states, counts)
            self.guessing.observe()
            return out
        self.guessing.follow()
        guesses = self.guessing.active
        if tabled:
            key = GraphKey(kind, (), counts[-1],
                           (max(st.attn_len(n) for st, n in zip(states, counts)),),
                           (len(states), *detail), guesses)
        else:   # (one token each, or T of one State)
            key = GraphKey(kind, tuple(id(st) for st in states), counts[0],
                           tuple(st.attn_len(n) for st, n in zip(states, counts)), detail,
                           guesses)
        out = self.graphs.replay(
            key, inputs, call, step_size=(n_tok, guesses), bounded=len(states) > 1,
            warm_up=lambda copies: self._warm_up(copies, states, n_tok, call),
            around=lambda: self._capturing(states),
            before_replay=lambda: self.engine.arm(n_tok))
        for st, n in zip(states, counts):   # the captured step advanced the device positions
            st.n_past += n                  # only
            st.steps_taken = keeps
        if tabled:              # ... and through a table, not even those
            self._advance(states, counts)
        self.guessing.observe()
        return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()

    @staticmethod
    def _advance(states: list[State], counts: list[int]) -> None:
        """The device positions of States a step reached through a table (a launch for each
        distinct count)."""
        for n in sorted(set(counts)):
            torch._foreach_add_([st.pos for st, c in zip(states, counts) if c == n], n)

    def _eager(self, inputs: list, n_tok: int, run):
        """One decode step of n_tok tokens run eagerly (run(*inputs) inside the engine's step)."""
        self.guessing.follow()
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
            need += 2 * state.batch * state.n_ctx * c.n_head_kv * \
                state.kv_type.row_bytes(c.head_dim)
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
