"""``ft serve --model`` given any shard of a split GGUF, or the folder holding the model, through the server's own parser."""

from __future__ import annotations

import os
import struct

import pytest

from freetoken.server.args import parse_args


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_model(folder, stem: str = "model", count: int = 1) -> list[str]:
    """A GGUF the parser can read (metadata, a vocabulary, an F32 token embedding), split over ``count`` files as
    llama.cpp's gguf-split names and marks them: the metadata in the first, ``split.*`` keys in every one."""
    tokens = ["<|endoftext|>", "a", "b", "c"]
    head = [_kv("general.architecture", 8, _str("qwen35moe")),
            _kv("tokenizer.ggml.model", 8, _str("gpt2")),
            _kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, len(tokens)) + b"".join(map(_str, tokens)))]
    paths = []
    for i in range(count):
        kv = list(head) if i == 0 else []
        if count > 1:
            kv += [_kv("split.no", 2, struct.pack("<H", i)), _kv("split.count", 2, struct.pack("<H", count)),
                   _kv("split.tensors.count", 5, struct.pack("<i", 1))]
        tensors = [("token_embd.weight", (8, len(tokens)))] if i == 0 else []
        out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv)
        for name, ne in tensors:
            out += _str(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, 0, 0)
        out += bytes(-len(out) % 32) + bytes(4 * sum(ne[0] * ne[1] for _, ne in tensors))
        name = f"{stem}-{i + 1:05d}-of-{count:05d}.gguf" if count > 1 else f"{stem}.gguf"
        paths.append(os.path.join(folder, name))
        with open(paths[-1], "wb") as f:
            f.write(out)
    return paths


def test_a_later_shard_serves_the_set(tmp_path):
    paths = write_model(str(tmp_path), count=17)
    server_args, _ = parse_args(["--model", paths[2]])
    assert server_args.model_path == paths[0]


def test_the_folder_of_a_split_set(tmp_path):
    paths = write_model(str(tmp_path), count=17)
    server_args, _ = parse_args(["--model", str(tmp_path)])
    assert server_args.model_path == paths[0]


def test_the_folder_of_one_file_beside_its_vision_tower(tmp_path):
    (path,) = write_model(str(tmp_path))
    (tmp_path / "mmproj-model-f16.gguf").write_bytes(b"")
    server_args, _ = parse_args(["--model", str(tmp_path)])
    assert server_args.model_path == path


def test_a_folder_of_two_models_is_a_usage_error(tmp_path, capsys):
    write_model(str(tmp_path), "a", count=3)
    write_model(str(tmp_path), "b")
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path)])
    assert "holds 2 GGUF models (a, b.gguf)" in capsys.readouterr().err


def test_a_set_without_its_first_shard_is_a_usage_error(tmp_path, capsys):
    paths = write_model(str(tmp_path), count=3)
    os.remove(paths[0])
    with pytest.raises(SystemExit):
        parse_args(["--model", paths[1]])
    assert "first shard model-00001-of-00003.gguf is not beside it" in capsys.readouterr().err
