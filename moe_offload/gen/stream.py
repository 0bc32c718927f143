"""The token stream: what happens to each sampled id of one sequence, whoever computes the
logits. generate() drives it for one sequence; the server's batched step drives one per
request from its rows of a shared step. Both get the same rules in the same order: the seeded
sampler and the penalties over the sequence's own context, end-of-generation ids, stop strings
(text held back while it may start one), max_tokens, a full context, the text of each id
(never half a UTF-8 character), the timings; and, when asked, a constraint's mask over the
vocabulary (constraint.py) and each id's log probability (logprobs.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch

from ..errors import NonFiniteLogits
from .constraint import apply_mask
from .logprobs import TokenLogprob, logprob_rows, unpack
from .sampling import Sampler, SamplingParams, recent_ids


@dataclass(frozen=True)
class Timings:
    n_prompt: int = 0
    prompt_s: float = 0.0        # prefill wall time
    n_decode: int = 0            # decode steps (tokens fed after the prompt)
    decode_s: float = 0.0
    ttft_s: float = 0.0          # start -> first token sampled

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.n_decode / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> str:
        return (f"prompt: {self.n_prompt} tokens, {self.prompt_tps:.1f} tok/s | "
                f"decode: {self.n_decode} tokens, {self.decode_tps:.1f} tok/s | "
                f"TTFT {self.ttft_s * 1000:.0f} ms")


@dataclass(frozen=True)
class TokenEvent:
    token: int
    text: str          # text this token completes ('' while UTF-8 or a stop string is pending)
    timings: Timings
    logprob: TokenLogprob | None = None   # with SamplingParams.logprobs set


@dataclass(frozen=True)
class DoneEvent:
    reason: str        # "eog" | "stop" | "length" (max_tokens) | "context" (context full)
    text: str          # text held back until the end (flushed), '' if none
    tokens: tuple[int, ...]   # every generated id (the eog id included)
    timings: Timings


class StopScanner:
    """Holds back text that may be the start of a stop string; cuts at the first full one."""

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = max((k for s in self.stops for k in range(len(s) - 1, 0, -1)
                    if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def screen_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | bool]:
    """(logits a sampler can take, whether all of them are finite). A sum a row tells: NaN and
    Inf survive a sum. On the CPU: a float32 sum, read at once, and only if it is not finite
    (NaN/Inf, or finite values too large to add up) the exact test; the logits are copied only
    when they are bad. On a GPU: a float64 sum (float32 inputs cannot overflow it), the flag left
    on the device, NaN/Inf made 0 (a CUDA sampler would trap on them): nothing waits."""
    if logits.device.type == "cpu":
        ok = bool(torch.isfinite(logits.sum(-1)).all()) or bool(torch.isfinite(logits).all())
        return (logits if ok else logits.nan_to_num(0.0, 0.0, 0.0)), ok
    finite = torch.isfinite(logits.sum(-1, dtype=torch.float64)).all()
    return logits.nan_to_num(0.0, 0.0, 0.0), finite


class ScreenedSampler(Sampler):
    """A stream's sampler: every row it samples from (a plain step's, a speculative step's
    drafts and verify rows: all pass `penalized`) is screened first, and whether any was NaN or
    Inf is kept for the stream's next take(). On a GPU the flag accumulates on the device and
    is copied into pinned memory behind each use, so the host reads it once the drawn ids are
    read back, with no wait of its own."""

    def __init__(self, params: SamplingParams, device):
        super().__init__(params, device)
        self._bad: bool = False
        self._acc: torch.Tensor | None = None      # on a GPU: any row bad so far
        self._host: torch.Tensor | None = None     # ... its pinned copy

    def penalized(self, logits: torch.Tensor, recent: torch.Tensor | None = None) -> torch.Tensor:
        safe, finite = screen_logits(logits)
        if isinstance(finite, bool):
            self._bad = self._bad or not finite
        else:
            if self._acc is None:
                self._acc = torch.zeros((), dtype=torch.bool, device=logits.device)
                self._host = torch.zeros((), dtype=torch.bool, pin_memory=True)
            self._acc.logical_or_(finite.logical_not())
            self._host.copy_(self._acc, non_blocking=True)
        return super().penalized(safe, recent)

    def nonfinite(self) -> bool:
        """Whether a row sampled so far was NaN/Inf (read once its ids were read back)."""
        return self._bad or (self._host is not None and bool(self._host))


def text_decoder(tokenizer):
    """id -> newly completed text; None -> flush. Without a tokenizer: no text."""
    if tokenizer is None:
        return lambda tok: ""
    from loaders.tokenizer import StreamDecoder
    dec = StreamDecoder(tokenizer)
    return lambda tok: dec.flush() if tok is None else dec.push(tok)


_NOT_YET = object()   # a stream's mask not computed yet for its next draw


class TokenStream:
    """One sequence's stream. Its driver calls prefilled(n, s) for the prompt's time, then for
    each id: draw(logits [1, V]) on the device, then take(id, n_free) once the id is on the host
    -> the events to send (TokenEvent, and a DoneEvent once it ends); push() does both. `pending`
    is the id to feed next (None before the first sample and once done); n_free is the room
    left in the context to feed the id taken.

    Decode time runs on the wall clock from the first token, as a client sees the stream, unless
    the driver times its own steps (stepped(): generate() counts only its steps, not the time
    its consumer spends between tokens).

    constraint (constraint.TokenConstraint): each draw takes only ids it allows (no mask at all
    where it allows any); the mask for the next draw is computed as soon as an id is taken
    (take()), so on a GPU it overlaps the step queued ahead. params.logprobs (n): each
    TokenEvent carries the id's log probability and the n likeliest, computed on the device in
    draw() and read with the id."""

    def __init__(self, params: SamplingParams, device, tokenizer, context: list[int],
                 n_prompt: int, eog_ids: Iterable[int] | None = None, constraint=None):
        self.p = params
        self.constraint = constraint
        self._allowed = _NOT_YET         # the constraint's mask for the next draw (None: any id)
        self._lp = None                  # the last draw's logprob row (on the host once read)
        self._pinned = None              # on a GPU: the mask's pinned copy for its upload
        self.device = device
        self.sample = ScreenedSampler(params, device)
        self.eog = frozenset(eog_ids if eog_ids is not None else
                             (tokenizer.eog_ids if tokenizer is not None else ()))
        self.text = text_decoder(tokenizer)
        self.stops = StopScanner(params.stop)
        self.context = list(context)     # prompt ids (with the cached history), then the reply
        self.out: list[int] = []
        self.pending: int | None = None
        self.done = False
        self.n_prompt = n_prompt
        self.t0: float | None = None     # the prompt began
        self.prompt_s = 0.0
        self.t_first = 0.0
        self.timings = Timings(n_prompt)
        self._stepped: tuple[int, float] | None = None   # the driver's (tokens fed, seconds)

    def prefilled(self, n_tokens: int, seconds: float) -> None:
        """A chunk of the prompt went in (`seconds` of this sequence's own prefill)."""
        if self.t0 is None:
            self.t0 = time.perf_counter() - seconds
        self.prompt_s += seconds

    def stepped(self, fed: int, seconds: float) -> None:
        """The driver's own clock: `fed` tokens fed after the prompt so far, in `seconds` of
        decode steps; the ids taken from now on carry these figures."""
        self._stepped = (fed, seconds)

    def recent(self, extra: list[int] = ()) -> torch.Tensor | None:
        """The ids the penalties look at (the context, then `extra`), or None when off."""
        return recent_ids(self.context + list(extra), self.p, self.device)

    def push(self, logits: torch.Tensor, n_free: int) -> list:
        """Sample from this sequence's logits [1, V]; n_free = context positions left."""
        return self.take(int(self.draw(logits)), n_free)

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """The next id sampled from logits [1, V], left on their device (take() it after;
        take() raises NonFiniteLogits if these held NaN or Inf: the sampler screens the model's
        logits, which the constraint's mask leaves finite)."""
        x = logits
        if self.constraint is not None and self._allowed is _NOT_YET:
            self._allowed = self.constraint.allowed()
        words = self._allowed if self.constraint is not None else None
        if words is not None:
            if logits.device.type == "cuda":
                # through pinned memory, so the copy up is queued, not waited for; the last
                # one is done (the host read that draw's id since)
                if self._pinned is None or self._pinned.shape != words.shape:
                    self._pinned = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
                words = self._pinned.copy_(words)
            x = apply_mask(logits, words)
        tok = self.sample(x, self.recent())
        if self.p.logprobs is not None:
            # queued behind the draw; a copy to pinned memory, so reading it with the id
            # waits for nothing queued after (a step run ahead)
            self._lp = logprob_rows(logits, tok, self.p.logprobs).to("cpu", non_blocking=True)
        return tok

    def may_run_ahead(self, n_free: int) -> bool:
        """Whether the step after the id just drawn can be queued before the host reads that id:
        only an end-of-generation id could end this sequence there -- no stop strings, and
        max_tokens and the context leave room for one more."""
        return not self.p.stop and len(self.out) + 2 <= self.p.max_tokens and n_free >= 1

    def take(self, tok: int, n_free: int) -> list:
        """The id drawn, read on the host -> the events to send; n_free = context positions left."""
        if self.sample.nonfinite():   # the logits it came from: no text of it goes out
            self.done = True
            raise NonFiniteLogits(len(self.context) - 1)
        p = self.p
        now = time.perf_counter()
        if not self.out:
            self.t_first = now
            self.timings = Timings(self.n_prompt, self.prompt_s, 0, 0.0, now - (self.t0 or now))
        elif self._stepped is not None:
            self.timings = Timings(self.n_prompt, self.prompt_s, *self._stepped, self.timings.ttft_s)
        else:   # decode time: wall time since the first token, as the client sees the stream
            self.timings = Timings(self.n_prompt, self.prompt_s, len(self.out),
                                   now - self.t_first, self.timings.ttft_s)
        self.out.append(tok)
        self.context.append(tok)
        self.pending = None
        if self.constraint is not None:
            self._allowed = _NOT_YET
            self.constraint.advance(tok)
        lp, self._lp = self._lp, None
        if tok in self.eog and not p.ignore_eog:
            return [self._done("eog")]
        text, stopped = self.stops.push(self.text(tok))
        ev = TokenEvent(tok, text, self.timings,
                        None if lp is None else unpack(lp[0].tolist(), tok, p.logprobs))
        if stopped:
            return [ev, self._done("stop")]
        if len(self.out) >= p.max_tokens:
            return [ev, self._done("length")]
        if n_free < 1:
            return [ev, self._done("context")]
        self.pending = tok
        if self.constraint is not None:   # now: on a GPU the step queued ahead runs meanwhile
            self._allowed = self.constraint.allowed()
        return [ev]

    def _done(self, reason: str) -> DoneEvent:
        self.done = True
        tail = ""
        if reason != "stop":
            tail, stopped = self.stops.push(self.text(None))
            tail += "" if stopped else self.stops.flush()
        return DoneEvent(reason, tail, tuple(self.out), self.timings)
