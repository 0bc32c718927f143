"""Shared fixtures: synthetic models (built once per session), the shared vocabulary fixture,
and the `gpu` marker (skipped where CUDA is unavailable)."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_VOCAB = ROOT.parent / "shared" / "fixtures" / "ggml-vocab-qwen35.gguf"


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def vocab_path() -> Path:
    if not SHARED_VOCAB.exists():
        pytest.fail(f"the shared vocabulary fixture is missing: {SHARED_VOCAB}")
    return SHARED_VOCAB


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory):
    """Factory: synth_model(**SynthOptions fields) -> path, cached per option set."""
    from loaders.synth import SynthOptions, synthesize
    cache: dict = {}
    base = tmp_path_factory.mktemp("synth")

    def make(**kw) -> Path:
        key = tuple(sorted(kw.items()))
        if key not in cache:
            path = base / f"m{len(cache)}.gguf"
            paths = synthesize(path, SynthOptions(**kw), threads=2)
            cache[key] = paths[0]
        return cache[key]
    return make


@pytest.fixture(scope="session")
def tiny_model(synth_model) -> Path:
    return synth_model()
