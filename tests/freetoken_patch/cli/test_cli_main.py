"""The entry point's manners: a reader that goes away (`ftpatch ... | head`) ends the command
quietly, as any Unix tool does."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("args", [["doctor", "--json"], ["--version"], ["--help"]])
def test_a_closed_pipe_ends_quietly(args):
    """stdout is a pipe whose reader is gone before the command writes: no traceback, no
    '[Errno 32] Broken pipe', and the status of a process SIGPIPE ended (or 0 where argparse
    swallows the error itself)."""
    r, w = os.pipe()
    os.close(r)                      # the reader is gone: every write fails with EPIPE
    from helpers import child_env, ftpatch_cmd
    p = subprocess.run(ftpatch_cmd(*args), stdout=w, stderr=subprocess.PIPE, text=True,
                       env=child_env(), timeout=120)
    os.close(w)
    assert p.stderr == "", p.stderr
    assert p.returncode in (0, 141)
