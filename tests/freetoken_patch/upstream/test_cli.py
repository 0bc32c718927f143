"""`ftpatch freetoken` and `ftpatch pr-notes` through the command line's own parser."""
from __future__ import annotations

import json

import numpy as np

from freetoken_patch.cli import main


def test_doctor_reports_hooks_here_and_in_a_child(freetoken, capsys):
    try:
        assert main(["freetoken", "doctor", "--json"]) == 0
    finally:
        from freetoken_patch import upstream
        upstream.revert()
    r = json.loads(capsys.readouterr().out)
    assert r["version"] == "0.2.1" and r["refused"] is None
    assert all(r["hooks"].values()) and all(r["child_hooks"].values())


def test_profile_command(freetoken, tmp_path, capsys):
    from freetoken.moe.pool_policy import load_profile
    counts = np.arange(4 * 16).reshape(4, 16) % 7
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"model": "", "counts": counts.tolist()}))
    out = tmp_path / "ft.json"
    assert main(["freetoken", "profile", str(ours), "-o", str(out),
                 "--model-path", "/m/Q-IQ3_S-00002-of-00003.gguf"]) == 0
    assert json.loads(out.read_text())["model"] == "Q-IQ3_S"
    assert load_profile(out, 4, 16).shape == (4, 16)


def test_pr_notes_build_writes_series_and_text(freetoken, tmp_path, monkeypatch, capsys):
    from pathlib import Path
    monkeypatch.setenv("FTPATCH_PR_NOTES", str(Path(__file__).resolve().parents[3] / "pr_notes"))
    site = Path(freetoken.__file__).parents[1]
    assert main(["pr-notes", "build", "1", "--freetoken", str(site), "--out", str(tmp_path),
                 "--author", "A B <a@example.com>"]) == 0
    patches = sorted((tmp_path / "patches").glob("*.patch"))
    assert patches and "From: A B <a@example.com>" in patches[0].read_text()
    assert (tmp_path / "1.diff").read_text().startswith(
        "diff --git a/python/freetoken/models/gguf/config.py")
    assert (tmp_path / "upstream" / "python" / "freetoken" / "models" / "gguf" / "reader.py").is_file()
    text = (tmp_path / "1.md").read_text()
    assert "{{" not in text and "- [ ] Run and read by the person who opens it" in text
    assert "1 patch(es)" in capsys.readouterr().out


def test_freetoken_help_without_freetoken(monkeypatch, capsys):
    """Every `ftpatch freetoken` command's --help works where FreeToken is not installed, and
    says what the [freetoken] extra costs."""
    import sys

    import pytest

    from freetoken_patch.cli import freetoken as cmd
    monkeypatch.setitem(sys.modules, "freetoken", None)   # any import of it fails
    monkeypatch.setattr(cmd, "freetoken_installed", lambda: False)
    assert main(["freetoken", "serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: ftpatch freetoken serve" in out and "FreeToken is not installed here" in out
    assert "18 CUDA and NVIDIA wheels" in out and "pip install --no-deps freetoken==0.2.1" in out
    for sub in (["doctor"], ["profile"], []):
        with pytest.raises(SystemExit) as e:
            main(["freetoken", *sub, "--help"])
        assert e.value.code == 0
        assert "torch 2.14 built for CUDA 13" in capsys.readouterr().out


def test_serve_help_lists_freetoken_flags(freetoken, capsys):
    assert main(["freetoken", "serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert "FreeToken's `ft serve` flags" in out and "--model-path MODEL_PATH" in out


def test_doctor_times_a_model_header(freetoken, synth_model, capsys):
    try:
        assert main(["freetoken", "doctor", "--no-child", "--model", str(synth_model()),
                     "--compare"]) == 0
    finally:
        from freetoken_patch import upstream
        upstream.revert()
    out = capsys.readouterr().out
    assert "s with the patch" in out and "same metadata and tensor index" in out


def test_serve_passes_its_arguments_to_freetoken(freetoken, monkeypatch):
    """FreeToken's own entry point gets `serve` and every argument, with the patch applied.
    (FreeToken's server itself needs its web stack and a GPU: not run here.)"""
    from freetoken_patch import upstream
    seen = []
    monkeypatch.setattr("freetoken.cli.main",
                        lambda argv: seen.append((list(argv), upstream.applied())) or 0)
    try:
        assert main(["freetoken", "serve", "--model", "m.gguf", "--port", "8000"]) == 0
    finally:
        upstream.revert()
    argv, hooks_applied = seen[0]
    assert argv == ["serve", "--model", "m.gguf", "--port", "8000"]
    assert all(hooks_applied.values())
