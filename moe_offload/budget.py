"""The VRAM budget: a hard cap on everything the runtime puts on the GPU, with our own
accounting per purpose (`VramLedger`), the CUDA allocator capped to match, and the peak measured
two ways (the allocator's own high-water mark, and nvidia-smi's view of the whole process)."""
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
class VramLedger:
    """What is where under the VRAM cap, by purpose, in bytes.

    `items` are memory held: at start-up the plan (`reserve` refuses what does not fit and names
    every entry), while running the measured figures (`set`: the CUDA context, torch's
    allocator, the KV and the expert cache as mapped). `loans` are room promised to work about to
    run -- a prompt's workspace, what a graph capture needs -- out of what the elastic cache
    could otherwise have: `lend` names one, `reclaim` gives it back. `free_under_cap` is what
    the cap leaves once the rest is counted; the cache is sized from it.
    """

    cap: int
    items: dict[str, int] = field(default_factory=dict)
    loans: dict[str, int] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return sum(self.items.values())

    @property
    def left(self) -> int:
        return self.cap - self.used

    def held(self, *leaving_out: str) -> int:
        """Bytes held by every purpose but those named."""
        return sum(v for k, v in self.items.items() if k not in leaving_out)

    def free_under_cap(self, *leaving_out: str, loans: bool = True) -> int:
        """The cap less what every other purpose holds (and, with `loans`, has been lent)."""
        return self.cap - self.held(*leaving_out) - (sum(self.loans.values()) if loans else 0)

    def reserve(self, purpose: str, nbytes: int, hint: str = "") -> None:
        """Add `nbytes` to `purpose`, or refuse with every entry's size and the fix."""
        if nbytes > self.left:
            parts = ", ".join(f"{k} {_gib(v)}" for k, v in self.items.items())
            raise OffloadError(
                f"--vram {_gib(self.cap)} is too small: {purpose} needs {_gib(nbytes)} but only "
                f"{_gib(self.left)} is left ({parts}); {hint or 'raise --vram'}")
        self.items[purpose] = self.items.get(purpose, 0) + int(nbytes)

    def set(self, purpose: str, nbytes: int) -> None:
        """`purpose` holds `nbytes` now (a measured figure; 0 drops the entry)."""
        if nbytes:
            self.items[purpose] = int(nbytes)
        else:
            self.items.pop(purpose, None)

    def release(self, purpose: str, nbytes: int | None = None) -> None:
        have = self.items.get(purpose, 0)
        left = 0 if nbytes is None else max(0, have - int(nbytes))
        self.set(purpose, left)

    def lend(self, purpose: str, nbytes: int) -> None:
        """Keep `nbytes` free for `purpose` (replacing what it was lent before)."""
        self.loans[purpose] = max(0, int(nbytes))

    def reclaim(self, purpose: str | None = None) -> int:
        """End `purpose`'s loan (None: every loan); the bytes given back."""
        if purpose is None:
            n, self.loans = sum(self.loans.values()), {}
            return n
        return self.loans.pop(purpose, 0)

    def summary(self) -> dict[str, int]:
        return {"cap": self.cap, **self.items, **{f"lent: {k}": v for k, v in self.loans.items()},
                "left": self.free_under_cap()}


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
