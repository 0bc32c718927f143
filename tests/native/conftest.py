"""Fixtures of the native kernel tests: the oracle module on the path, and the CPU ISA switch."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import kernel_oracle`


def _isas() -> list[str]:
    try:
        from native import ops
        return list(ops._cpu.available_isas()) if ops._cpu is not None else []
    except Exception:
        return []


@pytest.fixture(params=_isas() or [pytest.param("none", marks=pytest.mark.skip("no native._cpu"))])
def cpu_isa(request):
    """Runs the test once per CPU ISA this machine has (generic = the CPU oracle, avx2, ...)."""
    from native import ops
    before = ops._cpu.isa()
    ops._cpu.set_isa(request.param)
    yield request.param
    ops._cpu.set_isa(before)
