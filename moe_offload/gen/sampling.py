"""Sampling: the parameters, their allowed ranges (one table the CLI checks with), and the
sampler that turns logits into token ids."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's order: penalties -> logit bias -> top-k -> top-p -> min-p -> temperature ->
    draw.
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
    logprobs: int | None = None      # each token's log probability and this many likeliest
                                     # (None: off; 0: the token's own only)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (id, added to its logit) after the
                                     # penalties (OpenAI's logit_bias; -100 bans, +100 forces)

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)


GREEDY = SamplingParams(temperature=0.0)
DEFAULTS = SamplingParams()


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# field -> (whether a value is allowed, what to give instead): the ranges the CLI's flags and
# chat's commands check with (the server takes OpenAI's narrower ones: server/validate.py)
SAMPLING_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: _finite(v) and v >= 0, "give a number >= 0 (0 = greedy)"),
    "top_k": (lambda v: v >= 0, "give 0 (off) or more"),
    "top_p": (lambda v: _finite(v) and 0 < v <= 1, "give a number above 0 and at most 1 (1 = off)"),
    "min_p": (lambda v: _finite(v) and 0 <= v <= 1, "give a number from 0 (off) to 1"),
    "repeat_penalty": (lambda v: _finite(v) and v > 0, "give a number above 0 (1 = off)"),
    "presence_penalty": (_finite, "give a finite number (0 = off)"),
    "frequency_penalty": (_finite, "give a finite number (0 = off)"),
    "seed": (lambda v: v is None or 0 <= v < 2**64, "give a whole number from 0 to 2**64 - 1"),
    "max_tokens": (lambda v: v >= 1, "give 1 or more"),
    "logprobs": (lambda v: v is None or 0 <= v <= 20, "give 0 to 20 likeliest tokens"),
}


def sampling_problem(field: str, value) -> str | None:
    """What to give instead of `value` for SamplingParams' `field`, or None if it is allowed."""
    ok, fix = SAMPLING_RULES[field]
    return None if ok(value) else fix


def default_of(field: str):
    """SamplingParams' default for `field` (the CLI's and the server's defaults)."""
    return next(f.default for f in fields(SamplingParams) if f.name == field)


class Sampler:
    """Turns logits [B, V] into token ids [B] on the logits' device (one seeded generator)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.p = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._bias = None                # (ids, values) of logit_bias on the logits' device

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
        """Logits (a float copy) after the repeat, presence and frequency penalties, then the
        logit bias."""
        p, x = self.p, logits.float().clone()
        if recent is not None and recent.numel() and p.penalized:
            seen = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, recent, True)
            pen = torch.where(x > 0, x / p.repeat_penalty, x * p.repeat_penalty) - p.presence_penalty
            x = torch.where(seen, pen, x)
            if p.frequency_penalty:
                counts = torch.zeros_like(x).scatter_add_(-1, recent, torch.ones_like(recent, dtype=x.dtype))
                x = x - p.frequency_penalty * counts
        if p.logit_bias:
            if self._bias is None or self._bias[0].device != x.device:
                ids, vals = zip(*p.logit_bias)
                self._bias = (torch.tensor(ids, dtype=torch.int64, device=x.device),
                              torch.tensor(vals, dtype=x.dtype, device=x.device))
            ids, vals = self._bias
            x[..., ids] += vals
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


def recent_ids(context: list[int], p: SamplingParams, dev) -> torch.Tensor | None:
    """The context ids the penalties look at [1, n] on `dev`, or None when they are off."""
    if p.penalty_last_n <= 0 or not p.penalized:
        return None
    return torch.tensor([context[-p.penalty_last_n:]], dtype=torch.int64, device=dev)
