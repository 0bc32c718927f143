"""--model given as any shard of a split GGUF or as the folder that holds it."""

import argparse
import os
import struct

import pytest

from freetoken.models.gguf.reader import resolve_gguf_model_path


def _kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


def _kv_u16(key: str, value: int) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IH", 2, value)


def write_split_set(folder, stem="model", count=3):
    """Header-only shards as llama.cpp's gguf-split names them; metadata in the first only."""
    paths = []
    for i in range(count):
        kv = [_kv_u16("split.no", i), _kv_u16("split.count", count)]
        if i == 0:
            kv.insert(0, _kv_string("general.architecture", "qwen35moe"))
        path = os.path.join(folder, f"{stem}-{i + 1:05d}-of-{count:05d}.gguf")
        with open(path, "wb") as f:
            f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv))
        paths.append(path)
    return paths


def test_any_shard_resolves_to_the_first(tmp_path):
    paths = write_split_set(str(tmp_path))
    assert [resolve_gguf_model_path(p) for p in paths] == [paths[0]] * 3


def test_folder_resolves_to_its_model_ignoring_projectors(tmp_path):
    paths = write_split_set(str(tmp_path))
    (tmp_path / "mmproj-model-f16.gguf").write_bytes(b"")
    assert resolve_gguf_model_path(str(tmp_path)) == paths[0]
    single = tmp_path / "one"
    single.mkdir()
    (single / "m.gguf").write_bytes(b"GGUF")
    assert resolve_gguf_model_path(str(single)) == str(single / "m.gguf")


def test_other_paths_unchanged(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "x.gguf").write_bytes(b"")
    assert resolve_gguf_model_path(str(hf)) == str(hf)
    assert resolve_gguf_model_path("Qwen/Qwen3.6-35B-A3B") == "Qwen/Qwen3.6-35B-A3B"
    (tmp_path / "m.gguf").write_bytes(b"")
    assert resolve_gguf_model_path(str(tmp_path / "m.gguf")) == str(tmp_path / "m.gguf")


def test_two_models_in_a_folder_is_an_error(tmp_path):
    write_split_set(str(tmp_path), "a")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 GGUF models"):
        resolve_gguf_model_path(str(tmp_path))


def test_missing_first_shard_is_an_error(tmp_path):
    paths = write_split_set(str(tmp_path))
    os.remove(paths[0])
    with pytest.raises(FileNotFoundError, match="first shard"):
        resolve_gguf_model_path(paths[1])


def test_parser_resolves_before_reading_the_model(tmp_path, monkeypatch):
    """The server's parser hands the first shard on: it fails reading our header-only shard's
    config, after the path was resolved (the error names the first shard)."""
    from freetoken.server import args as server_args

    paths = write_split_set(str(tmp_path))
    seen = []
    monkeypatch.setattr("freetoken.models.gguf.reader.resolve_gguf_model_path",
                        lambda p: seen.append(p) or resolve_gguf_model_path(p))
    with pytest.raises(BaseException):
        server_args.parse_args(["--model", paths[2]])
    assert seen == [paths[2]]
