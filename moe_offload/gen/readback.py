"""Reading a sampled token back to the host without stalling the GPU.

A decode step's token is needed on the host (to stream it, to check stops), but the next step
needs it only on the device. TokenReadback copies it to pinned memory, queues the next step on
the device's copy, and only then waits for the copy: the GPU never idles through the host's
turn. generate()'s plain steps, the speculative decoder's plain steps and the server's batched
steps (several ids at once) go through it.
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
        ids, ahead = self.many(tok.reshape(1), queue_next)
        return ids[0], ahead

    def many(self, ids: torch.Tensor, queue_next: Callable[[], T]) -> tuple[list[int], T]:
        """The same for several ids (a 1-D int64 tensor on the device: a batched step's)."""
        if not self.cuda:
            return ids.tolist(), queue_next()
        if self._host.numel() < ids.numel():
            self._host = torch.empty(ids.numel(), dtype=torch.int64, pin_memory=True)
        host = self._host[:ids.numel()]
        host.copy_(ids, non_blocking=True)
        self._read.record()
        ahead = queue_next()
        self._read.synchronize()
        return host.tolist(), ahead
