"""Every GGUF the fuzzer ever broke the loaders with (tests/loaders/fuzz_regressions), through the
CLI a user runs: `inspect` for models, `tokenize` for vocabulary-only files. Each ends with exit
status 0, or 1 and one `ftpatch: error:` line (no traceback), within 10 s and 1 GiB (generous
bounds that catch a hang or a runaway allocation, not a speed claim)."""
from __future__ import annotations

import json
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from freetoken_patch.cli import main

LOADER_TESTS = Path(__file__).resolve().parents[2] / "loaders"
sys.path.insert(0, str(LOADER_TESTS))
import fuzz_gguf  # noqa: E402

REGRESSIONS = sorted((LOADER_TESTS / "fuzz_regressions").glob("gguf-*.json"))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    paths = fuzz_gguf.make_bases(tmp_path_factory.mktemp("bases"))
    return {n: fuzz_gguf.load_base(n, p) for n, p in paths.items()}


@pytest.mark.parametrize("reg_path", REGRESSIONS, ids=lambda p: p.stem)
def test_a_broken_file_is_one_line(reg_path, bases, tmp_path, capsys):
    reg = json.loads(reg_path.read_text())
    path = tmp_path / "broken.gguf"
    path.write_bytes(fuzz_gguf.from_regression(reg, bases))
    args = ["inspect", str(path)] if reg["base"] == "model" else ["tokenize", str(path), "hi"]
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        rc = main(args)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert rc in (0, 1), f"{reg_path.name}: exit status {rc}"
    if rc == 1:
        assert err.startswith("ftpatch: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert seconds < 10 and peak < 1 << 30, f"{reg_path.name}: {seconds:.1f} s, {peak >> 20} MiB"
