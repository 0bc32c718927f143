"""Routing profiles we write are read by FreeToken's --moe-cache-split profile: reader."""
from __future__ import annotations

import json

import numpy as np
import pytest

from freetoken_patch.errors import CLIError
from freetoken_patch.upstream.profile import convert, model_name


def test_freetoken_reads_our_profile(freetoken, tmp_path):
    from freetoken.moe.pool_policy import load_profile
    counts = np.random.default_rng(7).integers(0, 50, size=(4, 16))
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"model": "x", "counts": counts.tolist()}))   # bench --save-profile
    name = model_name("/m/Qwen3.6-35B-A3B-IQ3_S-00002-of-00003.gguf")
    assert name == "Qwen3.6-35B-A3B-IQ3_S"
    out = convert(ours, tmp_path / "ft.json", model=name)
    got = load_profile(out, 4, 16, f"/m/{name}-00001-of-00003.gguf").numpy()
    np.testing.assert_allclose(got, counts / counts.sum(axis=1, keepdims=True))


def test_not_a_profile(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(CLIError, match="not a routing profile"):
        convert(bad, tmp_path / "out.json")
