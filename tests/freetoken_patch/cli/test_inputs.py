"""Bad input at the edge (issue #18, CLI side): text that is not UTF-8, numbers out of range, and
the rough edges of the commands' output and help. Every refusal is one line on stderr, exit 1."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pytest

from freetoken_patch.cli import main
from freetoken_patch.cli.inputs import displayable
from helpers import rewrite
from loaders.tokenizer import Tokenizer

BAD = "\udcff\udcfe hi"          # how Python hands over argv bytes b"\xff\xfe hi"


def _one_error_line(capsys, needle: str = "") -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftpatch: error: "), err
    assert needle in lines[0], lines[0]
    return lines[0]


def _bytes_stdin(monkeypatch, data: bytes, errors: str = "strict") -> None:
    """stdin as a real process has it: bytes underneath, decoded as the locale says."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), "utf-8", errors))


# ---- text that is not UTF-8 -------------------------------------------------------------------

def test_displayable_keeps_good_text_and_replaces_bad_bytes():
    assert displayable("héllo") == "héllo"
    assert displayable(BAD) == "\ufffd\ufffd hi"
    assert displayable("a\ud800b") == "a\ufffd\ufffd\ufffdb"     # a surrogate not from argv


def test_run_and_logits_read_the_bytes_given(tiny_model, tmp_path, capsys):
    assert main(["run", str(tiny_model), "-p", BAD, "-n", "2", "--seed", "1"]) == 0
    assert main(["run", str(tiny_model), "-p", BAD, "-n", "2", "--chat"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    # the model reads the bytes b"\xff\xfe hi", not replacement characters
    tok = Tokenizer.from_gguf(tiny_model)
    ids = tok.encode(b"\xff\xfe hi", add_special=True, parse_special=True)
    assert ids != tok.encode("\ufffd\ufffd hi", add_special=True, parse_special=True)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert main(["logits", str(tiny_model), "--prompt", BAD, "--out", str(a)]) == 0
    assert main(["logits", str(tiny_model), "--tokens", ",".join(map(str, ids)),
                 "--out", str(b)]) == 0
    assert np.array_equal(np.load(a), np.load(b))


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])   # UTF-8 locale, C locale
def test_tokenize_reads_bytes_that_are_not_utf8(tiny_model, capsys, monkeypatch, errors):
    assert main(["tokenize", str(tiny_model), BAD]) == 0
    from_argv = capsys.readouterr().out
    assert "b'\\xff'" in from_argv and "b'\\xfe'" in from_argv        # byte tokens
    _bytes_stdin(monkeypatch, b"\xff\xfe hi", errors)
    assert main(["tokenize", str(tiny_model), "-"]) == 0
    assert capsys.readouterr().out == from_argv


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_piped_chat_answers_a_line_that_is_not_utf8_and_goes_on(tiny_model, capsys, monkeypatch,
                                                                 errors):
    _bytes_stdin(monkeypatch, b"hi\n\xff\xfe hi\n/system \xff be brief\n/system\nagain\n"
                              b"/stats\n", errors)
    assert main(["chat", str(tiny_model), "-n", "2", "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error" not in err
    assert "system prompt: \ufffd be brief" in err                  # shown back displayable
    status = [line for line in err.splitlines() if line.startswith("TTFT ")]
    assert len(status) == 3 and "session: 3 answers" in err


@pytest.mark.slow
def test_the_console_script_with_bytes_that_are_not_utf8(tiny_model):
    env = dict(os.environ, LC_ALL="C.UTF-8")
    p = subprocess.run([b"ftpatch", b"run", os.fsencode(tiny_model), b"-p", b"\xff\xfe hi",
                        b"-n", b"2"], capture_output=True, env=env, timeout=120)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr
    p = subprocess.run(["ftpatch", "chat", str(tiny_model), "-n", "2"], input=b"\xff\xfe hi\n",
                       capture_output=True, env=env, timeout=120)
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr
    assert b"TTFT" in p.stderr


# ---- numbers at the edge ----------------------------------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    (["--ctx", "0"], "--ctx 0: the context needs at least one token"),
    (["--ctx", "-5"], "--ctx -5"),
    (["--ctx", "5000"], "trained for 4096 tokens; give --ctx 4096 or less, or add --allow-long-ctx"),
    (["--temp", "nan"], "--temp nan: give a number >= 0"),
    (["--temp", "-1"], "--temp -1: give a number >= 0"),
    (["--temp", "inf"], "--temp inf"),
    (["--top-p", "0"], "--top-p 0: give a number above 0 and at most 1"),
    (["--top-p", "1.5"], "--top-p 1.5"),
    (["--top-p", "nan"], "--top-p nan"),
    (["--top-k", "-1"], "--top-k -1: give 0 (off) or more"),
    (["--min-p", "-0.1"], "--min-p -0.1"),
    (["--min-p", "1.5"], "--min-p 1.5: give a number from 0 (off) to 1"),
    (["--repeat-penalty", "0"], "--repeat-penalty 0: give a number above 0"),
    (["--repeat-penalty", "nan"], "--repeat-penalty nan"),
    (["--presence-penalty", "inf"], "--presence-penalty inf: give a finite number"),
    (["--frequency-penalty", "nan"], "--frequency-penalty nan: give a finite number"),
    (["--seed", "-1"], "--seed -1: give a whole number from 0"),
    (["--seed", str(2**64)], "--seed 18446744073709551616"),
    (["-n", "0"], "-n 0: give 1 or more tokens, or -1 for no limit"),
    (["-n", "-2"], "-n -2"),
    (["--device", "cuda:x"], "write cuda:N"),
])
@pytest.mark.parametrize("command", ["run", "chat"])
def test_numbers_out_of_range_are_one_line(tiny_model, capsys, monkeypatch, command, flags,
                                           needle):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    args = [command, str(tiny_model)] + (["-p", "hi"] if command == "run" else []) + flags
    assert main(args) == 1
    _one_error_line(capsys, needle)


@pytest.mark.parametrize("args,needle", [
    (["inspect", "{m}", "--ctx", "-1"], "--ctx -1: give 1 or more"),
    (["inspect", "{m}", "--ctx", "0"], "--ctx 0"),
    (["logits", "{m}", "--tokens", "1", "--ctx", "9999", "--out", "{tmp}/x.npy"],
     "trained for 4096 tokens"),
    (["synth", "-o", "{tmp}/x.gguf", "--seed", "-1"], "--seed -1"),
    (["synth", "-o", "{tmp}/x.gguf", "--layers", "0"], "--layers 0: give 1 or more"),
    (["synth", "-o", "{tmp}/x.gguf", "--routing-skew", "nan"], "--routing-skew nan"),
    (["synth", "-o", "{tmp}/x.gguf", "--threads", "0"], "--threads 0"),
    (["bench", "{m}", "-n", "0"], "-n 0: give 1 or more"),
    (["bench", "{m}", "--reps", "0"], "--reps 0"),
    (["bench", "{m}", "-p", "512,-1"], "-p '512,-1'"),
    (["bench", "{m}", "--fetch-fraction", "2"], "--fetch-fraction 2: give a number from 0 to 1"),
])
def test_other_commands_check_their_numbers(tiny_model, tmp_path, capsys, args, needle):
    fill = dict(m=tiny_model, tmp=tmp_path)
    assert main([a.format(**fill) for a in args]) == 1
    _one_error_line(capsys, needle)


def test_long_context_on_request_and_no_limit(tiny_model, capsys):
    assert main(["run", str(tiny_model), "-p", "hi", "--ctx", "5000", "--allow-long-ctx",
                 "-n", "1"]) == 0
    assert main(["run", str(tiny_model), "-p", "hi", "--ctx", "12", "-n", "-1", "--seed",
                 "2"]) == 0
    first, second = [ln for ln in capsys.readouterr().err.splitlines() if "stop:" in ln]
    # -n 1 ends at one token, unless the first one sampled (no --seed) ends the text
    assert "stop: reached --max-tokens (1)" in first or (
        "generated: 1 token," in first and "stop: end of text" in first), first
    assert ("stop: the context is full (12 tokens; see --ctx)" in second
            or "stop: end of text" in second)


def test_out_of_memory_is_one_line(tiny_model, capsys, monkeypatch):
    from moe_offload.models import qwen35moe

    def no_memory(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 512000000000 bytes.")
    monkeypatch.setattr(qwen35moe.Qwen35Moe, "new_state", no_memory)
    assert main(["run", str(tiny_model), "-p", "hi", "--ctx", "4000"]) == 1
    _one_error_line(capsys, "out of memory (476.8 GiB asked for); a smaller --ctx needs less")


# ---- rough edges ------------------------------------------------------------------------------

def test_logits_writes_exactly_the_path_given(tiny_model, tmp_path, capsys):
    out = tmp_path / "l3"
    assert main(["logits", str(tiny_model), "--tokens", "1,2,3", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"to {out}")
    assert out.exists() and not (tmp_path / "l3.npy").exists()
    assert np.load(out).shape[0] == 3


@pytest.mark.parametrize("command", [["inspect"], ["run", "-p", "hi"], ["chat"]])
def test_a_missing_architecture_names_the_file(tiny_model, tmp_path, capsys, monkeypatch,
                                               command):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    bad = rewrite(tiny_model, tmp_path / "noarch.gguf", drop_keys=["general.architecture"])
    assert main([command[0], str(bad), *command[1:]]) == 1
    line = _one_error_line(capsys, str(bad))
    assert "architecture" in line


def test_inspect_says_when_cuda_is_built_without_a_gpu(tiny_model, capsys, monkeypatch):
    import importlib.util

    import torch
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "native._cuda" else find_spec(name, *a))
    assert main(["inspect", str(tiny_model)]) == 0
    out = capsys.readouterr().out
    assert "built, no GPU" in out
    assert main(["inspect", str(tiny_model), "--json"]) == 0
    assert '"cuda_engine": "built, no GPU"' in capsys.readouterr().out


def test_version_names_the_build(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("ftpatch ") and "CPU kernels: " in out and "CUDA kernels: " in out


@pytest.mark.parametrize("command", ["inspect", "synth", "tokenize", "logits", "run", "chat",
                                     "bench"])
def test_every_command_has_examples(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    examples = [line for line in out[out.index("\nexamples:\n"):].splitlines()[2:]
                if line.startswith("  ")]
    assert any(line.startswith("  ftpatch ") for line in examples), out
    for line in examples:       # a comment after an example starts with '#'
        assert "   " not in line.strip().split("#")[0].rstrip(), line


def test_flags_are_named_the_same_everywhere(tiny_model, capsys):
    with pytest.raises(SystemExit):
        main(["synth", "--help"])
    assert "default tiny" in capsys.readouterr().out
    for command in ("run", "chat"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "-n N, --max-tokens N" in out and "--n-predict" not in out
    # llama.cpp's spelling still works on run
    assert main(["run", str(tiny_model), "-p", "hi", "--n-predict", "2", "--seed", "1"]) == 0
    assert "reached --max-tokens (2)" in capsys.readouterr().err
