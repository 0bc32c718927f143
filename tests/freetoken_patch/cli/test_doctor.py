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
    usable = any(g["kernels_run"] for g in d["gpus"])
    if not usable:   # this machine (CI) has no GPU: the model cannot run on one, status 1
        assert rc == 1 and not m["runs_on_gpu"] and m["reasons"] and m["command"] is None
        assert m["plan"] is None
    else:
        assert rc == (0 if m["runs_on_gpu"] else 1)
        assert m["plan"]["vram_bytes"] == m["vram_bytes"]
    assert main(["doctor", str(tiny_model)]) == rc
    out = capsys.readouterr().out
    assert str(tiny_model) in out and ("runs on the GPU here" in out or "cannot run" in out)


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
    m = doctor.model_plan(str(tiny_model), 4096, gpu, {"total_bytes": 1 << 30})
    assert not m["runs_on_gpu"] and "host RAM" in m["reasons"][0]


def test_version_shows_the_build(capsys):
    from native import build_info
    with pytest.raises(SystemExit):
        main(["--version"])
    out = capsys.readouterr().out
    cuda = build_info.summary()["cuda"]
    if cuda is None:
        assert "CUDA kernels: not built" in out
    else:   # CI builds sm_90 with PTX
        assert f"CUDA kernels: built by nvcc {cuda['compiler']} for {', '.join(cuda['archs'])}" in out
