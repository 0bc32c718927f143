"""`ftpatch chat` driven through piped stdin: answers, commands, Ctrl-C, and bad input as one line.
The embedded default model is built once into a temporary cache directory."""
from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from freetoken_patch.cli.chat.screens import printable
from freetoken_patch.cli import main
from helpers import rewrite
from loaders import open_gguf

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")   # what must never reach the screen


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    from loaders.synth import ensure_default_model
    path = tmp_path_factory.mktemp("ftpatch-cache")
    old = os.environ.get("FTPATCH_CACHE")
    os.environ["FTPATCH_CACHE"] = str(path)
    try:
        ensure_default_model()
    finally:
        if old is None:
            del os.environ["FTPATCH_CACHE"]
        else:
            os.environ["FTPATCH_CACHE"] = old
    return path


@pytest.fixture(autouse=True)
def setup(cache_dir, monkeypatch):
    monkeypatch.setenv("FTPATCH_CACHE", str(cache_dir))
    n = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny tensors: fastest, and immune to a busy machine
    yield
    torch.set_num_threads(n)


def chat(monkeypatch, capsys, lines: str, *flags: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    rc = main(["chat", *flags])
    out, err = capsys.readouterr()
    return rc, out, err


def test_piped_messages_and_commands(monkeypatch, capsys):
    lines = ("hi\n/temp\n/temp 0\n/temp abc\n/stats\n/bogus\n/system be brief\n/system\n"
             "//slash first\n/reset\n/help\n/quit\nnever read\n")
    rc, out, err = chat(monkeypatch, capsys, lines, "-n", "4", "--seed", "1")
    assert rc == 1                                                      # /temp abc, /bogus
    assert "random weights, for trying the machinery" in err          # the label, on stderr
    assert "\x1b" not in out + err and not CONTROL.search(out)          # no escape codes
    err_lines = err.splitlines()
    assert [x for x in err_lines if x.startswith("temperature")] == [
        "temperature 0.8", "temperature 0 (greedy)"]
    errors = [x for x in err_lines if x.startswith("ftpatch: error: ")]
    assert len(errors) == 2 and "/temp abc: give a number" in errors[0]
    assert "unknown command /bogus; /help" in errors[1]
    # command output goes to stderr with the status lines: stdout holds the answers alone
    assert "last answer: 4 tokens" in err and "session: 1 answer," in err
    assert "stop: reached --max-tokens (4)" in err
    assert "context: " in err and " of 4096 tokens in use" in err
    assert "system prompt set; new conversation" in err and "system prompt: be brief" in err
    assert "new conversation" in err_lines and "/reset" in err           # /reset, then /help
    assert not any(w in out for w in ("temperature", "last answer", "system prompt", "/reset"))
    # two answers (hi, //slash first), each with a status line; /quit stops reading
    status = [line for line in err_lines if line.startswith("TTFT ")]
    assert len(status) == 2 and all("tok/s" in s and "answer 4 tok" in s for s in status)
    assert all("prompt " in s and "ctx " in s and s.endswith("| reached --max-tokens (4)")
               for s in status)


@pytest.fixture(params=["handler", "ignored"])
def sigint(request):
    """The SIGINT disposition the chat starts under, set here rather than inherited: Python's
    KeyboardInterrupt handler (an interactive shell), or ignored (a background job such as
    `nohup pytest &` starts with SIGINT ignored). Ctrl-C must work in both, and the chat must
    leave the disposition as it found it."""
    want = signal.default_int_handler if request.param == "handler" else signal.SIG_IGN
    old = signal.signal(signal.SIGINT, want)
    try:
        yield want
    finally:
        signal.signal(signal.SIGINT, old)


def test_ctrl_c_stops_the_answer_and_keeps_the_session(monkeypatch, capsys, sigint):
    from moe_offload.gen import Session
    original, calls = Session.chat, []

    def chat_with_ctrl_c(self, messages, params, enable_thinking=None):
        n = len(calls)
        calls.append((list(messages), self.state.n_past))
        for i, ev in enumerate(original(self, messages, params, enable_thinking)):
            if i == 2 and n < 2:
                signal.raise_signal(signal.SIGINT)      # 1st answer: one Ctrl-C, between tokens
                if n == 1:
                    signal.raise_signal(signal.SIGINT)  # 2nd answer: a second one, at once
            yield ev

    monkeypatch.setattr(Session, "chat", chat_with_ctrl_c)
    rc, out, err = chat(monkeypatch, capsys, "one\ntwo\nthree\n", "-n", "8", "--temp", "0")
    assert rc == 0 and len(calls) == 3
    assert signal.getsignal(signal.SIGINT) is sigint    # the disposition it found, restored
    status = [line for line in err.splitlines() if line.startswith("TTFT ")]
    assert "answer 3 tok" in status[0] and status[0].endswith("interrupted")
    assert "answer 2 tok" in status[1] and status[1].endswith("interrupted")
    assert "answer 8 tok" in status[2] and status[2].endswith("reached --max-tokens (8)")
    # the partial answers stay in the conversation
    assert [m["role"] for m in calls[2][0]] == ["user", "assistant"] * 2 + ["user"]
    partial = out.splitlines()[0]
    assert calls[1][0][1]["content"] and printable(calls[1][0][1]["content"]) == partial
    assert calls[1][1] > 0            # a clean stop keeps the cache ...
    assert calls[2][1] == 0           # ... a hard one drops it (the conversation is re-read)


def test_prompt_longer_than_the_context_then_the_session_goes_on(monkeypatch, capsys):
    rc, out, err = chat(monkeypatch, capsys, "word " * 80 + "\nhi\n", "--ctx", "40", "-n", "3",
                        "--seed", "1")
    assert rc == 1                    # piped: an error line makes the exit status 1 ...
    errors = [line for line in err.splitlines() if line.startswith("ftpatch: error: ")]
    assert len(errors) == 1 and "do not fit the context of 40" in errors[0]
    assert "--ctx" in errors[0] and "Traceback" not in err
    # ... and the second message was still answered (random weights: the 3 tokens may hold
    # newlines)
    assert out.strip() and err.count("answer 3 tok") == 1


def _no_tokenizer(cache_dir):
    from loaders.synth import default_model_path
    src = default_model_path()
    keys = [k for k in open_gguf(src).metadata if k.startswith("tokenizer.")]
    dst = cache_dir / "notok.gguf"
    return dst if dst.exists() else rewrite(src, dst, drop_keys=keys)


@pytest.mark.parametrize("flags,needle", [
    (["{missing}"], "no such file"),
    (["{notok}"], "no tokenizer metadata, so chat cannot read or write text"),
    (["-n", "0"], "-n 0: give 1 or more tokens, or -1 for no limit"),
    (["--ctx", "0"], "at least one token"),
    (["--device", "tpu"], "use cpu or cuda"),
])
def test_bad_input_is_one_line(cache_dir, monkeypatch, capsys, flags, needle):
    fill = dict(missing=cache_dir / "missing.gguf")
    if "{notok}" in flags:
        fill["notok"] = _no_tokenizer(cache_dir)
    rc, out, err = chat(monkeypatch, capsys, "hi\n", *[f.format(**fill) for f in flags])
    assert rc == 1 and out == ""
    err = err.strip().splitlines()[-1]
    assert err.startswith("ftpatch: error: ") and needle in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_vram_without_cuda(monkeypatch, capsys):
    rc, out, err = chat(monkeypatch, capsys, "hi\n", "--vram", "8GiB")
    assert rc == 1 and err.strip() == ("ftpatch: error: --vram puts the hot experts on a GPU and "
                                       "torch sees no CUDA device; run without --vram to use the CPU")


def test_printable_keeps_length_and_hides_controls():
    text = "a\x1b[31mb\tc\nd\x00\x7f\x85é"
    shown = printable(text)
    assert len(shown) == len(text) and not CONTROL.search(shown)
    assert "\t" in shown and "\n" in shown and shown.endswith("é")


@pytest.mark.slow
def test_the_console_script_with_a_pipe(cache_dir):
    env = dict(os.environ, FTPATCH_CACHE=str(cache_dir))
    p = subprocess.run(["ftpatch", "chat", "-n", "2", "--seed", "3"], input="hello\n/stats\n",
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "random weights" in p.stderr and "TTFT" in p.stderr
    assert "last answer: 2 tokens" in p.stderr and "\x1b" not in p.stdout + p.stderr
