"""The engine: one thread owns the model; requests wait in a bounded queue; up to `parallel`
sequences are active, each with its own State, and the loop advances them one step each in
turn (round robin), admitting queued requests (their prefill) between steps.

This interleaves sequences; it does not batch them. Each step is one sequence's decode (or a
new one's prefill), so N active requests share the model's single-sequence speed. True
batched decode (one step for several sequences, the union of their experts fetched once per
layer) needs multi-sequence steps in the runtime and is not here yet.

Prefix reuse: a finished sequence's State stays in a small LRU (`prefix_cache` entries) keyed
by the tokens it holds, with snapshots at its prompt's end. A new request whose prompt starts
with those tokens (or with a snapshot's prefix of them) takes that State over and prefills
only the rest. The first turn of a prompt with several (a system prompt, the tools) is
prefilled on its own with a snapshot after it, so conversations that open the same way share it. The offload runtime has one State per batch size, so under --vram the engine
runs one sequence at a time and caches that one State.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from moe_offload import DoneEvent, OffloadError, SamplingParams, TokenEvent, generate

MAX_SNAPSHOTS = 4   # rewind points kept per cached sequence (each copies the recurrent state)


class QueueFull(Exception):
    """The queue holds --queue requests already."""


class ShuttingDown(Exception):
    """The server is draining and takes no new requests."""


@dataclass(frozen=True)
class Failure:
    """What a job receives instead of a DoneEvent when its sequence failed."""
    message: str
    status: int = 500


@dataclass(eq=False)
class Job:
    """One request: its prompt ids and sampling, and where its events go (an asyncio queue of
    the loop that waits for them: TokenEvent*, then DoneEvent or Failure)."""
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    n_cached: int = 0                 # prompt tokens taken from a cached prefix
    head_s: float = 0.0               # time to prefill the first turn apart (see _admit)

    def __post_init__(self):
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if self.events is None:
            self.events = asyncio.Queue()

    def cancel(self) -> None:
        """The client left: the engine drops the sequence at its next step."""
        self.cancelled = True

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:              # the loop is closed: nobody is listening
            self.cancelled = True


@dataclass(eq=False)
class _Cached:
    state: object
    tokens: list[int]
    snaps: list = field(default_factory=list)


@dataclass(eq=False)
class _Seq:
    job: Job
    state: object
    history: list[int]                # ids already in the state when it started
    feed: list[int]                   # prompt ids this sequence prefills
    snaps: list
    gen: object = None
    sampled: list[int] = field(default_factory=list)
    done: bool = False

    def cached_tokens(self) -> list[int]:
        """The ids the state holds now (the last sampled id is never fed)."""
        return (self.history + self.feed + self.sampled)[:self.state.n_past]


class PrefixCache:
    """Recent sequences' States by the tokens they hold, most recent last, at most `size`."""

    def __init__(self, size: int):
        self.size = size
        self.entries: list[_Cached] = []

    def take(self, prompt: list[int]) -> tuple[_Cached | None, int, object]:
        """Remove and return the entry that covers the longest prefix of `prompt` (at least one
        prompt token is left to feed), with that length and the snapshot to restore (None:
        the entry's tokens are all a prefix)."""
        best, best_n, best_snap = None, 0, None
        limit = len(prompt) - 1
        for e in self.entries:
            n, m = 0, min(limit, len(e.tokens))
            while n < m and e.tokens[n] == prompt[n]:
                n += 1
            if n == len(e.tokens):
                use, snap = n, None
            else:
                snaps = [s for s in e.snaps if s.n_past <= n]
                use, snap = (snaps[-1].n_past, snaps[-1]) if snaps else (0, None)
            if use > best_n:
                best, best_n, best_snap = e, use, snap
        if best is not None:
            self.entries.remove(best)
        return best, best_n, best_snap

    def put(self, entry: _Cached) -> _Cached | None:
        """Add an entry; returns the one pushed out, if any."""
        self.entries.append(entry)
        return self.entries.pop(0) if len(self.entries) > self.size else None

    def pop_oldest(self) -> _Cached | None:
        return self.entries.pop(0) if self.entries else None


class Engine:
    """The queue, the engine thread and its sequences. `generate_fn` (moe_offload.generate by
    default) can be replaced by a scripted stream in tests; `metrics` (server.metrics.Metrics)
    gets each finished sequence and the runtime's stats()."""

    def __init__(self, model, tokenizer, n_ctx: int, *, parallel: int = 4, queue_size: int = 64,
                 prefix_cache: int = 4, generate_fn: Callable = generate, metrics=None):
        self.model, self.tokenizer, self.n_ctx = model, tokenizer, n_ctx
        self.generate_fn, self.metrics = generate_fn, metrics
        self.queue_size = queue_size
        first = model.new_state(1, n_ctx)
        # the offload runtime hands out the same State each time: one sequence at a time
        self.single_state = model.new_state(1, n_ctx) is first
        self.parallel = 1 if self.single_state else parallel
        self.cache = PrefixCache(min(prefix_cache, 1) if self.single_state else prefix_cache)
        self._max_states = 1 if self.single_state else self.parallel + self.cache.size
        self._free = [first]
        self._n_states = 1
        self._pending: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.n_active = 0
        self.prefilled_tokens = 0      # prompt tokens fed to the model
        self.reused_tokens = 0         # prompt tokens a cached prefix saved
        self.stats_fn = getattr(model, "stats", None)
        if metrics is not None:
            metrics.gauges = self.gauges

    # -- the request side (any thread) -----------------------------------------------------------
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
                "parallel": (self.parallel, "Sequences that can be active at once.")}

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        ring: deque[_Seq] = deque()
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
            if not ring:
                continue
            seq = ring.popleft()
            if seq.job.cancelled or not self._step(seq):
                self._retire(seq)
            else:
                ring.append(seq)
            self.n_active = len(ring)

    def _admit(self, job: Job) -> _Seq | None:
        if job.cancelled:
            return None
        try:
            entry, n, snap = self.cache.take(job.prompt) if self.cache.size else (None, 0, None)
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
            cut = self._first_turn_end(job.prompt)
            if len(history) < cut:
                # prefill the first turn (a system prompt, the tools) on its own and keep a
                # rewind point there: other conversations that open the same way reuse it
                head = job.prompt[len(history):cut]
                t0 = time.perf_counter()
                self.model.prefill(torch.tensor([head], device=self.model.device), state)
                job.head_s = time.perf_counter() - t0
                self.prefilled_tokens += len(head)
                snaps = (snaps + [state.snapshot()])[-MAX_SNAPSHOTS:]
                history = job.prompt[:cut]
            seq = _Seq(job, state, history, job.prompt[len(history):], snaps)
            seq.gen = self.generate_fn(self.model, state, seq.feed, job.params,
                                       tokenizer=self.tokenizer, history=history)
            self.prefilled_tokens += len(seq.feed)
            return seq
        except Exception as e:   # noqa: BLE001 -- reported to the request, the engine goes on
            job.put(Failure(_message(e)))
            return None

    def _first_turn_end(self, prompt: list[int]) -> int:
        """Just after the first end-of-turn id of a prompt that has another turn after that
        one's end (a system turn before the user's); 0 when there is none."""
        if not self.cache.size or self.tokenizer is None:
            return 0
        eot = self.tokenizer.eog_ids
        ends = [i + 1 for i, t in enumerate(prompt) if t in eot]
        return ends[0] if len(ends) >= 2 else 0

    def _step(self, seq: _Seq) -> bool:
        """Advance one sequence by one event; False when it is finished."""
        try:
            ev = next(seq.gen)
        except StopIteration:
            seq.done = True
            return False
        except Exception as e:   # noqa: BLE001
            seq.job.put(Failure(_message(e)))
            seq.done, seq.state = True, self._broken(seq.state)
            return False
        if isinstance(ev, TokenEvent):
            if not seq.sampled and seq.state.n_past:
                seq.snaps = (seq.snaps + [seq.state.snapshot()])[-MAX_SNAPSHOTS:]
            seq.sampled.append(ev.token)
            seq.job.put(ev)
            return True
        seq.done = True
        if isinstance(ev, DoneEvent):
            if self.metrics is not None:
                t = ev.timings
                self.metrics.finished(len(seq.job.prompt), seq.job.n_cached, len(ev.tokens),
                                      seq.job.head_s + t.ttft_s, t.decode_tps)
        seq.job.put(ev)
        return False

    def _retire(self, seq: _Seq) -> None:
        if not seq.done and seq.gen is not None:
            seq.gen.close()
        if seq.state is None:
            pass
        elif self.cache.size and seq.state.n_past:
            out = self.cache.put(_Cached(seq.state, seq.cached_tokens(), seq.snaps))
            if out is not None:
                self._free.append(out.state)
        else:
            self._free.append(seq.state)
        self._read_stats()

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

    def _read_stats(self) -> None:
        if self.stats_fn is None or self.metrics is None:
            return
        try:
            from .metrics import runtime_gauges
            s = self.stats_fn()
            self.metrics.set_runtime(runtime_gauges(s.as_dict() if hasattr(s, "as_dict") else s))
        except Exception:   # noqa: BLE001 -- statistics must never take the server down
            pass


def _message(e: BaseException) -> str:
    if isinstance(e, OffloadError):
        return str(e)
    return f"generation failed: {type(e).__name__}: {e}"[:500]
