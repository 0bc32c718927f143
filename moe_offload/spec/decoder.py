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

Phase timing (`phases=True`, or FTPATCH_SPEC_PHASES=1): the device is synchronised between the
phases of a step (draft, verify of T tokens, accept, rewind; and "mtp_rows" when plain steps'
owed rows are written to the MTP head) and their wall times are kept in `SpecStats.phases`.
Off by default: the syncs cost the overlap of the host with the device.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from ..errors import OffloadError
from ..gen.readback import TokenReadback
from ..models.mtp import greedy_drafts
from ..state import State

K_MAX = 3            # drafts a step at most (a verify step of 4 positions)
MTP_BACKLOG = 64     # trunk hidden states the MTP head may owe before they are written
BACKLOG_CHUNK = 8    # owed rows written a call: up to here a GPU runs the head's experts with the
                     # pool kernels, as one captured graph on the runtime (runtime.mtp_rows; a call
                     # on more takes the prompt path, which dequantizes each expert its rows use:
                     # ~9 ms for 63 rows on the 35B-A3B), the CPU in one native call
PHASES_ENV = "FTPATCH_SPEC_PHASES"   # "1": time the phases of every step (synchronising)


@dataclass
class SpecStats:
    """What speculative decoding did since the decoder was made (or reset)."""

    steps: int = 0            # decode steps (verify forwards), k = 0 included
    drafted: int = 0          # draft tokens proposed
    accepted: int = 0         # of which the trunk kept
    tokens: int = 0           # tokens the steps produced (accepted drafts + one a step)
    by_k: dict = field(default_factory=dict)   # k -> steps taken with k drafts
    by_accepted: dict = field(default_factory=dict)   # (k, drafts accepted) -> steps
    phases: dict = field(default_factory=dict)   # phase -> [seconds, steps] (phase timing on)
    uncounted: int = 0        # steps whose cost the policy did not see (a capture, a first k)

    def add_phase(self, name: str, seconds: float) -> None:
        acc = self.phases.setdefault(name, [0.0, 0])
        acc[0] += seconds
        acc[1] += 1

    def phases_ms(self) -> dict:
        """phase -> {"ms": mean per step it ran in, "n": steps}, in the order of a step."""
        order = {"draft": 0, "verify": 1, "accept": 2, "rewind": 3, "mtp": 4}
        names = sorted(self.phases, key=lambda n: (order.get(n.split("_")[0], 9), n))
        return {n: {"ms": round(self.phases[n][0] / self.phases[n][1] * 1e3, 3),
                    "n": self.phases[n][1]} for n in names}

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def judged_acceptance(self) -> float:
        """Drafts kept / drafts judged, a draft being judged when every one before it in its step
        was kept: the per-draft rate of the geometric model (DraftPolicy's a). It equals
        `acceptance` at k = 1; with k drafts `acceptance` is (a + ... + a^k) / k of it."""
        judged = sum(min(k, acc + 1) * n for (k, acc), n in self.by_accepted.items())
        return self.accepted / judged if judged else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "tokens": self.tokens, "acceptance": round(self.acceptance, 4),
                "judged_acceptance": round(self.judged_acceptance, 4),
                "tokens_per_step": round(self.tokens_per_step, 3),
                "by_k": {str(k): n for k, n in sorted(self.by_k.items())},
                "uncounted_steps": self.uncounted,
                **({"phases_ms": self.phases_ms()} if self.phases else {})}

    def summary(self) -> str:
        return (f"speculative: {self.acceptance:.0%} of {self.drafted} drafts accepted, "
                f"{self.tokens_per_step:.2f} tokens a step")


class DraftPolicy:
    """How many tokens to draft: `fixed` (0..K_MAX), or None for adaptive.

    Adaptive: acceptance a per draft (geometric model: a draft is judged only when the ones
    before it were kept): the mean of the drafts judged so far, with a0 counted as `a0_weight`
    of them, until an EMA of weight `accept_ema` weighs more; cost of a step with k drafts
    measured (wall time by k, below). The acceptance's EMA is slow on purpose: near break-even a
    fast one dips below it by chance, and back on plain steps only the spaced probes can raise
    it again, so the policy would stay plain where drafting gains (docs/BENCHMARKS.md, MTP);
    the mean first, so that the first probes, not a0, decide whether drafting starts.

    The k chosen has the most expected tokens, (1 - a^(k+1)) / (1 - a), per unit of its cost;
    drafting must be expected to gain at least `min_gain` over plain decoding, since the
    estimates carry a few per cent of noise and where drafting breaks even (the 35B-A3B under
    model routing: a k = 1 step costs 1.78 plain ones at acceptance 0.78) every chance swing
    towards it drafted at a loss.

    Before a k has been measured its cost is guessed from k = 0's as (1 + prior_slope * k) plus
    k draft calls at prior_draft each -- optimistic, so it gets tried and measured; an
    unmeasured k above a measured one is guessed from it. While k = 0 wins, one k = 1 step now
    and then keeps the acceptance current: `probe_every` steps after the last draft at first; a
    refused probe doubles the gap (up to `probe_max`), a kept one halves it, so a head that
    rarely agrees costs a few probes a thousand steps instead of one every 16, and one that
    starts agreeing is probed often again. A probe counts as refused where no k would pay even
    if every draft were kept (the CPU: a k = 1 step costs 2.3 plain ones), so its probes, kept
    or not, thin out too (they cost 3% there at one in 16).

    A cost is the median of its first `warm` samples (plain decoding is measured `warm` times
    before anything else), then moves by the median of each `fold` further samples, weighted
    as if it had been sampled every step since it last moved (`ema` a step, at most
    `stale_weight`). So a k measured rarely follows its samples as fast as one measured every
    step (with a plain step every 64 and a fixed 0.1, two thirds of a cold start's error stayed
    after 256 steps, and `auto` drafted at 0.28 acceptance for a 23% loss in the trace regime),
    and no single step moves it (seen on the H200: a plain step of 0.35 ms against 6.5 when
    its queue had drained early, one of 15.9 beside a capture; each moved the old estimate by
    half).

    While drafting wins, the costs it is compared with are re-measured after plain_every / 4,
    / 2, then every plain_every drafted steps (early estimates come from a cold cache and from
    new graphs' first replays: k = 1's first steps took 14 ms against 11.5 later): plain
    decoding over `remeasure_steps` steps -- on a GPU plain steps are queued behind each other,
    and the decoder counts only those queued behind the last that queued the next (the first
    after a drafted step pays the queue's refill, the last starts its clock with its work half
    done: 4.16 ms against 4.56 steady), so five give three samples -- and then the k next to
    the chosen one whose cost moved longest ago, over `fold` steps.
    """

    def __init__(self, fixed: int | None = None, k_max: int = K_MAX, *, ema: float = 0.1,
                 accept_ema: float = 0.03, a0: float = 0.6, a0_weight: int = 8,
                 prior_slope: float = 0.25, prior_draft: float = 0.05, probe_every: int = 16,
                 probe_max: int = 256, warm: int = 4, fold: int = 3, plain_every: int = 64,
                 stale_weight: float = 0.5, remeasure_steps: int = 5, min_gain: float = 0.02):
        if fixed is not None and not 0 <= fixed <= k_max:
            raise OffloadError(f"--draft {fixed}: draft 0..{k_max} tokens a step, or auto")
        self.fixed, self.k_max, self.ema, self.accept_ema = fixed, k_max, ema, accept_ema
        self.a, self.min_gain = a0, min_gain
        self._judged = a0_weight      # drafts judged so far, a0 counted as a0_weight of them
        self.cost: dict[int, float] = {}
        self.warm, self._samples = warm, {}           # k -> its first `warm` costs
        self.fold, self._pending = fold, {}           # k -> samples since its cost last moved
        self.stale_weight, self._steps, self._moved_at = stale_weight, 0, {}
        self.plain_every, self._since_plain = plain_every, 0
        self._remeasured = 0     # re-measures of plain decoding done
        self.remeasure_steps, self._remeasure = remeasure_steps, 0   # plain steps left to re-measure
        self._neighbour_due, self._neighbour = False, (0, 0)   # (k, steps left) re-measured now
        self.prior_slope, self.prior_draft = prior_slope, prior_draft
        self.probe_every, self.probe_max, self._since_draft = probe_every, probe_max, 0
        self._probe_gap, self._probing = probe_every, False

    @property
    def max_k(self) -> int:
        return self.k_max if self.fixed is None else self.fixed

    def expected_tokens(self, k: int) -> float:
        a = min(self.a, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def step_cost(self, k: int) -> float:
        if k in self.cost:
            return self.cost[k]
        base = self.cost.get(0)
        if base is None:
            return 1 + (self.prior_slope + self.prior_draft) * k   # relative to plain decode
        guess = base * (1 + (self.prior_slope + self.prior_draft) * k)
        below = max((j for j in self.cost if 0 < j < k), default=0)
        if below:   # half the measured cost of a draft for each further one: still optimistic
            guess = max(guess, self.cost[below] + (k - below) * (self.cost[below] - base) / below / 2)
        return guess

    def _pays(self, tokens: float, cost: float) -> bool:
        """Whether a step giving `tokens` for `cost` gains at least min_gain over plain decoding."""
        return tokens / cost >= (1 + self.min_gain) / self.step_cost(0)

    def _best(self) -> int:
        """The k with the most expected tokens per unit of step cost; plain decoding unless
        drafting is expected to gain at least min_gain over it."""
        k = max(range(1, self.k_max + 1), key=lambda k: self.expected_tokens(k) / self.step_cost(k),
                default=0)
        return k if k and self._pays(self.expected_tokens(k), self.step_cost(k)) else 0

    def _could_pay(self) -> bool:
        """Whether a k measured so far would gain min_gain over plain decoding if every draft
        were kept (the guesses of unmeasured ones are optimistic on purpose: not these)."""
        drafted = [k for k in self.cost if k]
        return not drafted or any(self._pays(k + 1, self.cost[k]) for k in drafted)

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if len(self._samples.get(0, ())) < self.warm or self._remeasure:
            return 0                       # measure plain decode first, or again
        if self._neighbour[1]:
            return self._neighbour[0]
        best = self._best()
        self._probing = False
        if best:
            self._probe_gap = self.probe_every      # drafting pays: probe often again later
            if self._neighbour_due:                 # after plain decoding, a k beside the best
                self._neighbour_due = False
                near = [j for j in (best - 1, best + 1) if 1 <= j <= self.k_max]
                if near:
                    j = min(near, key=lambda j: self._moved_at.get(j, -1))
                    self._neighbour = (j, self.fold)
                    return j
            if self._since_plain >= self._plain_gap():   # re-measure what it is compared with
                best, self._remeasure, self._neighbour_due = 0, self.remeasure_steps, True
        elif self._since_draft >= self._probe_gap:
            best, self._probing = 1, True
        return best

    def _plain_gap(self) -> int:
        """Drafted steps between plain re-measures: a quarter of plain_every, a half, then
        plain_every, so an early estimate (steps of a cold cache) is checked soon."""
        return self.plain_every >> max(0, 2 - self._remeasured)

    def plain_next(self) -> bool:
        """Whether the step after the current plain one (k = 0, not yet observed) is surely
        plain as well: drafting does not pay and no probe falls due. A pipelined plain step is
        queued on this (SpeculativeDecoder.step)."""
        if self.fixed is not None:
            return self.fixed == 0
        if len(self._samples.get(0, ())) < self.warm or self._remeasure > 1:
            return True                    # plain decoding is still being measured
        if 0 not in self.cost:
            return False
        return self._best() == 0 and self._since_draft + 1 < self._probe_gap

    def observe(self, k: int, accepted: int, seconds: float | None) -> None:
        """A step with k drafts kept `accepted` of them and took `seconds` (None: a time that
        says nothing of the next steps, e.g. it included a graph capture; not counted)."""
        self._since_draft = 0 if k else self._since_draft + 1
        self._since_plain = self._since_plain + 1 if k else 0
        if self._remeasure and not k:
            self._remeasure -= 1
            self._remeasured += not self._remeasure
        if self._neighbour[1] and k == self._neighbour[0]:
            self._neighbour = (k, self._neighbour[1] - 1)
        self._steps += 1
        if self._probing:   # a refused probe spaces the next ones out, a kept one brings them in
            refused = accepted == 0 or not self._could_pay()
            gap = self._probe_gap * 2 if refused else self._probe_gap // 2
            self._probe_gap = min(max(gap, self.probe_every), self.probe_max)
            self._probing = False
        if seconds is not None:
            self._sample(k, seconds)
        judged = min(k, accepted + 1)      # drafts after the first refusal were not judged
        for i in range(judged):
            self._judged += 1
            w = max(self.accept_ema, 1 / self._judged)   # the mean until the EMA weighs more
            self.a += w * ((1.0 if i < accepted else 0.0) - self.a)

    def _sample(self, k: int, seconds: float) -> None:
        """One counted step of k drafts: the median of the first `warm`, then of each `fold`,
        weighted by the steps since k's cost last moved."""
        first = self._samples.setdefault(k, [])
        if len(first) < self.warm:
            first.append(seconds)
            self.cost[k] = sorted(first)[len(first) // 2]
            self._moved_at[k] = self._steps
            return
        pending = self._pending.setdefault(k, [])
        pending.append(seconds)
        if len(pending) < self.fold:
            return
        gap = self._steps - self._moved_at[k]
        w = min(1 - (1 - self.ema) ** gap, max(1 - (1 - self.ema) ** self.fold, self.stale_weight))
        self.cost[k] += w * (sorted(pending)[len(pending) // 2] - self.cost[k])
        pending.clear()
        self._moved_at[k] = self._steps


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

    model: the trunk (Qwen35Moe or OffloadRuntime): forward(tokens, state, hidden=True) or
    verify(tokens, state) -> (logits [1, T, V], hidden [1, T, H]), prefill(..., hidden=True).
    mtp: an MtpHead (or the runtime's) with forward(hidden, tokens, state, logits=...).
    draft: tokens a step (0..K_MAX) or "auto"."""

    def __init__(self, model, mtp, draft: int | str = "auto", *, policy: DraftPolicy | None = None,
                 phases: bool | None = None, pipeline: bool | None = None):
        if mtp is None:
            raise OffloadError("this model has no MTP block (nextn_predict_layers = 0): "
                               "speculative decoding needs one; use --draft 0")
        self.model, self.mtp = model, mtp
        self.policy = policy or DraftPolicy(None if draft == "auto" else int(draft))
        self.stats = SpecStats()
        self.ids: list[int] = []     # ids[p] = the token at position p (and t_n at n_past)
        self._last = 0               # tokens the last step returned (for truncate)
        self.device = torch.device(model.device)
        self.phases = os.environ.get(PHASES_ENV, "") not in ("", "0") if phases is None else phases
        self._timed_k: set[int] = set()   # k whose first step (lazy init) is behind us
        self._t = 0.0
        # plain greedy steps queue the next one before the host reads the token (generate()'s
        # pipelining, for k = 0): on a GPU by default; `pipeline` forces it (tests on the CPU)
        self.pipeline = self.device.type == "cuda" if pipeline is None else pipeline
        self._ahead = None                # (logits, hidden) of the plain step queued last
        self._drafted: _Drafted | None = None   # the next step's drafts, queued by the last step
        self._chosen: int | None = None   # the next step's k, chosen by the last step
        self._readback = TokenReadback(self.device)

    def _lap(self, name: str | None = None) -> None:
        """Phase timing: synchronise, and book the time since the last lap to `name`."""
        if not self.phases:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if name is not None:
            self.stats.add_phase(name, now - self._t)
        self._t = now

    def reset_stats(self) -> None:
        self.stats = SpecStats()

    # -- the prompt -----------------------------------------------------------------------------

    def prefill(self, tokens: torch.Tensor, state: State, chunk: int = 512,
                history: list[int] | None = None) -> torch.Tensor:
        """The prompt tokens [1, T] on top of `state` -> last logits [1, V]; its hidden states
        are owed to the MTP head. history: the ids already in the state (when they are not
        known, the MTP head starts afresh at the prompt and drafts from less context)."""
        if hasattr(self.model, "keep_steps"):       # the runtime makes room under its cap first
            self.model.keep_steps(state, self.policy.max_k)
        else:
            state.keep_steps(self.policy.max_k)
        n0 = state.n_past
        logits, hidden = self.model.prefill(tokens, state, chunk, hidden=True)
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
        self._catch_up(state, chunk)
        self._last = 0
        return logits

    def _catch_up(self, state: State, chunk: int = 512, keep: int = 1) -> None:
        """Write the MTP rows owed (all but the last `keep`, whose token may not be known)."""
        owed = state.mtp_hidden
        if owed is None or owed.shape[0] <= keep:
            return
        n = owed.shape[0] - keep
        rows = getattr(self.model, "mtp_rows", None)   # the runtime: captured, a chunk a replay
        p = state.mtp_past
        # the tokens in one copy, queued (from pageable memory each chunk's copy would wait for
        # the work already queued: a plain step queued ahead, the chunk before)
        ids = self._ids_on_device(self.ids[p + 1:p + 1 + n])[None]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if rows is not None:
                rows(owed[None, s:e], ids[:, s:e], state)
            else:
                self.mtp.forward(owed[None, s:e], ids[:, s:e], state, logits="none")
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
                # rows that plain steps owe the MTP head (up to MTP_BACKLOG): written before this
                # step and its clock, since plain steps already pay for them in their own
                # catch-ups; counted here they would make a probe after plain steps look dearer
                # than drafting is
                self._catch_up(state, BACKLOG_CHUNK)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            captures = getattr(self.model, "captures", 0)
            t0 = time.perf_counter()
        self._lap()
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
            self._lap(f"draft_k{k}")
        logits, hidden = ahead if ahead is not None else self._verify(inp, state)
        self._lap(f"verify_T{k + 1}")
        if (on_device and not k and ahead_ok and self.pipeline and state.n_free >= 1
                and self.policy.plain_next()):
            new, accepted = self._plain_ahead(logits[0], state), 0
        elif on_device:
            new, accepted = self._accept_greedy(logits[0], drafts)
        else:
            new, accepted = self._accept(logits[0], drafts, q, sampler, recent, greedy)
        self._lap("accept")
        _owe(state, hidden[0, :accepted + 1])
        self.ids[n + 1:] = new
        # a step that captured a graph, or the first with this k, says little of the next ones;
        # where plain steps are queued behind each other, a plain one tells plain decoding's
        # cost only in the stream: queued behind the last and queueing the next (the first
        # after a draft pays the refill, the last starts its clock with its work half done)
        steady = not self.pipeline or (ahead is not None and self._ahead is not None)
        counted = (k in self._timed_k and getattr(self.model, "captures", 0) == captures
                   and (k > 0 or steady))
        seconds = time.perf_counter() - t0
        self._record(k, accepted, len(new), seconds if counted else None)
        if on_device and self.pipeline and not self.phases and self._ahead is None:
            self._draft_ahead(state, tok=new[-1], n_free=state.n_free + k - accepted)
        state.rewind(k - accepted)
        self._lap("rewind")
        owed = state.mtp_hidden
        if owed is not None and owed.shape[0] > MTP_BACKLOG:
            # plain steps: keep the MTP head in step, off the step's clock (a step in 64 would
            # carry the other 63's rows, and one such sample moves the plain cost's EMA for long)
            self._catch_up(state, BACKLOG_CHUNK)
            self._lap("mtp_rows")
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
        captures = getattr(self.model, "captures", 0)
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
        verify = getattr(self.model, "verify", None)
        if verify is not None:
            return verify(inp, state)
        return self.model.forward(inp, state, hidden=True)

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
        draft = getattr(self.model, "draft", None)
        if draft is not None:
            return draft(hidden, toks, state, k)
        return greedy_drafts(self.mtp, hidden, toks, state, k)

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
