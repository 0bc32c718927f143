"""The GPU-memory poller behind the nvidia-smi peak (moe_offload.offload.budget): NVML in-process, the
nvidia-smi program where NVML is missing."""
import ctypes

import pytest
import torch

from moe_offload.offload import budget


def test_nvml_row_layout():
    # nvmlProcessInfo_v2_t: pid, (pad), usedGpuMemory, gpuInstanceId, computeInstanceId
    assert ctypes.sizeof(budget._NvmlProcessInfo) == 24
    assert budget._NvmlProcessInfo.usedGpuMemory.offset == 8


def test_without_nvml_falls_back_to_the_program(monkeypatch):
    def no_library(*a, **k):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")
    monkeypatch.setattr(budget.ctypes, "CDLL", no_library)
    calls = []
    monkeypatch.setattr(budget, "_smi_used", lambda: calls.append(1) or None)
    poll = budget.SmiPeak()
    assert poll.source == "nvidia-smi" and poll._interval == 1.0
    assert calls == [1] and poll.peak_bytes is None   # nothing listed: no thread started
    assert not poll._thread.is_alive()


@pytest.mark.gpu
def test_nvml_reads_what_nvidia_smi_reads():
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    poll = budget.SmiPeak()
    try:
        assert poll.source == "nvml"
        ours, program = budget.Nvml().used(), budget._smi_used()
        assert ours is not None and program is not None
        assert ours >= x.numel()
        assert abs(ours - program) <= 4 << 20   # nvidia-smi prints MiB
    finally:
        poll.stop()


def test_a_driver_without_the_v3_query_falls_back_at_start(monkeypatch):
    class OldNvml:   # nvmlInit and the device calls succeed; no ..._v3 process query
        def nvmlInit_v2(self):
            return 0

        def nvmlDeviceGetCount_v2(self, count):
            return 0

    monkeypatch.setattr(budget.ctypes, "CDLL", lambda name: OldNvml())
    monkeypatch.setattr(budget, "_smi_used", lambda: None)
    assert budget.SmiPeak().source == "nvidia-smi"
