"""scripts/agents/claude_code.sh: the pinned Claude Code (npm) against `ftpatch serve` on the
tiny model, `claude -p` in json and stream-json modes. Where node and npm are present and the
package is installed or installable; skipped otherwise (the script exits 77)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]


@pytest.mark.slow
def test_claude_code_smoke():
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are not installed")
    from helpers import child_env
    env = child_env(PYTHON=sys.executable)   # the script starts the server with python -P
    r = subprocess.run(["bash", str(ROOT / "scripts/agents/claude_code.sh")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    if r.returncode == 77:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "json: ok" in r.stderr and "stream-json: ok" in r.stderr
