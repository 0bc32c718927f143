"""The build backend's decisions (build_backend/ftpatch_build.py): whether the CUDA extension is
built, for which architectures, with which compiler, and what the build says. The build itself is
CI's (.ci/run: the quick start's install, a CUDA build forced with FTPATCH_CUDA=ON, and one with
the registry's compiler) and the GPU machine's (scripts/dev/registry_nvcc_build.sh)."""
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
    monkeypatch.setitem(sys.modules, spec.name, mod)   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    for var in ("FTPATCH_CUDA", "FTPATCH_CUDA_VERSION", "FTPATCH_CUDA_ARCHS", "CUDACXX",
                "FTPATCH_BUILD_NOTE", "CMAKE_BUILD_PARALLEL_LEVEL", "CUDAToolkit_ROOT", "CUDAFLAGS"):
        monkeypatch.setenv(var, "")   # so that teardown restores what _prepare may write
        monkeypatch.delenv(var)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(mod, "driver_cuda_version", lambda: None)
    monkeypatch.setattr(mod, "visible_gpus", lambda: [])
    return mod


def _gpus(backend, monkeypatch, *caps, driver=(13, 0)):
    gpus = [backend.Gpu(f"GPU {i}", cap) for i, cap in enumerate(caps)]
    monkeypatch.setattr(backend, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(backend, "driver_cuda_version", lambda: driver)


def _fake_nvcc(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nvcc = folder / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return nvcc


def names(reqs: list[str]) -> set[str]:
    return {r.split(">")[0].split("=")[0].split("<")[0] for r in reqs}


# ---- AUTO: CUDA where a GPU is visible, for that GPU -------------------------------------------

def test_no_gpu_builds_for_the_cpu_even_with_nvcc_here(backend, monkeypatch, tmp_path):
    """nvcc on the PATH is not a reason to compile CUDA for five architectures on a machine
    that has no GPU to run them."""
    monkeypatch.setenv("PATH", str(_fake_nvcc(tmp_path / "bin").parent))
    p = backend.plan()
    assert not p.cuda and "no NVIDIA GPU was visible" in p.reason and "FTPATCH_CUDA=ON" in p.reason
    assert backend.compiler_requirements() == []


def test_a_visible_gpu_builds_for_its_architecture_with_ptx(backend, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(_fake_nvcc(tmp_path / "bin").parent))
    _gpus(backend, monkeypatch, (8, 9))
    p = backend.plan()
    assert p.cuda and p.archs == "89" and "GPU 0 (compute capability 8.9)" in p.reason
    assert p.nvcc.endswith("nvcc") and p.requirements == []
    assert backend.archs_text(p.archs) == "sm_89 and PTX compute_89"


def test_two_gpus_get_machine_code_each_and_ptx_for_the_newest(backend, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(_fake_nvcc(tmp_path / "bin").parent))
    _gpus(backend, monkeypatch, (9, 0), (8, 6), (9, 0))
    assert backend.plan().archs == "86-real;90"
    assert backend.archs_text("86-real;90") == "sm_86, sm_90 and PTX compute_90"


def test_an_unknown_capability_takes_the_default_list(backend, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(_fake_nvcc(tmp_path / "bin").parent))
    _gpus(backend, monkeypatch, None)
    p = backend.plan()
    assert p.cuda and p.archs == ""
    assert backend.archs_text("") == backend.DEFAULT_ARCHS_TEXT


def test_a_gpu_older_than_the_kernels_builds_for_the_cpu(backend, monkeypatch):
    _gpus(backend, monkeypatch, (7, 5))
    p = backend.plan()
    assert not p.cuda and "7.5" in p.reason and "8.0" in p.reason
    assert backend.compiler_requirements() == []


def test_archs_asked_for_win(backend, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(_fake_nvcc(tmp_path / "bin").parent))
    _gpus(backend, monkeypatch, (8, 9))
    monkeypatch.setenv("FTPATCH_CUDA_ARCHS", "86;89-real;120-real")
    p = backend.plan()
    assert p.archs == "86;89-real;120-real" and "FTPATCH_CUDA_ARCHS=86;89-real;120-real" in p.reason


# ---- ON and OFF ------------------------------------------------------------------------------------

def test_on_without_a_gpu_builds_cuda_for_the_default_list(backend, monkeypatch, tmp_path):
    monkeypatch.setenv("FTPATCH_CUDA", "on")
    monkeypatch.setenv("PATH", str(_fake_nvcc(tmp_path / "bin").parent))
    p = backend.plan()
    assert p.cuda and p.archs == "" and p.reason.startswith("FTPATCH_CUDA=ON")


def test_off_builds_for_the_cpu_and_says_so(backend, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(_fake_nvcc(tmp_path / "bin").parent))
    _gpus(backend, monkeypatch, (9, 0))
    monkeypatch.setenv("FTPATCH_CUDA", "OFF")
    p = backend.plan()
    assert not p.cuda and p.reason == "FTPATCH_CUDA=OFF was set at build time"


def test_a_bad_mode_is_one_message(backend, monkeypatch):
    monkeypatch.setenv("FTPATCH_CUDA", "yes")
    with pytest.raises(SystemExit, match="AUTO.*ON or OFF"):
        backend.plan()


# ---- the compiler: local nvcc, else the registry's wheels ----------------------------------------

def test_hint_on_asks_for_the_compiler_wheels_of_one_version(backend, monkeypatch):
    monkeypatch.setenv("FTPATCH_CUDA", "ON")
    reqs = backend.compiler_requirements()
    assert names(reqs) == set(backend.COMPILER_WHEELS)
    assert all(r.endswith(">=13.0,<13.1") for r in reqs), reqs   # one CUDA version for all


def test_a_gpu_asks_for_the_drivers_cuda_at_most(backend, monkeypatch):
    _gpus(backend, monkeypatch, (8, 6), driver=(13, 2))
    assert all(r.endswith(">=13.0,<13.3") for r in backend.compiler_requirements())
    monkeypatch.setenv("FTPATCH_CUDA_VERSION", "13.0")
    assert all(r.endswith(">=13.0,<13.1") for r in backend.compiler_requirements())


def test_local_nvcc_or_off_needs_nothing(backend, monkeypatch, tmp_path):
    _gpus(backend, monkeypatch, (8, 6))
    monkeypatch.setenv("FTPATCH_CUDA", "OFF")
    assert backend.compiler_requirements() == []
    monkeypatch.setenv("FTPATCH_CUDA", "ON")
    monkeypatch.setenv("PATH", str(_fake_nvcc(tmp_path / "bin").parent))
    assert backend.compiler_requirements() == []


def test_a_driver_older_than_the_wheels_says_what_to_do(backend, monkeypatch):
    _gpus(backend, monkeypatch, (8, 6), driver=(12, 4))
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


# ---- what the build tells CMake and the user -------------------------------------------------------

def test_prepare_passes_the_decision_to_cmake(backend, monkeypatch, tmp_path):
    said = []
    monkeypatch.setattr(backend, "say", said.append)
    monkeypatch.setenv("PATH", str(_fake_nvcc(tmp_path / "bin").parent))
    monkeypatch.setenv("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    backend._prepare()
    import os
    assert os.environ["FTPATCH_CUDA"] == "OFF"
    assert os.environ["FTPATCH_BUILD_NOTE"].startswith("no NVIDIA GPU was visible")
    assert said[0].startswith("ftpatch build: compiling the CPU extension only: no NVIDIA GPU")
    assert "expect about" in said[0] and "on 2 cores" in said[0] and "pip install -v" in said[0]
    _gpus(backend, monkeypatch, (8, 9))
    monkeypatch.delenv("FTPATCH_CUDA")   # the user's setting again (the build runs once a process)
    backend._prepare()
    assert os.environ["FTPATCH_CUDA"] == "ON" and os.environ["FTPATCH_CUDA_ARCHS"] == "89"
    assert "CUDA extension for sm_89 and PTX compute_89" in said[1]


def test_the_estimate_grows_with_the_architectures_and_shrinks_with_cores(backend):
    cpu = backend.Plan(False, "x")
    one = backend.Plan(True, "x", "90")
    five = backend.Plan(True, "x", "")
    assert backend.estimate_s(cpu, 2) < backend.estimate_s(one, 2) < backend.estimate_s(five, 2)
    assert backend.estimate_s(five, 16) < backend.estimate_s(five, 2) / 4
    # the 2-core machine's figures: ~2 min for the CPU, ~5 min with one architecture, the
    # default list's five well over a quarter of an hour
    assert 60 <= backend.estimate_s(cpu, 2) <= 180
    assert 4 * 60 <= backend.estimate_s(one, 2) <= 8 * 60
    assert backend.estimate_s(five, 2) >= 15 * 60


def test_the_script_prints_the_decision_for_this_machine(tmp_path):
    """`python build_backend/ftpatch_build.py` (scripts/dev/registry_nvcc_build.sh reads its
    'compiler wheels:' line)."""
    import os
    import subprocess
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTPATCH_")}
    r = subprocess.run([sys.executable, str(ROOT / "build_backend" / "ftpatch_build.py")],
                       capture_output=True, text=True, env={**env, "FTPATCH_CUDA": "OFF"}, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("FTPATCH_CUDA=OFF")
    assert "compiling the CPU extension only: FTPATCH_CUDA=OFF was set at build time" in lines[1]
    assert lines[2] == "compiler wheels: none"


def test_a_driver_that_sees_no_gpu_means_none_visible(monkeypatch):
    """CUDA_VISIBLE_DEVICES="" on a GPU machine: cuInit answers 'no device', and nvidia-smi
    (which ignores the variable) is not asked."""
    spec = importlib.util.spec_from_file_location("ftpatch_build_v", ROOT / "build_backend" / "ftpatch_build.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)

    class Lib:
        def cuInit(self, flags):
            return mod.CUDA_ERROR_NO_DEVICE
    monkeypatch.setattr(mod, "_libcuda", lambda: Lib())
    monkeypatch.setattr(mod, "_gpus_from_smi", lambda: pytest.fail("nvidia-smi asked"))
    assert mod.visible_gpus() == [] and not mod.gpu_present()
