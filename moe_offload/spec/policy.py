"""Speculative decoding's bookkeeping: what it did (SpecStats) and how many tokens to draft
each step (DraftPolicy), as plain arithmetic over measured step costs and judged drafts; its
numbers are config.DraftSettings."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import DRAFT, DraftSettings
from ..errors import OffloadError


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
    """How many tokens to draft: `fixed` (0..k_max), or None for adaptive.

    Adaptive: acceptance a per draft (geometric model: a draft is judged only when the ones
    before it were kept): the mean of the drafts judged so far, with a0 counted as `a0_weight`
    of them, until an EMA of weight `accept_ema` weighs more (slow on purpose: near break-even
    a fast one dips below it by chance, and back on plain steps only the spaced probes could
    raise it again). The k chosen has the most expected tokens, (1 - a^(k+1)) / (1 - a), per
    unit of its measured cost; drafting must be expected to gain at least `min_gain` over plain
    decoding, since the estimates carry a few per cent of noise.

    Before a k has been measured its cost is guessed from k = 0's as (1 + prior_slope * k) plus
    k draft calls at prior_draft each -- optimistic, so it gets tried and measured; an
    unmeasured k above a measured one is guessed from it. While k = 0 wins, a k = 1 probe now
    and then keeps the acceptance current: `probe_every` steps after the last draft at first; a
    refused probe doubles the gap (up to `probe_max`), a kept one halves it. A probe counts as
    refused where no k would pay even if every draft were kept (a CPU, where a draft step costs
    more than two plain ones), so those probes thin out too.

    A cost is the median of its first `warm` samples (plain decoding is measured `warm` times
    before anything else), then moves by the median of each `fold` further samples, weighted
    as if it had been sampled every step since it last moved (`ema` a step, at most
    `stale_weight`): a k measured rarely follows its samples as fast as one measured every
    step, and no single odd step moves it.

    While drafting wins, the costs it is compared with are re-measured after plain_every / 4,
    / 2, then every plain_every drafted steps (early estimates come from a cold cache and new
    graphs' first replays): plain decoding over `remeasure_steps` steps -- on a GPU only plain
    steps queued behind the last and queueing the next count (the first pays the queue's
    refill, the last starts its clock with its work half done) -- and then the k next to the
    chosen one whose cost moved longest ago, over `fold` steps.
    """

    def __init__(self, fixed: int | None = None, settings: DraftSettings = DRAFT, **changes):
        """fixed: 0..k_max drafts every step, or None for adaptive; `changes`: DraftSettings
        fields to change (k_max, ema, ...)."""
        s = replace(settings, **changes)
        if fixed is not None and not 0 <= fixed <= s.k_max:
            raise OffloadError(f"--draft {fixed}: draft 0..{s.k_max} tokens a step, or auto")
        self.fixed, self.k_max, self.ema, self.accept_ema = fixed, s.k_max, s.ema, s.accept_ema
        self.a, self.min_gain = s.a0, s.min_gain
        self._judged = s.a0_weight    # drafts judged so far, a0 counted as a0_weight of them
        self.cost: dict[int, float] = {}
        self.warm, self._samples = s.warm, {}         # k -> its first `warm` costs
        self.fold, self._pending = s.fold, {}         # k -> samples since its cost last moved
        self.stale_weight, self._steps, self._moved_at = s.stale_weight, 0, {}
        self.plain_every, self._since_plain = s.plain_every, 0
        self._remeasured = 0     # re-measures of plain decoding done
        self.remeasure_steps, self._remeasure = s.remeasure_steps, 0   # plain steps left to re-measure
        self._neighbour_due, self._neighbour = False, (0, 0)   # (k, steps left) re-measured now
        self.prior_slope, self.prior_draft = s.prior_slope, s.prior_draft
        self.probe_every, self.probe_max, self._since_draft = s.probe_every, s.probe_max, 0
        self._probe_gap, self._probing = s.probe_every, False

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
