"""One request's token stream, driven from outside: the engine's batched mode computes every
running sequence's logits in one shared step and hands each its row. `TokenStream` does the
rest of what generate() does for one sequence -- its own seeded Sampler, the penalties over its
own context, end-of-generation ids, stop strings, max_tokens, a full context, the text and the
timings -- with generate()'s own helpers and in its order, so a request streams the same tokens
batched or alone (given the same logits)."""
from __future__ import annotations

import time

import torch

from moe_offload import DoneEvent, Sampler, SamplingParams, Timings, TokenEvent
# generate()'s stop scanner, penalty window and text decoder: one definition of those rules
from moe_offload.gen.generate import _recent, _stream_decoder, _StopScanner


class TokenStream:
    """prefilled(n, s) after each chunk of the prompt; push(logits [1, V], n_free) after the
    prompt and after each step that fed `pending` -> the events to send (TokenEvent, and a
    DoneEvent once it ends); or draw(logits) on the device, then take(id, n_free) once the id
    is on the host (the engine queues the next step in between). `pending` is the id to feed
    next, None before the first sample and once done."""

    def __init__(self, params: SamplingParams, device, tokenizer, context: list[int],
                 n_prompt: int):
        self.p = params
        self.device = device
        self.sample = Sampler(params, device)
        self.eog = frozenset(tokenizer.eog_ids if tokenizer is not None else ())
        self.text = _stream_decoder(tokenizer)
        self.stops = _StopScanner(params.stop)
        self.context = list(context)     # prompt ids (with the cached history), then the reply
        self.out: list[int] = []
        self.pending: int | None = None
        self.done = False
        self.n_prompt = n_prompt
        self.t0: float | None = None     # the first prefill chunk began
        self.prompt_s = 0.0
        self.t_first = 0.0
        self.timings = Timings(n_prompt)

    def prefilled(self, n_tokens: int, seconds: float) -> None:
        """A chunk of the prompt went in (`seconds` of this sequence's own prefill)."""
        if self.t0 is None:
            self.t0 = time.perf_counter() - seconds
        self.prompt_s += seconds

    def push(self, logits: torch.Tensor, n_free: int) -> list:
        """Sample from this sequence's logits [1, V]; n_free = context positions left."""
        return self.take(int(self.draw(logits)), n_free)

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """The next id sampled from logits [1, V], left on their device (take() it after)."""
        return self.sample(logits, _recent(self.context, self.p, self.device))

    def may_run_ahead(self, n_free: int) -> bool:
        """Whether the step after the id just drawn can be queued before the host reads that id
        (generate()'s rule): only an end-of-generation id could end this sequence there -- no
        stop strings, and max_tokens and the context leave room for one more."""
        return not self.p.stop and len(self.out) + 2 <= self.p.max_tokens and n_free >= 1

    def take(self, tok: int, n_free: int) -> list:
        """The id drawn, read on the host -> the events to send; n_free = context positions left."""
        p = self.p
        now = time.perf_counter()
        if not self.out:
            self.t_first = now
            self.timings = Timings(self.n_prompt, self.prompt_s, 0, 0.0, now - (self.t0 or now))
        else:   # decode time: wall time since the first token, as the client sees the stream
            self.timings = Timings(self.n_prompt, self.prompt_s, len(self.out),
                                   now - self.t_first, self.timings.ttft_s)
        self.out.append(tok)
        self.context.append(tok)
        self.pending = None
        if tok in self.eog and not p.ignore_eog:
            return [self._done("eog")]
        text, stopped = self.stops.push(self.text(tok))
        ev = TokenEvent(tok, text, self.timings)
        if stopped:
            return [ev, self._done("stop")]
        if len(self.out) >= p.max_tokens:
            return [ev, self._done("length")]
        if n_free < 1:
            return [ev, self._done("context")]
        self.pending = tok
        return [ev]

    def _done(self, reason: str) -> DoneEvent:
        self.done = True
        tail = ""
        if reason != "stop":
            tail, stopped = self.stops.push(self.text(None))
            tail += "" if stopped else self.stops.flush()
        return DoneEvent(reason, tail, tuple(self.out), self.timings)
