"""The VRAM budget: a hard cap on everything the runtime puts on the GPU, with our own
accounting per purpose (`VramLedger`), the CUDA allocator capped to match, and the peak measured
two ways (the allocator's own high-water mark, and nvidia-smi's view of the whole process)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from dataclasses import dataclass, field

import torch

from ..errors import OffloadError


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


class _NvmlProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_v2_t, what nvmlDeviceGetComputeRunningProcesses_v3 fills
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class Nvml:
    """This process's GPU memory as nvidia-smi reports it, read from NVML (the library nvidia-smi
    itself calls) in-process: a few microseconds, where starting nvidia-smi costs tens of
    milliseconds of a core -- time the CPU worker's threads need while a step runs."""
    NOT_AVAILABLE = (1 << 64) - 1

    def __init__(self):
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            raise OSError("nvmlDeviceGetCount failed")
        self.handles = []
        for i in range(count.value):
            h = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) == 0:
                self.handles.append(h)
        # resolved here: a driver too old for _v3 falls back to nvidia-smi at start, not later
        self._processes = lib.nvmlDeviceGetComputeRunningProcesses_v3
        self.pid = os.getpid()
        self._rows = (_NvmlProcessInfo * 64)()

    def used(self) -> int | None:
        """Bytes this process holds on the GPUs, or None if NVML does not list it."""
        total, seen = 0, False
        for h in self.handles:
            n = ctypes.c_uint(len(self._rows))
            if self._processes(h, ctypes.byref(n), self._rows) != 0:
                return None
            for row in self._rows[:n.value]:
                if row.pid == self.pid and row.usedGpuMemory != self.NOT_AVAILABLE:
                    total, seen = total + row.usedGpuMemory, True
        return total if seen else None


def _smi_used() -> int | None:
    """The same figure from the nvidia-smi program (where NVML cannot be loaded)."""
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
            return int(float(parts[1])) << 20
    return None


class SmiPeak:
    """Polls this process's GPU memory (context + allocator + everything) as nvidia-smi reports
    it: through NVML every `interval` seconds, or by starting nvidia-smi every `slow_interval`
    where NVML is missing (each start costs a core tens of milliseconds)."""

    def __init__(self, interval: float = 0.1, slow_interval: float = 1.0):
        self.peak_bytes: int | None = None
        try:
            self._read, self.source = Nvml().used, "nvml"
        except (OSError, AttributeError):
            self._read, self.source, interval = _smi_used, "nvidia-smi", slow_interval
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.sample() is not None:
            self._thread.start()

    def sample(self) -> int | None:
        val = self._read()
        if val is not None:
            self.peak_bytes = max(self.peak_bytes or 0, val)
        return val

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
