"""The build backend's one decision: when NVIDIA's compiler wheels join the build requirements
(build_backend/ftpatch_build.py). The build itself is CI's (.ci/run) and the GPU machine's
(scripts/dev/registry_nvcc_build.sh)."""
from __future__ import annotations

import importlib.util
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def backend(monkeypatch, tmp_path):
    """The backend module, on a machine with no nvcc on the PATH, no GPU and no hints."""
    spec = importlib.util.spec_from_file_location("ftpatch_build_t", ROOT / "build_backend" / "ftpatch_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for var in ("FTPATCH_CUDA", "FTPATCH_CUDA_VERSION", "CUDACXX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(mod, "driver_cuda_version", lambda: None)
    monkeypatch.setattr(mod, "gpu_present", lambda: False)
    return mod


def _fake_nvcc(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nvcc = folder / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return nvcc


def names(reqs: list[str]) -> set[str]:
    return {r.split(">")[0].split("=")[0].split("<")[0] for r in reqs}


def test_no_gpu_no_hint_downloads_nothing(backend):
    assert backend.compiler_requirements() == []


def test_hint_on_asks_for_the_compiler_wheels_of_one_version(backend, monkeypatch):
    monkeypatch.setenv("FTPATCH_CUDA", "ON")
    reqs = backend.compiler_requirements()
    assert names(reqs) == set(backend.COMPILER_WHEELS)
    assert all(r.endswith(">=13.0,<13.1") for r in reqs), reqs   # one CUDA version for all


def test_a_gpu_asks_for_the_drivers_cuda_at_most(backend, monkeypatch):
    monkeypatch.setattr(backend, "gpu_present", lambda: True)
    monkeypatch.setattr(backend, "driver_cuda_version", lambda: (13, 2))
    assert all(r.endswith(">=13.0,<13.3") for r in backend.compiler_requirements())
    monkeypatch.setenv("FTPATCH_CUDA_VERSION", "13.0")
    assert all(r.endswith(">=13.0,<13.1") for r in backend.compiler_requirements())


def test_local_nvcc_or_off_needs_nothing(backend, monkeypatch, tmp_path):
    monkeypatch.setattr(backend, "gpu_present", lambda: True)
    monkeypatch.setenv("FTPATCH_CUDA", "OFF")
    assert backend.compiler_requirements() == []
    monkeypatch.setenv("FTPATCH_CUDA", "ON")
    monkeypatch.setenv("PATH", str(_fake_nvcc(tmp_path / "bin").parent))
    assert backend.compiler_requirements() == []


def test_a_driver_older_than_the_wheels_says_what_to_do(backend, monkeypatch):
    monkeypatch.setattr(backend, "gpu_present", lambda: True)
    monkeypatch.setattr(backend, "driver_cuda_version", lambda: (12, 4))
    with pytest.raises(SystemExit, match="driver supports CUDA 12.4.*FTPATCH_CUDA=OFF"):
        backend.compiler_requirements()
    monkeypatch.setenv("FTPATCH_CUDA_VERSION", "thirteen")
    with pytest.raises(SystemExit, match="MAJOR.MINOR"):
        backend.compiler_requirements()


def test_the_installed_wheels_are_found_on_sys_path(backend, monkeypatch, tmp_path):
    root = tmp_path / "site" / "nvidia" / "cu13"
    _fake_nvcc(root / "bin")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")] + sys.path)
    assert backend.registry_toolkit() == str(root)
