"""`ftpatch serve`: the missing extra is one line; the flags build the served model; Ctrl-C
(SIGINT) lets a request in flight finish, then the process exits 0."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from freetoken_patch.cli import main


def test_without_the_extra_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)      # import uvicorn -> ImportError
    assert main(["serve"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ftpatch: error: ftpatch serve needs the server packages (import of uvicorn "
                   "halted; None in sys.modules): pip install 'ftpatch[serve]'"]


def test_flags_are_checked(capsys):
    pytest.importorskip("fastapi")
    assert main(["serve", "--parallel", "0"]) == 1
    assert "--parallel 0: give 1 to 256" in capsys.readouterr().err


def test_parallel_defaults_to_one_under_vram(monkeypatch, capsys):
    """Several sequences under a cap are asked for (--parallel), not the default: --vram alone
    resolves --parallel to 1 before anything loads (here the CPU-only machine stops it next)."""
    pytest.importorskip("fastapi")
    from freetoken_patch.cli import build_parser
    from freetoken_patch.cli import serve
    seen = {}

    def load(args):
        seen["parallel"] = args.parallel
        raise SystemExit(3)
    monkeypatch.setattr(serve, "load", load)
    for argv, want in ((["serve", "--vram", "8GiB"], 1), (["serve"], 4),
                       (["serve", "--vram", "8GiB", "--parallel", "3"], 3)):
        seen.clear()
        args = build_parser().parse_args(argv)
        with pytest.raises(SystemExit):
            serve.run(args)
        assert seen["parallel"] == want, argv


def test_load_builds_the_served_model(tiny_model):
    pytest.importorskip("fastapi")
    from freetoken_patch.cli import build_parser
    from freetoken_patch.cli.serve import load, model_id
    args = build_parser().parse_args(["serve", str(tiny_model), "--ctx", "128", "--parallel", "2",
                                      "--api-key", "k"])
    served = load(args)
    assert (served.model_id, served.n_ctx, served.api_key) == (tiny_model.stem, 128, "k")
    assert served.engine.parallel == 2 and not served.engine.single_state
    assert model_id("/m/Qwen3.5-35B-A3B-IQ3_S-00001-of-00003.gguf") == "Qwen3.5-35B-A3B-IQ3_S"


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_sigint_drains_then_exits(tiny_model):
    pytest.importorskip("fastapi")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from helpers import child_env, ftpatch_cmd
    proc = subprocess.Popen(ftpatch_cmd("serve", str(tiny_model), "--port", str(port), "--ctx", "128"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(PYTHONUNBUFFERED="1"))
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        body = {"prompt": "Once", "max_tokens": 12, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGINT)            # mid-stream
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(first[6:])["object"] == "text_completion"
        assert rest[-1] == "data: [DONE]"             # the stream ran to its end
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest[:-1]]
        assert finish[-1] in ("length", "stop")
        assert proc.wait(60) == 0
        assert proc.stderr.read().strip().endswith("ftpatch serve: stopped")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
