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
