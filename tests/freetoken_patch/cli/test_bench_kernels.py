"""`ftpatch bench kernels` on the CPU: one JSON object with a rate per ISA for every point, the
MoE point included, each against the host's read bandwidth."""
from __future__ import annotations

import json

import pytest

from native import ops

pytestmark = pytest.mark.skipif(ops._cpu is None, reason="native._cpu is not built")


def test_cpu_points_carry_every_isa_and_the_share_of_host_bandwidth(capsys):
    from freetoken_patch.cli.bench_kernels import main
    isas, active = ops._cpu.available_isas(), ops._cpu.isa()
    assert main(["--no-gpu", "--types", "Q4_K", "--shapes", "256x64", "--moe-types", "IQ3_S",
                 "--cpu-isas", "all", "--cpu-iters", "1", "--cpu-prefill-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host"]["isas"] == isas and out["bandwidth"]["host_read_GBps"] > 0
    (point,) = out["matmul"]
    assert set(point["cpu"]) == set(isas)
    for cell in point["cpu"].values():
        assert cell["us"] > 0 and cell["pct"] > 0 and cell["prefill_GFLOPs"] > 0
    moe, repacked = out["moe"]   # IQ3_S, then the same point on its CPU form
    assert set(moe["cpu"]) == set(isas) and moe["bytes"] == 8 * 3 * 512 * 2048 * 110 // 256
    for cell in moe["cpu"].values():
        assert cell["us"] > 0 and cell["GBps"] > 0 and cell["pct"] > 0
    assert repacked["type"] == "IQ3_S_N4" and repacked["repacked_from"] == "IQ3_S"
    assert repacked["bytes"] == 8 * 3 * 512 * 2048 * 134 // 256 and "gpu_us" not in repacked
    for cell in repacked["cpu"].values():   # its own bytes, and the file type's, a second
        assert cell["file_GBps"] * 134 == pytest.approx(cell["GBps"] * 110)
    assert ops._cpu.isa() == active   # restored after measuring the others


def test_nothing_to_measure_says_why_and_fails(capsys):
    """With the CPU left out on a machine whose GPU path is not there, the command names each
    engine's reason in one error line and exits 1; it never claims the extensions are missing
    when they are built."""
    import torch

    from freetoken_patch.cli import main
    if ops._cuda is not None and torch.cuda.is_available():
        pytest.skip("this machine has a GPU to measure")
    assert main(["bench", "kernels", "--no-cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ftpatch: error: bench kernels has nothing to measure here") and "\n" not in err
    assert "CPU: skipped by --no-cpu" in err and "GPU: " in err


def test_what_is_measured_is_said_first(capsys):
    from freetoken_patch.cli import main
    assert main(["bench", "kernels", "--no-gpu", "--types", "Q4_K", "--shapes", "256x64",
                 "--moe-types", "none", "--cpu-iters", "1", "--cpu-prefill-tokens", "0"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("measuring: CPU; GPU: skipped by --no-gpu"), first
