"""`ftpatch tokenize` through the CLI entry point."""
import io
import json

import pytest

from freetoken_patch.cli import main
from helpers import build_gguf


def test_ids_and_pieces_one_per_line(vocab_path, capsys):
    assert main(["tokenize", str(vocab_path), "Hello world 家"]) == 0
    assert capsys.readouterr().out == (
        "  9707  'Hello'\n"
        "  1879  ' world'\n"
        " 41479  b' \\xe5\\xae'\n"             # half a character: shown as bytes
        "   114  b'\\xb6'\n")


def test_special_and_json(vocab_path, capsys):
    text = "<|im_start|>user\n<|im_end|>"
    assert main(["tokenize", str(vocab_path), text, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert 151644 not in plain["ids"] and "".join(plain["pieces"]) == text
    assert main(["tokenize", str(vocab_path), text, "--special", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ids"] == [151644, 872, 198, 151645] and d["n_tokens"] == 4
    assert d["pieces"] == ["<|im_start|>", "user", "\n", "<|im_end|>"]


def test_stdin_and_the_builtin_vocabulary(tiny_model, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello, world!\n"))
    assert main(["tokenize", str(tiny_model), "-", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "".join(d["pieces"]) == "Hello, world!\n" and len(d["ids"]) < 14


@pytest.mark.parametrize("kv,needle", [
    ([("general.architecture", 8, "qwen35moe", None)], "has no tokenizer"),
    ([("tokenizer.ggml.tokens", 9, ["a", "b"], 8), ("tokenizer.ggml.pre", 8, "weird", None)],
     "unsupported pre-tokenizer tokenizer.ggml.pre = 'weird'; supported: llama-bpe, qwen2"),
])
def test_errors_are_one_line(tmp_path, capsys, kv, needle):
    path = tmp_path / "m.gguf"
    path.write_bytes(build_gguf(kv, []))
    assert main(["tokenize", str(path), "hi"]) == 1
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and err.startswith("ftpatch: error:")


def test_missing_file(capsys):
    assert main(["tokenize", "/nonexistent/model.gguf", "hi"]) == 1
    assert "no such file" in capsys.readouterr().err
