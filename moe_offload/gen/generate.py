"""Generation: sampling, the token stream with its timings, and a chat `Session`.

The loop is: prefill the prompt -> sample -> (decode one token -> sample)* until an
end-of-generation id, a stop string, max_tokens or a full context. `generate` yields a
`TokenEvent` per sampled token and one `DoneEvent` at the end. Batch size 1.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch

from ..errors import OffloadError
from .readback import TokenReadback
from ..spec.decoder import DraftPolicy, SpecStats, SpeculativeDecoder
from ..state import State


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's order: penalties -> top-k -> top-p -> min-p -> temperature -> draw.
    temperature <= 0 is greedy (argmax after penalties). 0 / 1.0 disable k, p and min-p."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0      # CTRL-style: positive logits / rp, negative * rp
    presence_penalty: float = 0.0    # subtracted once from every token seen
    frequency_penalty: float = 0.0   # subtracted once per occurrence of a token seen (OpenAI's)
    penalty_last_n: int = 64         # how many recent context tokens the penalties look at
    seed: int | None = None          # None: a fresh random seed
    max_tokens: int = 256
    stop: tuple[str, ...] = ()       # stop strings (the text before one is kept)
    ignore_eog: bool = False         # keep going past end-of-generation ids


GREEDY = SamplingParams(temperature=0.0)


class Sampler:
    """Turns logits [B, V] into token ids [B] on the logits' device (one seeded generator)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.p = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, recent: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, V]; recent [B, n] context ids the penalties see (or None)."""
        if self.p.temperature <= 0:
            return self.penalized(logits, recent).argmax(-1)
        if 0 < self.p.top_k < logits.shape[-1]:
            probs, ids = self.candidates(logits, recent)
            return ids.gather(-1, torch.multinomial(probs, 1, generator=self.generator))[:, 0]
        return torch.multinomial(self.probs(logits, recent), 1, generator=self.generator)[:, 0]

    def candidates(self, logits: torch.Tensor, recent: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """With top-k (temperature > 0): the draw's distribution over the k best ids only,
        (probs [B, k], ids [B, k]) -- the same as probs() over the vocabulary, but the other
        filters sort k values instead of the whole vocabulary. Logits tied with the k-th are
        cut to k by index (probs() keeps every tie)."""
        vals, ids = self.penalized(logits, recent).topk(self.p.top_k, dim=-1)
        return torch.softmax(self.nucleus(vals) / self.p.temperature, -1), ids

    def probs(self, logits: torch.Tensor, recent: torch.Tensor | None = None) -> torch.Tensor:
        """The distribution a draw is made from [B, V] (temperature > 0): speculative sampling
        compares the target's and the draft's."""
        return torch.softmax(self.filtered(logits, recent) / self.p.temperature, -1)

    def filtered(self, logits: torch.Tensor, recent: torch.Tensor | None = None) -> torch.Tensor:
        """Logits after penalties and (temperature > 0) top-k, top-p, min-p: -inf where cut."""
        x = self.penalized(logits, recent)
        if self.p.temperature <= 0:
            return x
        k = self.p.top_k
        if 0 < k < x.shape[-1]:
            x = x.masked_fill(x < x.topk(k, dim=-1).values[..., -1:], float("-inf"))
        return self.nucleus(x)

    def penalized(self, logits: torch.Tensor, recent: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (a float copy) after the repeat, presence and frequency penalties."""
        p, x = self.p, logits.float().clone()
        if recent is not None and recent.numel() and _penalized(p):
            seen = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, recent, True)
            pen = torch.where(x > 0, x / p.repeat_penalty, x * p.repeat_penalty) - p.presence_penalty
            x = torch.where(seen, pen, x)
            if p.frequency_penalty:
                counts = torch.zeros_like(x).scatter_add_(-1, recent, torch.ones_like(recent, dtype=x.dtype))
                x = x - p.frequency_penalty * counts
        return x

    def nucleus(self, x: torch.Tensor) -> torch.Tensor:
        """top-p, then min-p, on logits x [B, N] (probabilities at temperature 1): -inf where cut."""
        p = self.p
        if p.top_p < 1.0:
            probs, order = torch.softmax(x, -1).sort(dim=-1, descending=True)
            drop = (probs.cumsum(-1) - probs) >= p.top_p   # mass before this token already >= p
            drop[..., 0] = False
            x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        if p.min_p > 0.0:
            probs = torch.softmax(x, -1)
            x = x.masked_fill(probs < p.min_p * probs.amax(-1, keepdim=True), float("-inf"))
        return x


# ---- events -----------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class DoneEvent:
    reason: str        # "eog" | "stop" | "length" (max_tokens) | "context" (context full)
    text: str          # text held back until the end (flushed), '' if none
    tokens: tuple[int, ...]   # every generated id (the eog id included)
    timings: Timings


class _StopScanner:
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


# ---- the loop -----------------------------------------------------------------------------------

def generate(model, state: State, prompt: Sequence[int], params: SamplingParams = GREEDY, *,
             tokenizer=None, eog_ids: Iterable[int] | None = None, history: Sequence[int] = (),
             prefill_chunk: int = 512, draft: SpeculativeDecoder | None = None
             ) -> Iterator[TokenEvent | DoneEvent]:
    """Stream tokens after `prompt` (fed on top of what `state` holds; `history` = the ids
    already in it, for the penalties). eog_ids default to the tokenizer's. draft: decode
    speculatively with the model's MTP head (a step may give several tokens). The cache holds
    every token yielded but the last -- or, on a GPU, all of them when the caller leaves early
    or the last is an end-of-generation id (the next step was queued already): state.n_past
    tells."""
    if not len(prompt):
        raise OffloadError("the prompt is empty; give at least one token")
    if state.batch != 1:
        raise OffloadError("generate() streams one sequence; use a state of batch 1")
    state.check_room(len(prompt))
    dev = model.device
    eog = frozenset(eog_ids if eog_ids is not None else
                    (tokenizer.eog_ids if tokenizer is not None else ()))
    stream = _stream_decoder(tokenizer)
    stops = _StopScanner(params.stop)
    sample = Sampler(params, dev)
    context = list(history) + list(prompt)
    out: list[int] = []

    t0 = time.perf_counter()
    prompt_t = torch.tensor([list(prompt)], device=dev)
    if draft is None:
        logits = model.prefill(prompt_t, state, chunk=prefill_chunk)
    else:
        n_hist = state.n_past
        logits = draft.prefill(prompt_t, state, prefill_chunk,
                               list(history) if len(history) == n_hist else None)
    tok = int(sample(logits, _recent(context, params, dev)))
    t_first = time.perf_counter()
    timings = Timings(len(prompt), t_first - t0, 0, 0.0, t_first - t0)
    decode_s, reason = 0.0, "length"
    queue: list[int] = []   # tokens of a speculative step not yet yielded
    taken = 0               # tokens of that step taken so far
    ahead = None            # logits of the step already queued behind the last token
    pipelined = draft is None and dev.type == "cuda"
    readback = TokenReadback(dev) if pipelined else None
    try:
        while True:
            out.append(tok)
            context.append(tok)
            taken += 1
            if tok in eog and not params.ignore_eog:
                reason = "eog"
                break
            text, stopped = stops.push(stream(tok))
            if stopped:
                yield TokenEvent(tok, text, timings)
                reason = "stop"
                break
            yield TokenEvent(tok, text, timings)
            if len(out) >= params.max_tokens:
                break
            if queue:
                tok = queue.pop(0)
                continue
            if ahead is None and state.n_free < 1:
                reason = "context"
                break
            t = time.perf_counter()
            if draft is None:
                logits = ahead if ahead is not None else model.decode(
                    torch.tensor([tok], device=dev), state)
                tok_dev = sample(logits, _recent(context, params, dev))
                # On a GPU, the step after this token is queued before the host reads it (the
                # token goes from device to device), so the GPU never waits for the host's
                # turn -- whenever only an end-of-generation id could stop here: no stop
                # strings, room and max_tokens left. If it is one, that step was spent for
                # nothing and the cache holds the id (state.n_past says what it holds).
                ahead = None
                if (pipelined and not params.stop and len(out) + 1 < params.max_tokens
                        and state.n_free >= 1):
                    tok, ahead = readback(tok_dev, lambda: model.decode(tok_dev, state))
                else:
                    tok = int(tok_dev)
            else:
                new = draft.step(state, tok, sample,
                                 lambda extra: _recent(context + extra, params, dev),
                                 ahead_ok=not params.stop and len(out) + 1 < params.max_tokens)
                tok, queue, taken = new[0], new[1:], 0
            decode_s += time.perf_counter() - t
            timings = Timings(len(prompt), timings.prompt_s, len(out) + len(queue), decode_s,
                              timings.ttft_s)
    finally:   # stopped (or left) inside a speculative step: the cache forgets what follows
        if draft is not None and queue:
            draft.truncate(state, taken)
        if draft is not None:
            draft.finish(state)
    tail = ""
    if reason != "stop":
        tail, stopped = stops.push(stream(None))
        tail += "" if stopped else stops.flush()
    yield DoneEvent(reason, tail, tuple(out), timings)


def continue_ids(tokens: Sequence[int], cached_text: str | None, text: str,
                 encode: Callable[[str], list[int]]) -> list[int] | None:
    """The ids of `text` on top of a cache that holds `tokens`, whose text is `cached_text`:
    those ids, then encode(the rest of the text) -- when `text` extends `cached_text` with
    something new; else None. A reply's text need not tokenize back into the ids the model
    sampled, so a conversation that goes on keeps its own ids and tokenizes only what is new."""
    if cached_text is None or not tokens or len(text) <= len(cached_text) \
            or not text.startswith(cached_text):
        return None
    return list(tokens) + encode(text[len(cached_text):])


def _penalized(p: SamplingParams) -> bool:
    return p.repeat_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def _recent(context: list[int], p: SamplingParams, dev) -> torch.Tensor | None:
    if p.penalty_last_n <= 0 or not _penalized(p):
        return None
    return torch.tensor([context[-p.penalty_last_n:]], dtype=torch.int64, device=dev)


def _stream_decoder(tokenizer):
    """id -> newly completed text; None -> flush. Without a tokenizer: no text."""
    if tokenizer is None:
        return lambda tok: ""
    from loaders.tokenizer import StreamDecoder
    dec = StreamDecoder(tokenizer)
    return lambda tok: dec.flush() if tok is None else dec.push(tok)


# ---- a chat session -------------------------------------------------------------------------------

@dataclass
class Session:
    """Model + state + tokenizer + chat template. `chat(messages)` renders the whole conversation
    and feeds only what the cache lacks: the longest cached prefix is kept (rewinding to a turn
    snapshot when the new prompt diverges inside the cache)."""

    model: object
    state: State
    tokenizer: object = None
    template: object = None
    tokens: list[int] = field(default_factory=list)      # ids now in the cache, in order
    max_snapshots: int = 4
    draft: SpeculativeDecoder | None = None              # speculative decoding (MTP head)
    text: str | None = None                              # the text `tokens` spell (chat turns)
    _snaps: list = field(default_factory=list, repr=False)

    @classmethod
    def load(cls, path, device: str = "cpu", n_ctx: int | None = None,
             kv_dtype: torch.dtype = torch.float32, experts_device: str | None = None) -> "Session":
        """Open a GGUF, put it on `device`; tokenizer and template when the file has them."""
        from loaders import open_model
        from loaders.chat_template import ChatTemplate
        from loaders.tokenizer import Tokenizer
        from ..models import build_model
        loaded = open_model(path)
        model = build_model(loaded, device, experts_device)
        md = loaded.metadata
        tok = Tokenizer.from_metadata(md, str(path)) if "tokenizer.ggml.tokens" in md else None
        tmpl = ChatTemplate.from_metadata(md, str(path)) if tok is not None else None
        return cls(model, model.new_state(1, n_ctx, kv_dtype), tok, tmpl)

    def reset(self) -> None:
        self.state.reset()
        self.tokens.clear()
        self._snaps.clear()
        self.text = None

    def generate(self, prompt: Sequence[int], params: SamplingParams = GREEDY
                 ) -> Iterator[TokenEvent | DoneEvent]:
        """Continue the cached sequence with `prompt` ids and stream the reply. Stopping early
        (leaving the loop) is fine: the session keeps what the cache holds."""
        start, sampled = len(self.tokens), []
        self.text = None                          # ids without their text (chat() sets it)
        self._snapshot()                          # end of the previous reply
        gen = generate(self.model, self.state, prompt, params, tokenizer=self.tokenizer,
                       history=self.tokens, draft=self.draft)
        try:
            for ev in gen:
                if isinstance(ev, TokenEvent):
                    if not sampled:
                        self._snapshot()          # prompt prefilled, reply not yet fed
                    sampled.append(ev.token)
                yield ev
        finally:                                  # the last sampled id is never fed
            gen.close()                           # (a speculative step gives back the rest)
            self.tokens += (list(prompt) + sampled)[:self.state.n_past - start]

    def complete(self, text: str, params: SamplingParams = GREEDY) -> Iterator[TokenEvent | DoneEvent]:
        """Plain text continuation (special-token text is parsed; BOS added if the model asks)."""
        ids = self._tok().encode(text, add_special=not self.tokens, parse_special=True)
        return self.generate(ids, params)

    def chat(self, messages: Sequence[dict], params: SamplingParams = GREEDY,
             enable_thinking: bool | None = None) -> Iterator[TokenEvent | DoneEvent]:
        """The assistant's reply to the whole conversation `messages` (OpenAI-style list).

        The template is applied to the whole conversation, but when its text extends the text
        the cache holds (the last turn's prompt and reply), the cached ids are kept and only the
        new text is tokenized: a reply's text need not tokenize back into the ids sampled, and
        the next turn should not prefill the conversation again because of that."""
        tok = self._tok()
        text = self.template.render(messages, add_generation_prompt=True,
                                    enable_thinking=enable_thinking, bos_token=tok.bos_token,
                                    eos_token=tok.eos_token)
        encode = lambda t: tok.encode(t, add_special=False, parse_special=True)   # noqa: E731
        ids = continue_ids(self.tokens, self.text, text, encode) or encode(text)
        return self._turn(ids, text, params)

    def _turn(self, ids: list[int], text: str, params: SamplingParams
              ) -> Iterator[TokenEvent | DoneEvent]:
        try:
            yield from self.generate(ids[self._reuse(ids):], params)
        finally:   # the cache holds `ids` (the text) and the reply's ids fed after them
            whole = len(self.tokens) >= len(ids)
            self.text = text + self.tokenizer.decode(self.tokens[len(ids):]) if whole else None

    # -- prefix reuse -----------------------------------------------------------------------

    def _reuse(self, ids: list[int]) -> int:
        """Rewind the cache to the longest usable prefix of ids; returns its length (< len(ids))."""
        n = 0
        limit = min(len(ids) - 1, len(self.tokens))      # always feed >= 1 token
        while n < limit and ids[n] == self.tokens[n]:
            n += 1
        if n == len(self.tokens):
            return n
        snaps = [s for s in self._snaps if s.n_past <= n]
        if not snaps:
            self.reset()
            return 0
        self.state.restore(snaps[-1])
        self._snaps = snaps
        del self.tokens[snaps[-1].n_past:]
        return snaps[-1].n_past

    def _snapshot(self) -> None:
        if self.state.n_past and not (self._snaps and self._snaps[-1].n_past == self.state.n_past):
            self._snaps = (self._snaps + [self.state.snapshot()])[-self.max_snapshots:]

    def _tok(self):
        if self.tokenizer is None:
            raise OffloadError("this model has no tokenizer metadata; pass token ids instead of text")
        return self.tokenizer
