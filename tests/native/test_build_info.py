"""native.build_info: which GPUs a build's archs run on, and the one line for those it does not."""
from __future__ import annotations

import pytest

from native import build_info

DEFAULT = ["compute_80", "sm_86", "sm_89", "sm_90", "sm_120"]   # CMakeLists.txt's default list


@pytest.mark.parametrize("cc, runs", [
    ((8, 6), True), ((8, 7), True), ((8, 9), True),     # machine code; 8.7 runs 8.6's
    ((9, 0), True), ((12, 0), True), ((12, 1), True),   # 12.1 runs 12.0's machine code
    ((8, 0), True), ((10, 0), True), ((11, 0), True),   # no machine code: compute_80's PTX
    ((7, 5), False), ((6, 1), False),                   # older than any code here
])
def test_default_archs(cc, runs):
    assert build_info.runs_on(DEFAULT, cc) is runs


def test_machine_code_alone_runs_within_its_major():
    assert build_info.runs_on(["sm_90"], (9, 0))
    assert not build_info.runs_on(["sm_90"], (12, 0))    # no PTX: nothing for a newer major
    assert not build_info.runs_on(["sm_89"], (8, 6))     # machine code never runs on an older minor
    assert build_info.runs_on(["sm_90", "compute_90"], (12, 0))


def test_lists_we_cannot_read_are_taken_to_run():
    assert build_info.runs_on(["all-major"], (7, 5))
    assert build_info.runs_on(["unknown"], (8, 6))
    assert not build_info.runs_on([], (8, 6))


def test_the_line_names_gpu_capability_and_the_rebuild():
    assert build_info.mismatch("NVIDIA H200", (9, 0), DEFAULT) is None
    line = build_info.mismatch("NVIDIA GeForce RTX 5090", (12, 0), ["sm_90"])
    assert "\n" not in line
    for part in ("NVIDIA GeForce RTX 5090", "12.0", "sm_90", "FTPATCH_CUDA_ARCHS=120 pip install"):
        assert part in line
    old = build_info.mismatch("NVIDIA GeForce RTX 2060", (7, 5), DEFAULT)
    assert "7.5" in old and "8.0" in old and "FTPATCH_CUDA_ARCHS" not in old


def test_summary_has_the_cpu_build():
    s = build_info.summary()
    assert set(s) == {"cpu", "cuda"}
    if s["cpu"] is not None:
        assert s["cpu"]["isa"] in s["cpu"]["available"]


def _fake_gpu(monkeypatch, archs, name="NVIDIA GeForce RTX 5090", cc=(12, 0)):
    import sys
    import types

    import torch
    fake = types.SimpleNamespace(built_archs=lambda: archs, set_tables=lambda tables: None)
    monkeypatch.setitem(sys.modules, "native._cuda", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: cc)
    monkeypatch.setattr(build_info, "unusable", None)
    return fake


def test_loading_on_a_gpu_without_code_warns_one_line_and_falls_back(monkeypatch):
    from native import ops
    _fake_gpu(monkeypatch, ["sm_90"])
    with pytest.warns(UserWarning, match=r"RTX 5090 \(compute capability 12.0\).*FTPATCH_CUDA_ARCHS=120"):
        assert ops._load("_cuda") is None
    assert "RTX 5090" in build_info.unusable


def test_loading_on_a_covered_gpu_keeps_the_extension(monkeypatch):
    from native import ops
    fake = _fake_gpu(monkeypatch, DEFAULT)
    assert ops._load("_cuda") is fake and build_info.unusable is None
