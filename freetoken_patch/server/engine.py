"""The engine: one thread owns the model; requests wait in a bounded queue; up to `parallel`
sequences are active, each with its own State. Three modes, chosen at start (`Engine.mode`, shown
by /health and the startup line):

  batched       the plain model (CPU, or a GPU without --vram), and the offload runtime opened
                for several sequences (--vram: max_sequences = --parallel): one decode_many step
                for all the sequences that are decoding, newcomers' prompts in chunks between
                steps (batcher.py).
  interleaved   a custom generate_fn, or --no-batch: the active sequences take turns, one
                generate() step each (round robin), a newcomer's prompt prefilled whole when it
                is admitted.
  speculative   a SpeculativeDecoder (--draft, the model's MTP head) and one sequence at a time:
                generate(..., draft=) drafts tokens and checks them in one trunk forward. The
                decoder's MTP state lives in the State (its KV, rows written, hidden states
                owed), so prefix reuse and snapshots carry it along; its statistics go to the
                metrics when a sequence ends (after a cut-short step is given back).

Requests join at step boundaries and leave when they end. Prefix reuse: a finished sequence's
State stays in a small LRU (`prefix_cache` entries) keyed by the tokens it holds, with
snapshots at its prompt's end. A new request whose prompt starts with those tokens (or with a
snapshot's prefix of them) takes that State over and prefills only the rest. The first turn of
a prompt with several (a system prompt, the tools) is prefilled on its own with a snapshot
after it, so conversations that open the same way share it; so is everything up to the end of
its last complete turn, so the conversation's next request, which re-renders the reply after
it in ids that need not be the ones generated, reuses all of it. A job's constraint (a grammar
mask) and logprobs ride in its TokenStream; a completion's echo prefills its prompt with every
position's logits first (no prefix reuse then). An offload runtime opened for one
sequence hands out one State, so the engine then runs one sequence at a time and caches that one.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections import deque
from typing import Callable

import torch

from moe_offload import (SERVING, Cached, DoneEvent, NonFiniteLogits, OffloadError, PrefixIndex,
                         TokenEvent, as_backend, generate, prompt_logprobs)

from .batcher import Batcher
from .jobs import Active, Failure, Job, QueueFull, ShuttingDown, with_snapshot


class Engine:
    """The queue, the engine thread and its sequences. `model`: a moe_offload Backend (a bare
    model is wrapped). `generate_fn` (moe_offload.generate by default) can be replaced by a
    scripted stream in tests (the interleaved mode); `batch`: None picks the batched mode
    wherever the backend batches (caps.batched) and generate_fn is generate(), False keeps the
    interleaved one; `draft` (moe_offload SpeculativeDecoder) makes
    it speculative, one sequence at a time (parallel must be 1); `metrics`
    (server.metrics.Metrics) gets each finished sequence, the runtime's stats() and the
    draft's."""

    def __init__(self, model, tokenizer, n_ctx: int, *, parallel: int = 4, queue_size: int = 64,
                 prefix_cache: int = 4, prefill_chunk: int = SERVING.prefill_chunk,
                 generate_fn: Callable = generate, batch: bool | None = None, metrics=None,
                 draft=None, run_ahead: bool | None = None, source: str | None = None):
        self.model = be = as_backend(model)
        self.tokenizer, self.n_ctx, caps = tokenizer, n_ctx, be.caps
        self.generate_fn, self.metrics, self.draft = generate_fn, metrics, draft
        self.source = source           # the model file, named in an error about its weights
        self.faults: dict = {}         # the model's own failures (NaN/Inf logits), for /health
        self.draft_stats: dict = {}    # the decoder's SpecStats as last published
        self.queue_size = queue_size
        self.prefill_chunk = max(1, int(prefill_chunk))
        first = be.new_state(1, n_ctx)
        # an offload runtime opened for one sequence hands out the same State each time
        self.single_state = caps.shared_state
        self.parallel = 1 if self.single_state else min(parallel, caps.max_sequences)
        can_batch = caps.batched and generate_fn is generate and not self.single_state
        self.batched = can_batch if batch is None else bool(batch) and can_batch
        if draft is not None:
            # one decoder drafts for one sequence (its ids, its last step); a batched step of
            # several already shares each layer's expert reads, which is what drafting buys one
            if self.parallel > 1:
                raise ValueError(f"speculative decoding steps one sequence at a time, not "
                                 f"{self.parallel}; use parallel=1")
            self.batched = False
        self.mode = ("speculative" if draft is not None else
                     "batched" if self.batched else "interleaved")
        self.batch_size = 0            # sequences in the last decode step
        # batched: queue the next step on the drawn ids before reading them (None: on a GPU)
        if run_ahead is None:
            run_ahead = be.device.type == "cuda"
        self.batcher = Batcher(self, bool(run_ahead)) if self.batched else None
        self.cache = PrefixIndex(min(prefix_cache, 1) if self.single_state else prefix_cache)
        self._max_states = 1 if self.single_state else min(
            self.parallel + self.cache.size, caps.max_sequences)
        self._free = [first]
        self._n_states = 1
        if self.batched and self.parallel > 1 and caps.offload:
            # every batch size's step captured now, so that requests joining and leaving a
            # batch later wait for no capture (the plain model captures nothing)
            more = [be.new_state(1, n_ctx) for _ in range(self.parallel - 1)]
            be.prepare_batches([first] + more)
            self._free += more
            self._n_states += len(more)
        self._pending: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.n_active = 0
        self.prefilled_tokens = 0      # prompt tokens fed to the model
        self.reused_tokens = 0         # prompt tokens a cached prefix saved
        # the engine thread's wall time by what it ran: prompt chunks, decode steps (their
        # sampling and readback, a graph capture included), generate() turns (interleaved mode)
        self.busy_s = {"prefill": 0.0, "decode": 0.0, "generate": 0.0}
        if metrics is not None:
            metrics.gauges = self.gauges
            metrics.counters = self.counters
        self._publish_draft()     # the series exist (at 0) before the first request

    # -- the request side (any thread) ------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ftpatch-engine", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise ShuttingDown()
            if len(self._pending) >= self.queue_size:
                raise QueueFull()
            self._pending.append(job)
            self._cv.notify()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with drain, finish those queued and active, else drop them."""
        with self._cv:
            self._stopping = True
            if not drain:
                while self._pending:
                    self._pending.popleft().put(Failure("the server is shutting down", 503))
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def queue_length(self) -> int:
        return len(self._pending)

    def gauges(self) -> dict:
        return {"queue_length": (self.queue_length, "Requests waiting for a sequence slot."),
                "requests_in_flight": (self.n_active, "Sequences being generated now."),
                "parallel": (self.parallel, "Sequences that can be active at once."),
                "decode_batch_size": (self.batch_size, "Sequences advanced by the last decode "
                                                       "step (1 when interleaved).")}

    def counters(self) -> dict:
        out = {"engine_busy_seconds_total": (dict(self.busy_s), "Engine thread wall time by "
                                             "phase (decode includes graph captures and prompt "
                                             "pieces fed beside the decoding requests).")}
        if self.model.caps.offload:   # the offload runtime's CUDA graphs
            out["graph_captures_total"] = (self.model.captures, "Decode graphs captured.")
            out["graph_capture_seconds_total"] = (self.model.capture_s,
                                                  "Time spent capturing decode graphs.")
        return out

    def draft_summary(self) -> dict | None:
        """--draft's setting and what it did (as last published), for /health; None when off."""
        if self.draft is None:
            return None
        fixed = self.draft.policy.fixed
        return {"setting": "auto" if fixed is None else fixed, **self.draft_stats}

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        ring: deque[Active] = deque()
        while True:
            with self._cv:
                while not self._pending and not ring and not self._stopping:
                    self._cv.wait()
                if not self._pending and not ring:
                    return
                admit = []
                while self._pending and len(ring) + len(admit) < self.parallel:
                    admit.append(self._pending.popleft())
            for job in admit:
                seq = self._admit(job)
                if seq is not None:
                    ring.append(seq)
            self.n_active = len(ring)
            if ring:
                try:
                    (self._batch_step if self.batched else self._turn)(ring)
                except Exception as e:   # noqa: BLE001 -- the engine thread must outlive any step
                    self._fail_all(ring, e)
            self.n_active = len(ring)

    def _fail_all(self, ring: deque, e: BaseException) -> None:
        """A step failed outside the guards of its parts: every sequence it held gets the error
        and leaves (its state emptied for the next request); the engine takes the next ones."""
        traceback.print_exc(file=sys.stderr)
        if self.batcher is not None:
            self.batcher.forget()
        while ring:
            seq = ring.popleft()
            if not seq.done:
                self.fail(seq, e)
            try:
                self.retire(seq)
            except Exception:   # noqa: BLE001 -- a state that cannot be kept is dropped
                self._n_states -= 1

    def _batch_step(self, ring: deque) -> None:
        """Batched: one step of every active sequence (Batcher.step)."""
        self.batcher.step(ring)

    @property
    def _readback(self):
        """How the batcher reads a step's ids back (tests count its calls)."""
        return self.batcher.readback

    @_readback.setter
    def _readback(self, fn) -> None:
        self.batcher.readback = fn

    def _turn(self, ring: deque) -> None:
        """Interleaved: the sequence at the front takes one generate() step, then goes last."""
        seq = ring.popleft()
        with self.timed("generate"):
            going = not seq.job.cancelled and self._step(seq)
        if not going:
            self.retire(seq)
        else:
            ring.append(seq)
        self.batch_size = 1

    def _step(self, seq: Active) -> bool:
        """Advance one sequence by one event; False when it is finished."""
        try:
            ev = next(seq.gen)
        except StopIteration:
            seq.done = True
            return False
        except Exception as e:   # noqa: BLE001
            self.fail(seq, e)
            return False
        if isinstance(ev, TokenEvent):
            if not seq.sampled and seq.state.n_past:
                seq.snaps = with_snapshot(seq.snaps, seq.state)
            seq.sampled.append(ev.token)
            seq.job.put(ev)
            return True
        seq.done = True
        if isinstance(ev, DoneEvent):
            seq.sampled = list(ev.tokens)   # with an end-of-generation id: on a GPU generate()
            self.finished(seq, ev)         # queued a step on it, and the State holds it
        seq.job.put(ev)
        return False

    # -- admission: a cached prefix or a fresh State ----------------------------------------------
    def _admit(self, job: Job) -> Active | None:
        if job.cancelled:
            return None
        state = None
        try:
            entry, n, snap, job.prompt = (
                self.cache.take(job.prompt, job.text, job.encode or self._encode,
                                max_len=self.n_ctx)
                if self.cache.size and job.echo_logprobs is None else (None, 0, None, job.prompt))
            if entry is None:
                state, history, snaps = self._fresh_state(), [], []
            else:
                state = entry.state
                if snap is not None:
                    state.restore(snap)
                    history = entry.tokens[:snap.n_past]
                    snaps = [s for s in entry.snaps if s.n_past <= snap.n_past]
                else:
                    history, snaps = entry.tokens, entry.snaps
            job.n_cached = len(history)
            self.reused_tokens += len(history)
            if job.echo_logprobs is not None:   # every prompt position's logits, by chunks
                with self.timed("prefill"):
                    job.prompt_logprobs = prompt_logprobs(self.model, state, job.prompt,
                                                          job.echo_logprobs)
                history = job.prompt[:-1]
                self.prefilled_tokens += len(history)
            cuts = [] if job.echo_logprobs is not None else self._rewind_points(job.prompt)
            if self.batched:     # the prompt goes in by chunks, between decode steps
                return self.batcher.admit(job, state, history, snaps, cuts)
            for cut in (c for c in cuts if c > len(history)):
                # prefill up to a rewind point on its own and keep a snapshot there: the first
                # turn (a system prompt, the tools: other conversations that open the same way
                # reuse it), the last complete turn (this conversation's next request)
                head = job.prompt[len(history):cut]
                t0 = time.perf_counter()
                head_t = torch.tensor([head], device=self.model.device)
                if self.draft is not None:   # the MTP head sees the first turn too
                    self.draft.prefill(head_t, state, history=history)
                else:
                    self.model.prefill(head_t, state)
                took = time.perf_counter() - t0
                job.head_s += took
                self.busy_s["prefill"] += took
                self.prefilled_tokens += len(head)
                snaps = with_snapshot(snaps, state)
                history = job.prompt[:cut]
            seq = Active(job, state, history, job.prompt[len(history):], snaps)
            kw = {} if self.draft is None else {"draft": self.draft}
            if job.constraint is not None and self.generate_fn is generate:
                kw["constraint"] = job.constraint   # (a test's scripted stream takes none)
            seq.gen = self.generate_fn(self.model, state, seq.feed, job.params,
                                       tokenizer=self.tokenizer, history=history, **kw)
            self.prefilled_tokens += len(seq.feed)
            return seq
        except Exception as e:   # noqa: BLE001 -- reported to the request, the engine goes on
            job.put(Failure(_message(e)))
            if state is not None:
                state = self._broken(state)
                if state is not None:
                    self._free.append(state)
            return None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=False, parse_special=True)

    def _rewind_points(self, prompt: list[int]) -> list[int]:
        """Where a prompt's prefill keeps snapshots, besides its end: just after its first
        end-of-turn id when another turn follows (a system prompt and the tools, which other
        conversations share), and just after its last one (the end of the last complete turn:
        the next request of this conversation re-renders the reply after it, and the reply's
        rendering -- a thinking block dropped, the generation prompt's empty one -- need not
        match the ids generated, so without it only the first turn would be reused). The
        recurrent state cannot rewind to any position, only to a snapshot."""
        if not self.cache.size or self.tokenizer is None:
            return []
        eot = self.tokenizer.eog_ids
        ends = [i + 1 for i, t in enumerate(prompt) if t in eot and i + 1 < len(prompt)]
        points = {ends[0]} if len(ends) >= 2 else set()
        if ends:
            points.add(ends[-1])
        return sorted(points)

    # -- what the modes and the batcher report ----------------------------------------------------
    @contextlib.contextmanager
    def timed(self, phase: str):
        """Adds the time the block takes to the engine thread's busy seconds of `phase`."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s[phase] += time.perf_counter() - t0

    def fail(self, seq: Active, e: BaseException) -> None:
        """The sequence failed: its job gets the error, its state is emptied. Logits that are
        NaN or Inf fail only this request (no token of them is sent), named as the model's
        fault and counted for /health."""
        msg = _message(e)
        if isinstance(e, NonFiniteLogits):
            if self.source:
                msg = f"{self.source}: {msg}"
            self.faults = {"non_finite_logits": self.faults.get("non_finite_logits", 0) + 1,
                           "last": msg}
        seq.job.put(Failure(msg))
        seq.done, seq.state = True, self._broken(seq.state)

    def finished(self, seq: Active, ev: DoneEvent) -> None:
        """The sequence ended: its figures go to the metrics."""
        if self.metrics is not None:
            t = ev.timings
            self.metrics.finished(len(seq.job.prompt), seq.job.n_cached, len(ev.tokens),
                                  seq.job.head_s + t.ttft_s, t.decode_tps)
        self._publish_draft()    # before the reply goes out: a client then reads both together

    def retire(self, seq: Active) -> None:
        """The sequence leaves: its State is cached for prefix reuse or freed."""
        if not seq.done and seq.gen is not None:
            seq.gen.close()
        if seq.state is None:
            pass
        elif self.cache.size and seq.state.n_past:
            out = self.cache.put(Cached(seq.state, seq.cached_tokens(), seq.snaps,
                                        seq.cached_text(self.tokenizer),
                                        prompt_text=seq.job.text, n_prompt=len(seq.job.prompt)))
            if out is not None:
                self._free.append(out.state)
        else:
            self._free.append(seq.state)
        self._read_stats()
        self._publish_draft()

    def _publish_draft(self) -> None:
        """Copy the decoder's statistics for /metrics and /health. Only when a sequence ends
        (done, or closed when cancelled): a step cut short is given back then (SpecStats.tokens
        shrinks), and what was published must never go down."""
        if self.draft is None:
            return
        self.draft_stats = self.draft.stats.as_dict()
        if self.metrics is not None:
            self.metrics.set_draft(self.draft_stats)

    def _read_stats(self) -> None:
        if self.metrics is None:
            return
        try:
            from .metrics import runtime_gauges
            s = self.model.stats()
            if s is not None:
                self.metrics.set_runtime(runtime_gauges(s if isinstance(s, dict) else s.as_dict()))
        except Exception:   # noqa: BLE001 -- statistics must never take the server down
            pass

    # -- States -----------------------------------------------------------------------------------
    def _fresh_state(self):
        if self._free:
            st = self._free.pop()
        elif self._n_states < self._max_states:
            self._n_states += 1
            return self.model.new_state(1, self.n_ctx)
        else:
            st = self.cache.pop_oldest().state
        if self.single_state:
            return self.model.new_state(1, self.n_ctx)   # the runtime also gives the KV back
        st.reset()
        return st

    def _broken(self, state):
        """After a failed step the state may be half-written: empty it for the next one."""
        try:
            if self.single_state:
                self.model.new_state(1, self.n_ctx)
            else:
                state.reset()
            return state
        except Exception:   # noqa: BLE001 -- a state that cannot even reset is dropped
            self._n_states -= 1
            return None


def _message(e: BaseException) -> str:
    if isinstance(e, OffloadError):
        return str(e)
    return f"generation failed: {type(e).__name__}: {e}"[:500]
