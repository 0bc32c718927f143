"""`ftpatch doctor`: runs on any machine without a traceback, its JSON shape, its exit status."""
from __future__ import annotations

import json

import pytest
import torch

from freetoken_patch.cli import doctor, main

SECTIONS = {"build", "driver", "torch", "gpus", "host_ram", "pinning", "huge_pages", "cpu"}


def test_machine_report_exits_0(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for part in ("CPU kernels", "host RAM", "largest model", "page-locking", "huge pages", "CPU:"):
        assert part in out
    assert "Traceback" not in out


def test_json_shape(capsys):
    assert main(["doctor", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) == SECTIONS
    assert d["host_ram"]["total_bytes"] > 0
    assert d["host_ram"]["largest_model_bytes"] == max(0, d["host_ram"]["total_bytes"] - doctor.HOST_HEADROOM)
    assert d["torch"]["torch"] == torch.__version__
    assert set(d["cpu"]["features"]) == set(doctor.CPU_FLAGS)
    assert d["pinning"]["mlock"] in (True, False, None)
    for g in d["gpus"]:
        assert {"name", "capability", "vram_bytes", "kernels_run"} <= set(g)


def test_with_a_model(tiny_model, capsys):
    rc = main(["doctor", str(tiny_model), "--json"])
    d = json.loads(capsys.readouterr().out)
    m = d["model"]
    assert m["expert_bytes"] > 0 and m["host_need_bytes"] > m["expert_bytes"]
    assert m["n_ctx"] == 4096     # run's rule: the trained context (4096 here), capped at 4096
    usable = any(g["kernels_run"] for g in d["gpus"])
    if not usable:   # this machine (CI) has no GPU: not on one, the CPU's command instead
        assert not m["runs_on_gpu"] and m["reasons"] and m["command"] is None
        assert m["plan"] is None
        c = m["cpu"]
        assert c["runs"] and rc == 0 and m["runs_here"]
        assert c["command"] == f"ftpatch chat {tiny_model} --ctx 4096"
    else:
        assert rc == (0 if m["runs_here"] else 1)
        assert m["plan"]["vram_bytes"] == m["vram_bytes"]
    assert main(["doctor", str(tiny_model)]) == rc
    out = capsys.readouterr().out
    assert str(tiny_model) in out and ("runs on the GPU here" in out or "runs on the CPU here" in out)


def test_the_cpu_path_needs_what_the_model_takes(tiny_model):
    """A tiny model needs megabytes, not the GiB of a rule: its weights in the CPU's form, KV and
    state for the context, and the process; a machine without that much says so, status 1."""
    m = doctor.model_plan(str(tiny_model), None, None, {"total_bytes": 64 << 30,
                                                        "available_bytes": 32 << 30})
    c = m["cpu"]
    file_bytes = tiny_model.stat().st_size
    assert file_bytes <= c["weight_bytes"] < 1.3 * file_bytes      # IQ3_S repacked: +22%
    assert c["host_need_bytes"] == c["weight_bytes"] + c["kv_state_bytes"] + doctor.PROCESS_BYTES
    assert c["host_need_bytes"] < 1 << 30
    m = doctor.model_plan(str(tiny_model), 2048, None, {"total_bytes": 64 << 30,
                                                        "available_bytes": 200 << 20})
    assert not m["runs_here"] and "host RAM" in m["cpu"]["reasons"][0] and m["cpu"]["command"] is None
    assert m["n_ctx"] == 2048


def test_a_missing_model_is_one_error_line(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "nope.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ftpatch: error: ") and "\n" not in err


def test_plan_with_a_gpu_suggests_a_command(tiny_model):
    """The plan and command line for a GPU doctor found (a stand-in: CI has none)."""
    gpu = {"index": 0, "name": "stand-in", "capability": "8.6", "vram_bytes": 8 << 30,
           "free_bytes": 7 << 30, "kernels_run": True, "problem": None}
    ram = {"total_bytes": 64 << 30}
    m = doctor.model_plan(str(tiny_model), 4096, gpu, ram)
    assert m["vram_bytes"] == (7 << 30) - (256 << 20)
    assert m["plan"]["fits"] and m["runs_on_gpu"], m["reasons"]
    assert m["command"] == f"ftpatch chat {tiny_model} --vram 6.75GiB --ctx 4096"
    assert m["cpu"] is None and m["runs_here"]
    m = doctor.model_plan(str(tiny_model), 4096, gpu, {"total_bytes": 200 << 20})
    assert not m["runs_on_gpu"] and "host RAM" in m["reasons"][0]


def test_version_shows_the_build(capsys):
    from native import build_info
    with pytest.raises(SystemExit):
        main(["--version"])
    out = capsys.readouterr().out
    cuda = build_info.summary()["cuda"]
    if cuda is None:
        assert "CUDA kernels: not built" in out
    else:
        assert f"CUDA kernels: built by nvcc {cuda['compiler']} for {', '.join(cuda['archs'])}" in out


@pytest.mark.parametrize("record, words", [
    ({"cuda_built": False, "cuda_reason": "FTPATCH_CUDA=OFF was set at build time"},
     "not built: FTPATCH_CUDA=OFF was set at build time"),
    ({"cuda_built": False, "cuda_reason": "no NVIDIA GPU was visible at build time (FTPATCH_CUDA=ON "
                                          "builds the CUDA extension without one)"},
     "not built: no NVIDIA GPU was visible at build time"),
    (None, "not built (no build record here"),
])
def test_version_gives_the_reason_recorded_at_build_time(monkeypatch, capsys, record, words):
    """The reason comes from the build (native/_build.json), not from a guess at run time: a
    machine with nvcc and FTPATCH_CUDA=OFF says OFF, not 'no nvcc'."""
    from native import build_info
    monkeypatch.setattr(build_info, "summary", lambda: {"cpu": None, "cuda": None})
    monkeypatch.setattr(doctor, "build_record", lambda: record)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert words in capsys.readouterr().out
