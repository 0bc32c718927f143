"""Common fixtures: synthetic models (built once per session), the vocabulary fixture shipped in
tests/fixtures/ (see its README: origin, MIT licence), and the `gpu` marker (skipped where CUDA
is unavailable). Nothing here reads outside the repository."""
from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
VOCAB = FIXTURES / "ggml-vocab-qwen35.gguf"


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
    if not VOCAB.exists():
        pytest.fail(f"the vocabulary fixture is missing from the repository: {VOCAB}")
    return VOCAB


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
