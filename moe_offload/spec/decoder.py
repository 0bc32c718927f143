"""Speculative decoding with the model's own MTP head (models/mtp.py), one sequence.

A step, with n tokens in the cache and t_n sampled but not yet fed:
  draft    the MTP head on the trunk's hidden states it has not seen yet (the last one is
           h_{n-1}, paired with t_n) -> d_1; then chained on its own output -> d_2 .. d_k
  verify   ONE trunk forward of [t_n, d_1 .. d_k] (k+1 positions; logits and hidden states at
           each), the delta-net state kept after every position (State.keep_steps)
  accept   greedy: the longest prefix of drafts equal to the trunk's choice, then the trunk's
           own next token; sampling: d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)),
           the first refusal draws from norm(max(0, p_i - q_i)), and when all k are kept one
           more token is drawn from p_{k+1} (Leviathan et al. / Chen et al.: the output has the
           target's distribution whatever the draft's)
  rewind   KV rows past the kept positions are garbage (the position counter moves back); the
           delta-net conv/ssm state goes back to the copy kept after the last accepted position
           (State.rewind): no recomputation
The trunk's hidden states of the kept positions become the MTP head's next input, so its KV
stays in step with the trunk's (State.mtp_past, State.mtp_hidden).

Greedy output equals plain greedy decoding token for token (up to floating-point ties: a verify
step's matmuls see k+1 rows where decode sees one); sampling has plain sampling's distribution.
Penalties see the drafted tokens as context, as they would have been.

`DraftPolicy` picks k each step: fixed, or (auto) the k in 0..k_max that maximises the expected
tokens a step, (1 - a^(k+1)) / (1 - a) for an acceptance rate a, over the step's measured cost
(the verify forward of k+1 positions and k draft calls, by k); 0 is plain decoding, unless
drafting is expected to gain at least 2% (its docstring says how each estimate moves). A
step that captured a CUDA graph (the runtime's `captures` counter moved), and the first step of
each k (lazy initialisation), do not count towards the cost: a capture costs 10-100x a step.

Greedy drafting without penalties stays on the device: the draft ids are argmaxes left in a
device tensor, fed to the next draft call and into the verify input, and read back once with the
trunk's choices after the verify step (one host sync a step, not one per draft and per check).

Plain steps (k = 0: auto while drafting does not pay) are pipelined as generate() pipelines
plain decoding: when the next step is surely plain as well (`DraftPolicy.plain_next`) and the
caller wants another token, it is queued on the device's argmax before the host reads that token
back, so the GPU does not wait for the host's turn between steps. When the generation ends, that
queued step's token stays in the cache (`finish`), as with generate()'s own pipelining.

Drafted steps are pipelined too: once a step's tokens are read back, the next step's k is
chosen and its drafts queued on the device before the delta-net rewind and before the tokens go
back to the caller (the draft needs only the MTP head's state and the ids just accepted), so the
GPU drafts while the host rewinds, hands the tokens out and comes back to queue the verify step.
A draft queued so and not used (the generation ended, or stopped inside the step) is dropped:
the MTP head's count and owed rows go back to what they were before it (`_drop_queued`).

Phase timing (`phases=True`: instrument.phases.SyncedPhases): the device is synchronised
between the phases of a step (draft, verify of T tokens, accept, rewind; and "mtp_rows" when
plain steps' owed rows are written to the MTP head) and their wall times are kept in
`SpecStats.phases`. Off by default: the syncs cost the overlap of the host with the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..backend import as_backend
from ..config import DRAFT, PREFILL
from ..errors import OffloadError
from ..gen.readback import TokenReadback
from ..instrument.phases import Phases, SyncedPhases
from ..state import State
from .policy import DraftPolicy, SpecStats


@dataclass
class _Drafted:
    """The next step's drafts, queued at the end of the step before (SpeculativeDecoder.step)."""
    state: State
    k: int
    drafts: torch.Tensor              # [k] ids on the device
    tok: int                          # the t_n they follow
    t0: float                         # the next step's clock starts here: before queueing them
    captures: int                     # the runtime's graph captures then
    mtp_past: int                     # the MTP head's count and owed rows before them
    mtp_hidden: torch.Tensor | None


def _owe(state: State, hidden: torch.Tensor) -> None:
    """The trunk's final hidden states of positions now in the cache [n, H]: owed to the MTP head
    (written by its next call) after those already owed."""
    owed = state.mtp_hidden
    state.mtp_hidden = hidden if owed is None else torch.cat((owed, hidden))


class SpeculativeDecoder:
    """Drafts with an MTP head and verifies with the trunk (module docstring). One sequence.

    model: a Backend with an MTP head (the runtime opened with mtp=True, or open_backend(...,
    mtp=True)), or a bare model with `mtp` its head (wrapped by backend.as_backend).
    draft: tokens a step (0..k_max) or "auto"."""

    def __init__(self, model, mtp=None, draft: int | str = "auto", *,
                 policy: DraftPolicy | None = None, phases: bool = False,
                 pipeline: bool | None = None):
        self.backend = be = as_backend(model, mtp)
        self.mtp = mtp if mtp is not None else be.mtp
        if self.mtp is None:
            raise OffloadError("this model has no MTP block (nextn_predict_layers = 0): "
                               "speculative decoding needs one; use --draft 0")
        self.policy = policy or DraftPolicy(None if draft == "auto" else int(draft))
        self.stats = SpecStats()
        self.ids: list[int] = []     # ids[p] = the token at position p (and t_n at n_past)
        self._last = 0               # tokens the last step returned (for truncate)
        self.device = be.device
        self.phases = SyncedPhases(self.device, self._book) if phases else Phases()
        self._timed_k: set[int] = set()   # k whose first step (lazy init) is behind us
        # plain greedy steps queue the next one before the host reads the token (generate()'s
        # pipelining, for k = 0): on a GPU by default; `pipeline` forces it (tests on the CPU)
        self.pipeline = self.device.type == "cuda" if pipeline is None else pipeline
        self._ahead = None                # (logits, hidden) of the plain step queued last
        self._drafted: _Drafted | None = None   # the next step's drafts, queued by the last step
        self._chosen: int | None = None   # the next step's k, chosen by the last step
        self._readback = TokenReadback(self.device)

    def _book(self, name: str, seconds: float) -> None:
        self.stats.add_phase(name, seconds)

    def reset_stats(self) -> None:
        self.stats = SpecStats()

    # -- the prompt -----------------------------------------------------------------------------

    def prefill(self, tokens: torch.Tensor, state: State, chunk: int | None = None,
                history: list[int] | None = None) -> torch.Tensor:
        """The prompt tokens [1, T] on top of `state` -> last logits [1, V]; its hidden states
        are owed to the MTP head. history: the ids already in the state (when they are not
        known, the MTP head starts afresh at the prompt and drafts from less context)."""
        self.backend.keep_steps(state, self.policy.max_k)   # (the runtime makes room first)
        n0 = state.n_past
        logits, hidden = self.backend.prefill(tokens, state, chunk, hidden=True)
        if history is not None and len(history) == n0:
            self.ids = list(history) + tokens[0].tolist()
        else:
            self.ids = [0] * n0 + tokens[0].tolist()
            state.mtp_past, state.mtp_hidden = n0, None
        owed = state.mtp_hidden
        if owed is not None and state.mtp_past + owed.shape[0] == n0:
            state.mtp_hidden = torch.cat((owed, hidden[0]))
        else:
            state.mtp_past, state.mtp_hidden = n0, hidden[0]
        self._catch_up(state, chunk or PREFILL.default_chunk)
        self._last = 0
        return logits

    def _catch_up(self, state: State, chunk: int = 512, keep: int = 1) -> None:
        """Write the MTP rows owed (all but the last `keep`, whose token may not be known)."""
        owed = state.mtp_hidden
        if owed is None or owed.shape[0] <= keep:
            return
        n = owed.shape[0] - keep
        p = state.mtp_past
        # the tokens in one copy, queued (from pageable memory each chunk's copy would wait for
        # the work already queued: a plain step queued ahead, the chunk before)
        ids = self._ids_on_device(self.ids[p + 1:p + 1 + n])[None]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            self.backend.mtp_rows(owed[None, s:e], ids[:, s:e], state)
        state.mtp_hidden = owed[n:]

    # -- a step ------------------------------------------------------------------------------

    def step(self, state: State, tok: int, sampler, recent, *, ahead_ok: bool = False) -> list[int]:
        """Feed t_n = tok (sampled, not yet in the cache) and return the next tokens: the
        accepted drafts and one more (>= 1 token). sampler: generate.Sampler; recent(extra ids)
        -> the penalties' context [1, n] or None. ahead_ok: the caller will want a token after
        this step's (no stop strings, max_tokens not reached), so a plain greedy step may feed
        its token before the host reads it (the cache then holds it too: `finish`)."""
        ahead, self._ahead = self._ahead, None
        n = state.n_past - (ahead is not None)   # a queued step fed tok already
        d = self._drafted
        if d is not None and (d.state is not state or d.tok != tok or len(self.ids) != n + 1):
            self._drop_queued()                  # (not the step it was drafted for)
        drafted, self._drafted = self._drafted, None
        chosen, self._chosen = self._chosen, None
        if len(self.ids) == n:
            self.ids.append(tok)
        else:
            self.ids[n:] = [tok]
        if drafted is not None:
            k, captures, t0 = drafted.k, drafted.captures, drafted.t0
        else:
            k = 0 if ahead is not None else min(self.policy.choose() if chosen is None else chosen,
                                                state.n_free - 1)
            if k < 0:
                raise OffloadError("the context is full")
            if k and state.mtp_hidden is not None and state.mtp_hidden.shape[0] > k + 1:
                # rows that plain steps owe the MTP head (up to DRAFT.backlog): written before this
                # step and its clock, since plain steps already pay for them in their own
                # catch-ups; counted here they would make a probe after plain steps look dearer
                # than drafting is
                self._catch_up(state, DRAFT.backlog_chunk)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            captures = self.backend.captures
            t0 = time.perf_counter()
        self.phases.lap()
        greedy = sampler.p.temperature <= 0
        # greedy without penalties: drafts and checks stay on the device until one read-back
        on_device = greedy and recent([]) is None
        tok_t = None if ahead is not None else self._ids_on_device([tok])
        if not k:   # (a queued step fed tok already: no input)
            drafts, q = (torch.empty(0, dtype=torch.int64, device=self.device) if on_device
                         else []), []
            inp = None if tok_t is None else tok_t[None]
        elif on_device:
            drafts, q = drafted.drafts if drafted is not None else self._draft_device(state, k), []
            inp = torch.cat((tok_t, drafts))[None]
        else:
            drafts, q = self._draft(state, k, sampler, recent, greedy)
            inp = torch.tensor([[tok] + drafts], device=self.device)
        if k:
            self.phases.lap(f"draft_k{k}")
        logits, hidden = ahead if ahead is not None else self._verify(inp, state)
        self.phases.lap(f"verify_T{k + 1}")
        if (on_device and not k and ahead_ok and self.pipeline and state.n_free >= 1
                and self.policy.plain_next()):
            new, accepted = self._plain_ahead(logits[0], state), 0
        elif on_device:
            new, accepted = self._accept_greedy(logits[0], drafts)
        else:
            new, accepted = self._accept(logits[0], drafts, q, sampler, recent, greedy)
        self.phases.lap("accept")
        _owe(state, hidden[0, :accepted + 1])
        self.ids[n + 1:] = new
        # a step that captured a graph, or the first with this k, says little of the next ones;
        # where plain steps are queued behind each other, a plain one tells plain decoding's
        # cost only in the stream: queued behind the last and queueing the next (the first
        # after a draft pays the refill, the last starts its clock with its work half done)
        steady = not self.pipeline or (ahead is not None and self._ahead is not None)
        counted = (k in self._timed_k and self.backend.captures == captures
                   and (k > 0 or steady))
        seconds = time.perf_counter() - t0
        self._record(k, accepted, len(new), seconds if counted else None)
        if on_device and self.pipeline and not self.phases.syncs and self._ahead is None:
            self._draft_ahead(state, tok=new[-1], n_free=state.n_free + k - accepted)
        state.rewind(k - accepted)
        self.phases.lap("rewind")
        owed = state.mtp_hidden
        if owed is not None and owed.shape[0] > DRAFT.backlog:
            # plain steps: keep the MTP head in step, off the step's clock (a step in 64 would
            # carry the other 63's rows, and one such sample moves the plain cost's EMA for long)
            self._catch_up(state, DRAFT.backlog_chunk)
            self.phases.lap("mtp_rows")
        self._last = len(new)
        return new

    def _record(self, k: int, accepted: int, tokens: int, seconds: float | None) -> None:
        """A step's figures to the statistics and the policy (seconds: None when not counted)."""
        st = self.stats
        self._timed_k.add(k)
        st.uncounted += seconds is None
        self.policy.observe(k, accepted, seconds)
        st.steps += 1
        st.drafted += k
        st.accepted += accepted
        st.tokens += tokens
        st.by_k[k] = st.by_k.get(k, 0) + 1
        st.by_accepted[k, accepted] = st.by_accepted.get((k, accepted), 0) + 1

    def _draft_ahead(self, state: State, tok: int, n_free: int) -> None:
        """The next step's k, chosen now, and where it drafts, its drafts queued now, after
        `tok` (that step's t_n, its id already in self.ids): the device drafts while the host
        finishes this step. n_free: the context left once this step's rewind is done."""
        if n_free < 2:
            return
        t0 = time.perf_counter()   # the next step's clock: the queueing is its work
        captures = self.backend.captures
        k = self._chosen = min(self.policy.choose(), n_free - 1)
        owed = state.mtp_hidden
        if not k or owed is None or owed.shape[0] > k + 1:   # (a backlog: written first, then)
            return
        self._chosen = None
        past = state.mtp_past
        drafts = self._draft_device(state, k)
        self._drafted = _Drafted(state, k, drafts, tok, t0, captures, past, owed)

    def _drop_queued(self) -> None:
        """Forget what the last step queued for a next step that does not come: its k, and its
        drafts, with the MTP head's count and owed rows as they were before them (the KV rows
        they wrote lie past its count: provisional)."""
        d, self._drafted, self._chosen = self._drafted, None, None
        if d is not None:
            d.state.mtp_past, d.state.mtp_hidden = d.mtp_past, d.mtp_hidden

    def _plain_ahead(self, logits: torch.Tensor, state: State) -> list[int]:
        """A plain greedy step's token, with the next plain step queued on it before the host
        reads it back (the device never waits for the host's turn)."""
        nxt = logits[-1].argmax(-1, keepdim=True)
        tok, self._ahead = self._readback(nxt, lambda: self._verify(nxt[None], state))
        return [tok]

    def finish(self, state: State) -> None:
        """The generation ended: a plain step queued on the last token stays in the cache (its
        token was fed), and its hidden state is owed to the MTP head like any other."""
        self._drop_queued()
        if self._ahead is None:
            return
        hidden = self._ahead[1]
        self._ahead = None
        _owe(state, hidden[0, :1])

    def truncate(self, state: State, used: int) -> None:
        """Only the first `used` tokens of the last step's return were taken (a stop condition,
        or the consumer left): the cache keeps what precedes the last one taken."""
        self._drop_queued()                # (queued after the last token, which goes)
        drop = self._last - used
        if drop <= 0:
            return
        state.rewind(drop)
        state.mtp_hidden = state.mtp_hidden[:state.mtp_hidden.shape[0] - drop]
        del self.ids[len(self.ids) - drop:]
        self._last = used
        self.stats.tokens -= drop

    def _verify(self, inp: torch.Tensor, state: State):
        return self.backend.verify(inp, state)

    def _take_owed(self, state: State) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk's hidden states the MTP head is owed [1, T, H] and the tokens that follow
        them [1, T]; the State owes nothing after (the caller writes them)."""
        owed, p = state.mtp_hidden, state.mtp_past
        state.mtp_hidden = None
        return owed[None], self._ids_on_device(self.ids[p + 1:p + 1 + owed.shape[0]])[None]

    def _ids_on_device(self, ids: list[int]) -> torch.Tensor:
        """ids [n] on the device, queued without waiting: a copy from pageable memory first
        waits for the work already queued (the last step's rewind), with the GPU idle meanwhile."""
        t = torch.tensor(ids, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _first_draft(self, state: State):
        """The MTP head on the trunk's hidden states it is owed -> (its last logits, its normed
        states, the MTP KV length: rows past it are the drafts' provisional ones)."""
        lg, g = self.mtp.forward(*self._take_owed(state), state, logits="last")
        return lg, g, state.mtp_past

    def _draft_device(self, state: State, k: int) -> torch.Tensor:
        """k greedy draft ids [k] on the device (no host sync: each argmax feeds the next call;
        the runtime runs them as one captured graph)."""
        hidden, toks = self._take_owed(state)
        return self.backend.draft(hidden, toks, state, k)

    def _accept_greedy(self, logits: torch.Tensor, drafts: torch.Tensor) -> tuple[list[int], int]:
        """logits [k+1, V], drafts [k] on the device -> (new tokens, drafts accepted), the
        trunk's choices and the drafts read back together (the step's one host sync)."""
        k = drafts.shape[0]
        both = torch.cat((logits.argmax(-1), drafts)).tolist()
        choice, d = both[:k + 1], both[k + 1:]
        accepted = next((i for i in range(k) if choice[i] != d[i]), k)
        return d[:accepted] + [choice[accepted]], accepted

    def _draft(self, state: State, k: int, sampler, recent, greedy: bool):
        """k draft tokens (and, sampling, the distributions q_i they were drawn from)."""
        lg, g, base = self._first_draft(state)
        drafts, qs = [], []
        for i in range(k):
            if i:
                lg, g = self.mtp.forward(g[:, -1:], torch.tensor([[drafts[-1]]], device=self.device),
                                         state, logits="last")
            ctx = recent(drafts)
            if greedy:
                d = int(sampler.filtered(lg[:, -1], ctx).argmax(-1))
            else:
                qi = sampler.probs(lg[:, -1], ctx)[0]
                d = int(torch.multinomial(qi, 1, generator=sampler.generator))
                qs.append(qi)
            drafts.append(d)
        state.mtp_past = base
        return drafts, qs

    def _accept(self, logits: torch.Tensor, drafts: list[int], q: list, sampler, recent,
                greedy: bool) -> tuple[list[int], int]:
        """logits [k+1, V] of the verify step -> (new tokens, drafts accepted)."""
        out: list[int] = []
        for i, d in enumerate(drafts):
            ctx = recent(drafts[:i])
            if greedy:
                t = int(sampler.filtered(logits[i:i + 1], ctx).argmax(-1))
                if t != d:
                    return out + [t], i
                out.append(d)
                continue
            p = sampler.probs(logits[i:i + 1], ctx)[0]
            r = float(torch.rand((), generator=sampler.generator, device=p.device))
            if r * float(q[i][d]) < float(p[d]):          # r < p/q without dividing by q = 0
                out.append(d)
                continue
            resid = (p - q[i]).clamp(min=0)
            if float(resid.sum()) <= 0:                 # p == q up to rounding: draw from p
                resid = p
            t = int(torch.multinomial(resid / resid.sum(), 1, generator=sampler.generator))
            return out + [t], i
        ctx = recent(drafts)
        out.append(int(sampler(logits[len(drafts):len(drafts) + 1], ctx)))
        return out, len(drafts)
