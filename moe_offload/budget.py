"""The VRAM budget: a hard cap on everything the runtime puts on the GPU, with our own
accounting per purpose, the CUDA allocator capped to match, and the peak measured two ways
(the allocator's own high-water mark, and nvidia-smi's view of the whole process)."""
from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass, field

import torch

from .errors import OffloadError


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass
class VramBudget:
    """Reserve bytes by purpose ("dense", "kv", "expert_cache", ...); refuse what exceeds the cap."""

    cap: int
    items: dict[str, int] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return sum(self.items.values())

    @property
    def left(self) -> int:
        return self.cap - self.used

    def reserve(self, purpose: str, nbytes: int, hint: str = "") -> None:
        if nbytes > self.left:
            parts = ", ".join(f"{k} {_gib(v)}" for k, v in self.items.items())
            raise OffloadError(
                f"--vram {_gib(self.cap)} is too small: {purpose} needs {_gib(nbytes)} but only "
                f"{_gib(self.left)} is left ({parts}); {hint or 'raise --vram'}")
        self.items[purpose] = self.items.get(purpose, 0) + int(nbytes)

    def release(self, purpose: str, nbytes: int | None = None) -> None:
        have = self.items.get(purpose, 0)
        left = 0 if nbytes is None else max(0, have - int(nbytes))
        if left:
            self.items[purpose] = left
        else:
            self.items.pop(purpose, None)

    def summary(self) -> dict[str, int]:
        return {"cap": self.cap, **self.items, "left": self.left}


def cap_allocator(cap: int, device: torch.device) -> None:
    """Make torch's allocator refuse to grow past `cap` bytes on `device` (our hard stop)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), index)


class SmiPeak:
    """Polls nvidia-smi for this process's GPU memory (context + allocator + everything)."""

    def __init__(self, interval: float = 0.1):
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.sample() is not None:
            self._thread.start()

    def sample(self) -> int | None:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        pid = os.getpid()
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) == pid:
                val = int(float(parts[1])) << 20
                self.peak_bytes = max(self.peak_bytes or 0, val)
                return val
        return None

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def stop(self) -> int | None:
        self._stop.set()
        self.sample()
        return self.peak_bytes


def allocator_peaks(device: torch.device) -> dict[str, int]:
    return {"allocated_peak": torch.cuda.max_memory_allocated(device),
            "reserved_peak": torch.cuda.max_memory_reserved(device)}
