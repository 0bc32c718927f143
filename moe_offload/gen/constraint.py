"""Constrained decoding: what the next token may be, as a mask over the vocabulary.

A TokenStream given a constraint asks it, before each draw, for the ids allowed next (a packed
bitmask: bit i of word j allows id 32 j + i, the layout llguidance and xgrammar write) and
tells it each id taken. The stream computes the next mask as soon as it takes an id: on a GPU
that is while the step queued ahead on that id runs, so the mask costs the device nothing; on
the CPU it is simply computed before the next draw. generate() and the server's batched step
drive the same stream, so both honour a constraint the same way.

GrammarConstraint is the one we ship (TriggeredConstraint wakes one up where the reply begins
a tool call, so a call the model chooses to make parses too): llguidance (a maintained Rust library; it measured
fastest on our byte-level BPE vocabulary, docs/BENCHMARKS.md "Agents") compiles a grammar --
a JSON schema, or a Lark grammar with JSON schemas inside -- against the tokenizer and computes
each mask. It is optional: `pip install 'ftpatch[structured]'`.
"""
from __future__ import annotations

import threading
import weakref
from typing import Protocol

import numpy as np
import torch

from ..errors import OffloadError

EXTRA = "pip install 'ftpatch[structured]'"


class TokenConstraint(Protocol):
    def allowed(self) -> torch.Tensor | None:
        """The ids allowed next: a packed int32 bitmask [ceil(V / 32)] on the CPU, or None
        where any id may follow (the stream then applies no mask)."""

    def advance(self, token: int) -> None:
        """`token` was taken (raises OffloadError when the constraint did not allow it)."""


class ConstraintUnavailable(OffloadError):
    """The constrained-decoding library is not installed."""


# what a refused id's logit becomes: finite, so the stream's screen for NaN/Inf (a broken weight)
# does not take a mask for one, and low enough that no sampler keeps it (exp underflows to 0)
REFUSED = -1e30


def apply_mask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with REFUSED where the packed bitmask `words` [ceil(n/32)] (on the CPU) has
    a 0 bit, and past its n ids; a new tensor, on the logits' device. On the CPU the bits are
    unpacked by numpy (torch's integer shifts over a 250K vocabulary took 30 ms there); on a
    GPU the words go up (a few KiB) and are unpacked there."""
    V = logits.shape[-1]
    n = min(V, words.numel() * 32)
    out = logits.clone()
    if logits.device.type == "cpu":
        keep = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:n]
        refused = torch.from_numpy(keep == 0)
    else:
        w = words.to(logits.device, non_blocking=True)
        bits = (w.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1
        refused = bits.reshape(-1)[:n] == 0
    out[..., :n].masked_fill_(refused, REFUSED)
    if n < V:
        out[..., n:] = REFUSED
    return out


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ConstraintUnavailable("structured output (response_format, forced tool calls) "
                                    f"needs the llguidance package: {EXTRA}") from None
    return llguidance


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer):
    """llguidance's view of our tokenizer (its tokens' bytes, end-of-generation ids, special
    tokens), built once per tokenizer (about half a second for a 150K vocabulary). Control
    tokens and the template's tags (<tool_call>, <think>: Tokenizer.markup_texts) are special
    to it, as llguidance's own llama.cpp bridge marks them: a grammar names one as
    <tool_call> (the single token the model was trained to write), while the same text in
    quotes is spelled in ordinary pieces. Its masks cover the tokenizer's ids; logits wider
    than that (a padded head) are refused past them (apply_mask)."""
    ll = _llguidance()
    with _LOCK:
        cached = _TOKENIZERS.get(tokenizer)
        if cached is not None:
            return cached
        special = sorted(i for i in (tokenizer.token_id(t) for t in
                                     tokenizer.control_texts | tokenizer.markup_texts)
                         if i is not None)
        marked = set(special)

        class _View:
            eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(
                tokenizer.eog_ids)
            bos_token_id = tokenizer.bos_id
            # llguidance's mark of a special token: its bytes behind 0xff (never UTF-8)
            tokens = [(b"\xff" if i in marked else b"") + tokenizer.token_bytes(i)
                      for i in range(len(tokenizer))]
            special_token_ids = special

            def __call__(self, s):
                if isinstance(s, (bytes, bytearray)):
                    s = bytes(s).decode("utf-8", "surrogateescape")
                return tokenizer.encode(s)
        lt = ll.LLTokenizer(ll.TokenizerWrapper(_View()), eos_token=sorted(tokenizer.eog_ids))
        _TOKENIZERS[tokenizer] = lt
        return lt


def check_grammar(grammar: str, tokenizer) -> str | None:
    """Why llguidance refuses `grammar` for this tokenizer (one line), or None."""
    ll = _llguidance()
    err = ll.LLMatcher.validate_grammar(grammar, grammar_tokenizer(tokenizer))
    if err and not err.startswith("WARNING"):
        return err.strip().splitlines()[0][:300]
    return None


class GrammarConstraint:
    """A grammar (llguidance's: `LLMatcher.grammar_from_json_schema(...)`, a Lark grammar) over
    `tokenizer`'s ids; n_vocab: the logits' width (ids past the tokenizer's are refused)."""

    def __init__(self, grammar: str, tokenizer, n_vocab: int | None = None):
        ll = _llguidance()
        self.n_vocab = n_vocab or len(tokenizer)
        lt = grammar_tokenizer(tokenizer)
        self.matcher = ll.LLMatcher(lt, grammar, log_level=0)
        if self.matcher.is_error():
            raise OffloadError(f"the grammar does not compile: {self.matcher.get_error()}")
        self._words = torch.zeros((lt.vocab_size + 31) // 32, dtype=torch.int32)
        self._np = self._words.numpy()

    def allowed(self) -> torch.Tensor:
        m = self.matcher
        m.unsafe_compute_mask_ptr(self._np.ctypes.data, self._np.nbytes)
        if m.is_error():
            raise OffloadError(f"constrained decoding failed: {m.get_error()}")
        return self._words.clone()

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise OffloadError(f"constrained decoding: token {token} is not allowed here "
                               f"({self.matcher.get_error()})")

    @property
    def finished(self) -> bool:
        """The grammar is complete (only an end-of-generation id may follow)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()


def allowed_ids(words: torch.Tensor, n_vocab: int) -> np.ndarray:
    """The ids a packed bitmask allows (tests, debugging)."""
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:n_vocab]
    return np.flatnonzero(bits)


class TriggeredConstraint:
    """No mask until the reply takes one of `trigger_ids` (a tool call's opening token); from
    the id after it, the grammar `start()` returns, until that grammar is complete (the call
    closed); then free again, and the next trigger starts a fresh grammar. A lazy grammar: a
    reply that chooses to call a tool is held to the call's form, one that does not is not
    masked at all (no mask goes up to the device while free). Between a `pause_ids` id and a
    `resume_ids` one (a reasoning block; `paused`: the prompt opened one) triggers do not
    count: a reply may think about a call in any form."""

    def __init__(self, trigger_ids, start, pause_ids=(), resume_ids=(), paused: bool = False):
        self.trigger_ids = frozenset(int(i) for i in trigger_ids)
        self.pause_ids = frozenset(int(i) for i in pause_ids)
        self.resume_ids = frozenset(int(i) for i in resume_ids)
        self.start = start               # () -> a GrammarConstraint for what follows a trigger
        self.paused = paused
        self.inner = None
        self.triggered = 0               # grammars started (calls begun)

    def allowed(self) -> torch.Tensor | None:
        return None if self.inner is None else self.inner.allowed()

    def advance(self, token: int) -> None:
        token = int(token)
        if self.inner is not None:
            self.inner.advance(token)
            if self.inner.finished:
                self.inner = None
        elif self.paused:
            self.paused = token not in self.resume_ids
        elif token in self.pause_ids:
            self.paused = True
        elif token in self.trigger_ids:
            self.inner = self.start()
            self.triggered += 1

    @property
    def finished(self) -> bool:
        """Nothing is pending: no call is open (an end-of-generation id may come)."""
        return self.inner is None
