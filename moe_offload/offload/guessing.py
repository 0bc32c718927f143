"""Whether decode steps guess the next layer's experts, and keeping the CPU's measured rate
current (the scheduler's split q depends on it, and guessing on q).

Guesses travel over the link: they pay only with pinned banks and while the link takes at
least policy.prefetch_min_fetch_share of the misses (once guessing, down to that share less
prefetch_hysteresis, so that a rate measured near the line does not flip it back and forth);
always when a number of guesses was asked for (the user's choice). Every policy.observe_every
steps the CPU worker's timings are folded into the scheduler (the plan kernel reads the new
split from device memory: no re-capture), and whether guessing pays is decided again; a change
applies at the next step's start. A captured step holds the guesses' kernels or lacks them, so
steps are keyed by the mode (GraphKey.guesses) and both kept: a rate measured near the line
costs a capture a step once, not at every change."""
from __future__ import annotations

import numpy as np


class Guessing:
    def __init__(self, engine, scheduler, bank, model, config, policy):
        self.engine, self.scheduler, self.bank = engine, scheduler, bank
        self.model, self.config, self.policy = model, config, policy
        self.changes = 0          # times guessing started or stopped after start-up
        self._due = False         # observe() found that guessing should start or stop
        self._steps, self._busy, self._experts = 0, 0, 0
        if self.pays():
            engine.set_predictor(model.router_logits, policy.guesses(config.n_expert_used))

    def pays(self) -> bool:
        pol = self.policy
        if not (pol.prefetch and self.bank.pinned):
            return False
        if pol.prefetch_k is not None:
            return True
        guessing = self.engine.predict is not None
        return self.scheduler.q() >= pol.prefetch_min_fetch_share - guessing * pol.prefetch_hysteresis

    @property
    def active(self) -> bool:
        """Whether decode steps guess the next layer's experts now (not while a trace is replayed)."""
        return self.engine.predict is not None and self.engine.trace is None

    def observe(self) -> None:
        """After a step: every observe_every steps, the CPU's measured rate to the scheduler."""
        self._steps += 1
        if self._steps < self.policy.observe_every:
            return
        self._steps = 0
        worker = self.engine.worker
        busy, n = sum(worker.busy_ns()), sum(worker.experts())
        d_busy, d_n = busy - self._busy, n - self._experts
        self._busy, self._experts = busy, n
        if d_n >= self.policy.observe_min_experts:   # enough CPU work to trust the rate
            eb = float(np.mean([lay.expert_bytes for lay in self.bank.layouts]))
            self.scheduler.observe_cpu(d_busy / 1e9, d_n * eb)
            self.recheck()

    def recheck(self) -> None:
        """After a new measure of the CPU's rate: start or stop guessing (not while a trace is
        replayed, which guesses nothing), at the next step's start (follow)."""
        if self.engine.trace is None and self.pays() != (self.engine.predict is not None):
            self._due = True

    def follow(self) -> None:
        """Before a step: start or stop guessing as observe() found."""
        if not self._due:
            return
        self._due = False
        self.set(self.engine.predict is None)
        self.changes += 1

    @property
    def may_change(self) -> bool:
        """Whether guessing may start or stop at run time (as measured, not the user's k)."""
        pol = self.policy
        return pol.prefetch and self.bank.pinned and pol.prefetch_k is None \
            and self.engine.trace is None

    def set(self, on: bool) -> None:
        """Guess from now on, or not (prepare_batches captures the steps of both modes)."""
        self.engine.set_predictor(self.model.router_logits if on else None,
                                  self.policy.guesses(self.config.n_expert_used))
