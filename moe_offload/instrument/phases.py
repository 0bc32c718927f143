"""Phase timers for a step made of phases (speculative decoding: draft, verify, accept,
rewind). The default books nothing and costs a call; `SyncedPhases` synchronises the device at
each boundary and books the wall time since the last one, which costs the overlap of the host
with the device: for measurements only."""
from __future__ import annotations

import time

import torch


class Phases:
    """No timing (the default)."""

    syncs = False   # whether laps synchronise the device (work queued ahead would be timed wrong)

    def lap(self, name: str | None = None) -> None:
        """The phase `name` ends here (None: a phase begins, nothing booked)."""


class SyncedPhases(Phases):
    """Synchronise `device` at each lap and book the time since the last to `book(name, s)`."""

    syncs = True

    def __init__(self, device: torch.device, book):
        self.device, self.book, self._t = device, book, time.perf_counter()

    def lap(self, name: str | None = None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if name is not None:
            self.book(name, now - self._t)
        self._t = now
