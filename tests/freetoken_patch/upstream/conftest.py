"""FreeToken 0.2.1 for the upstream tests: skipped with the reason where it is not importable,
a failure instead where FTPATCH_REQUIRE_FREETOKEN=1 (CI installs it)."""
from __future__ import annotations

import os

import pytest


def _freetoken_missing() -> str | None:
    try:
        import freetoken.models.gguf.experts  # noqa: F401  (the CPU-importable set)
        import freetoken.server.launch  # noqa: F401
    except Exception as exc:  # any import failure is the reason to report
        return f"FreeToken 0.2.1 is not importable ({type(exc).__name__}: {exc}); " \
               "pip install 'ftpatch[freetoken]' or see .ci/run"
    return None


@pytest.fixture(scope="session")
def freetoken():
    why = _freetoken_missing()
    if why:
        if os.environ.get("FTPATCH_REQUIRE_FREETOKEN") == "1":
            pytest.fail(why)
        pytest.skip(why)
    import freetoken as ft
    return ft


@pytest.fixture
def patched(freetoken, monkeypatch):
    """The patch applied for one test, reverted after it; banks unpinned (no GPU in CI)."""
    from freetoken_patch import upstream
    monkeypatch.setenv("FREETOKEN_SKIP_BANK_PIN", "1")
    upstream.apply()
    yield upstream
    upstream.revert()
