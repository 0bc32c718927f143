"""generate(): one sequence's token stream driven by a model (or a backend).

The loop is: prefill the prompt -> sample -> (decode one token -> sample)* until an
end-of-generation id, a stop string, max_tokens or a full context (the rules are the
TokenStream's, stream.py). `generate` yields a `TokenEvent` per sampled token and one
`DoneEvent` at the end.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator, Sequence

import torch

from ..errors import OffloadError
from ..state import State
from .readback import TokenReadback
from .sampling import GREEDY, SamplingParams
from .stream import DoneEvent, TokenEvent, TokenStream


def generate(model, state: State, prompt: Sequence[int], params: SamplingParams = GREEDY, *,
             tokenizer=None, eog_ids: Iterable[int] | None = None, history: Sequence[int] = (),
             prefill_chunk: int | None = None, draft=None, constraint=None
             ) -> Iterator[TokenEvent | DoneEvent]:
    """Stream tokens after `prompt` (fed on top of what `state` holds; `history` = the ids
    already in it, for the penalties). eog_ids default to the tokenizer's. draft (a
    spec.SpeculativeDecoder): decode speculatively with the model's MTP head (a step may give
    several tokens). The cache holds every token yielded but the last -- or, on a GPU, all of
    them when the caller leaves early or the last is an end-of-generation id (the next step was
    queued already): state.n_past tells. constraint (constraint.TokenConstraint): only ids it
    allows are drawn (not with a draft: its steps draw several ids from one verify).
    prefill_chunk: tokens a prompt chunk (None: the model's own; under a cap the fewest chunks
    the reserved workspace holds, since every chunk streams the cold experts once)."""
    if not len(prompt):
        raise OffloadError("the prompt is empty; give at least one token")
    if state.batch != 1:
        raise OffloadError("generate() streams one sequence; use a state of batch 1")
    if draft is not None and (constraint is not None or params.logprobs is not None):
        raise OffloadError("speculative decoding (a draft) takes no constraint and reports no "
                           "logprobs; decode without the draft for those")
    state.check_room(len(prompt))
    dev = model.device
    stream = TokenStream(params, dev, tokenizer, list(history) + list(prompt), len(prompt),
                         eog_ids=eog_ids, constraint=constraint)

    t0 = time.perf_counter()
    prompt_t = torch.tensor([list(prompt)], device=dev)
    if draft is None:
        logits = model.prefill(prompt_t, state,
                               **({} if prefill_chunk is None else {"chunk": prefill_chunk}))
    else:
        n_hist = state.n_past
        logits = draft.prefill(prompt_t, state, prefill_chunk,
                               list(history) if len(history) == n_hist else None)
    tok = int(stream.draw(logits))
    stream.prefilled(len(prompt), time.perf_counter() - t0)
    decode_s = 0.0
    queue: list[int] = []   # tokens of a speculative step not yet taken
    taken = 0               # tokens of that step taken so far
    ahead = None            # logits of the step already queued behind the last token
    pipelined = draft is None and dev.type == "cuda"
    readback = TokenReadback(dev) if pipelined else None
    try:
        while True:
            # the room to feed tok: none needed where it is in the cache already (a step queued
            # ahead fed it, or it is not the last token of a speculative step)
            events = stream.take(tok, state.n_free + (ahead is not None or bool(queue)))
            taken += 1
            yield from (e for e in events if isinstance(e, TokenEvent))
            if stream.done:
                break
            if queue:
                tok = queue.pop(0)
                continue
            out = stream.out
            t = time.perf_counter()
            if draft is None:
                logits = ahead if ahead is not None else model.decode(
                    torch.tensor([tok], device=dev), state)
                tok_dev = stream.draw(logits)
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
                new = draft.step(state, tok, stream.sample, stream.recent,
                                 ahead_ok=not params.stop and len(out) + 1 < params.max_tokens)
                tok, queue, taken = new[0], new[1:], 0
            decode_s += time.perf_counter() - t
            stream.stepped(len(out) + len(queue), decode_s)
    finally:   # stopped (or left) inside a speculative step: the cache forgets what follows
        if draft is not None and queue:
            draft.truncate(state, taken)
        if draft is not None:
            draft.finish(state)
    yield events[-1]
