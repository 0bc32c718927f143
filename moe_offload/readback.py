"""Reading a sampled token back to the host without stalling the GPU.

A decode step's token is needed on the host (to stream it, to check stops), but the next step
needs it only on the device. TokenReadback copies it to pinned memory, queues the next step on
the device's copy, and only then waits for the copy: the GPU never idles through the host's
turn. generate()'s plain steps and the speculative decoder's plain steps both go through it.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class TokenReadback:
    """One reusable pinned slot and event (CUDA); on other devices a plain read after the step."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self._host = torch.empty(1, dtype=torch.int64, pin_memory=True)
            self._read = torch.cuda.Event()

    def __call__(self, tok: torch.Tensor, queue_next: Callable[[], T]) -> tuple[int, T]:
        """tok: a one-element int64 tensor on the device. Runs queue_next() (the next step, fed
        with tok on the device) -> (tok's value on the host, what queue_next returned)."""
        if not self.cuda:
            return int(tok.reshape(-1)[0]), queue_next()
        self._host.copy_(tok.reshape(1), non_blocking=True)
        self._read.record()
        ahead = queue_next()
        self._read.synchronize()
        return int(self._host[0]), ahead
