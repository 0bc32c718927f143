"""--model as any shard of a split set or a folder, through FreeToken's own argument parser."""
from __future__ import annotations

from pathlib import Path

import pytest

from freetoken_patch.upstream.paths import resolve_model_path, rewrite_argv


@pytest.fixture(scope="module")
def split_set(synth_model, tmp_path_factory):
    """A split set alone in its folder (the synth fixture's folder holds other models)."""
    import shutil

    from loaders.gguf_file import split_paths
    folder = tmp_path_factory.mktemp("split")
    paths = [Path(shutil.copy(p, folder)) for p in
             split_paths(synth_model(type="IQ3_S", split_max_size=400_000))]
    assert len(paths) > 2
    return paths


def test_any_shard_and_folder_resolve_to_shard_one(split_set):
    first = str(split_set[0])
    for p in split_set:
        assert resolve_model_path(str(p)) == first
    assert resolve_model_path(str(split_set[0].parent)) == first


def test_projector_beside_the_model_is_ignored(tmp_path, tiny_model):
    import shutil
    shutil.copy(tiny_model, tmp_path / "model.gguf")
    (tmp_path / "mmproj-model-f16.gguf").write_bytes(b"")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path / "model.gguf")


def test_other_paths_pass_untouched(tmp_path, tiny_model):
    assert resolve_model_path(str(tiny_model)) == str(tiny_model)
    assert resolve_model_path("Qwen/Qwen3.6-35B-A3B") == "Qwen/Qwen3.6-35B-A3B"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "extra.gguf").write_bytes(b"")
    assert resolve_model_path(str(hf)) == str(hf)


def test_argv_spellings(split_set):
    s3, first = str(split_set[2]), str(split_set[0])
    assert rewrite_argv(["--model", s3, "--port", "1"]) == ["--model", first, "--port", "1"]
    assert rewrite_argv([f"--model-path={s3}"]) == [f"--model-path={first}"]


def test_freetoken_parser_takes_a_later_shard(patched, split_set):
    from freetoken.server.args import parse_args
    server_args, _ = parse_args(["--model", str(split_set[2])])
    assert server_args.model_path == str(split_set[0])
    server_args, _ = parse_args([f"--model={split_set[0].parent}"])
    assert server_args.model_path == str(split_set[0])


def test_folder_with_two_models_is_one_line_error(patched, tmp_path, tiny_model):
    import shutil
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(tiny_model, tmp_path / name)
    from freetoken.server.args import parse_args
    with pytest.raises(SystemExit, match="more than one model"):
        parse_args(["--model", str(tmp_path)])
