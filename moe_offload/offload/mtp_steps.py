"""The MTP head's steps under the runtime: k greedy drafts, and the rows it is owed, each as one
captured graph (a draft is some 30 small kernels, which launched one by one from Python cost
several times their GPU time), and the verify step's first layers guessed while it drafts."""
from __future__ import annotations

import contextlib

import torch

from ..errors import OffloadError
from ..state import State
from .graphs import GraphKey
from .model_hooks import ResidentPool


def draft(rt, hidden: torch.Tensor, tokens: torch.Tensor, state: State, k: int) -> torch.Tensor:
    """k greedy draft ids [k] on the device from the MTP head: first on the trunk's hidden
    states it is owed, hidden [1, T, H], with the tokens that follow them [1, T], then k - 1
    times on its own last state and draft. state.mtp_past moves by T (the drafts' KV rows are
    provisional). One captured graph where the head's experts are in VRAM: a draft is some
    30 small kernels, which launched one by one from Python cost several times their GPU time."""
    mtp, T, p = rt._need_mtp(), tokens.shape[1], state.mtp_past
    if p + T + k - 1 > state.n_ctx:
        raise OffloadError(f"the MTP layer's KV holds {state.n_ctx} positions; "
                           f"{p + T + k - 1} needed")
    from ..models.mtp import greedy_drafts
    n_attn = state.rows_attended(p + T + k - 1)
    known = _draft_guesses(rt, k)

    def run(toks, h, at):
        out = greedy_drafts(mtp, h, toks, state, k, at=at, n_attn=n_attn, known=known)
        if known is not None:
            rt.engine.join_draft_guesses()
        return out

    capturable = isinstance(mtp.experts, ResidentPool) and mtp.experts.capturable(T)
    if not (rt.opts.use_graphs and capturable):
        return run(tokens, hidden, None)
    key = GraphKey("draft", (id(state),), T, (n_attn,), (k, known is not None))
    out = _head_graph(rt, key, run, tokens, hidden, state)
    state.mtp_past = p + T
    return out.clone()

def mtp_rows(rt, hidden: torch.Tensor, tokens: torch.Tensor, state: State) -> None:
    """Write the MTP KV rows the head is owed: hidden [1, T, H] (the trunk's final-normed
    states from state.mtp_past on), tokens [1, T] (the tokens after them). One captured
    graph per attended length over max_tok rows: a shorter call pads its rows, and the
    padding's KV rows land past state.mtp_past, where rows are provisional (the next write
    covers them) and no real row attends to them."""
    mtp, T, p = rt._need_mtp(), tokens.shape[1], state.mtp_past
    n = rt.engine.max_tok
    if not (1 <= T <= n and rt.opts.use_graphs and mtp.experts.capturable(n)
            and p + n <= state.n_ctx):
        mtp.forward(hidden, tokens, state, logits="none")
        return
    n_attn = state.rows_attended(p + n)

    def run(toks, h, at):
        return mtp.forward(h, toks, state, logits="none", at=at, n_attn=n_attn)[1]

    if T < n:   # padding: the last row again (any values would do)
        hidden = torch.cat((hidden, hidden[:, -1:].expand(1, n - T, hidden.shape[2])), 1)
        tokens = torch.cat((tokens, tokens[:, -1:].expand(1, n - T)), 1)
    _head_graph(rt, GraphKey("mtp_rows", (id(state),), n, (n_attn,)), run, tokens, hidden, state)
    state.mtp_past = p + T

def _draft_guesses(rt, k: int):
    """known(ids) for greedy_drafts: the verify step's first layers guessed for the tokens
    known while the last draft is computed (policy.draft_guess_layers), or None: off, or
    no guesses at all now (a replayed trace, or the link's share of the misses too low)."""
    n = rt.policy.draft_guess_layers
    if not (n and rt.prefetching):
        return None
    model, eng = rt.model, rt.engine
    return lambda ids: eng.guess_while_drafting(
        ids, lambda: model.embedding_moe_inputs(ids, n), n_verify=k + 1)

def _head_graph(rt, key: GraphKey, run, tokens: torch.Tensor, hidden: torch.Tensor,
                state: State):
    """run(tokens, hidden, at) of the MTP head as a captured graph, at p = state.mtp_past
    (read on the device) -> its output. state.mtp_past is the caller's to move."""
    p = state.mtp_past

    def warm_up(copies):   # it writes the same KV rows the graph will
        try:
            run(*copies)
        finally:
            state.mtp_past = p

    @contextlib.contextmanager
    def keep_count():
        try:
            yield
        finally:
            state.mtp_past = p   # the host count moved while capturing; the caller moves it

    return rt.graphs.replay(key, [tokens, hidden, p], run, warm_up=warm_up, around=keep_count)
