"""loaders.gguf_file: every value type, v2/v3, alignment, zero-copy data, splits, broken files."""
import struct

import gguf
import numpy as np
import pytest

from helpers import build_gguf
from loaders import GGUFError, open_gguf
from loaders.synth import SynthOptions, synthesize

Q8 = int(gguf.GGMLQuantizationType.Q8_0)
F32 = int(gguf.GGMLQuantizationType.F32)


def _f32_tensor(name, values):
    arr = np.asarray(values, np.float32)
    return (name, tuple(reversed(arr.shape)), F32, arr.tobytes())


def _basic(**kw) -> bytes:
    return build_gguf([("general.architecture", 8, "test", None)],
                      [_f32_tensor("a", np.arange(8)), _f32_tensor("b", np.ones((2, 4)))], **kw)


def test_opens_the_vocab_fixture_and_matches_gguf_py(vocab_path):
    f = open_gguf(vocab_path)
    toks = f.metadata["tokenizer.ggml.tokens"]
    assert len(toks) == 151936 and toks[0] == "!"
    assert len(f.metadata["tokenizer.ggml.merges"]) == 151387
    assert f.metadata["tokenizer.ggml.pre"] == "qwen35"
    assert f.metadata["tokenizer.ggml.token_type"].dtype == np.int32


def test_opens_a_248k_token_vocabulary(tmp_path, vocab_path):
    path = synthesize(tmp_path / "v.gguf", SynthOptions(vocab=str(vocab_path), n_layer=1),
                      threads=2)[0]
    # pad to the real model's 248,320 tokens by rewriting only the metadata
    from helpers import rewrite
    f = open_gguf(path)
    toks = f.metadata["tokenizer.ggml.tokens"]
    toks = toks + [f"[PAD{i}]" for i in range(len(toks), 248320)]
    big = rewrite(path, tmp_path / "big.gguf", metadata={"tokenizer.ggml.tokens": ("arr", toks, "str")})
    g = open_gguf(big)
    assert g.metadata["tokenizer.ggml.tokens"] == toks


def test_every_value_type_and_nested_arrays(tmp_path):
    kv = [("u8", 0, 255, None), ("i8", 1, -5, None), ("u16", 2, 65535, None), ("i16", 3, -300, None),
          ("u32", 4, 4_000_000_000, None), ("i32", 5, -2_000_000_000, None), ("f32", 6, 1.5, None),
          ("bool", 7, True, None), ("str", 8, "héllo", None), ("u64", 10, 2**63 + 5, None),
          ("i64", 11, -2**62, None), ("f64", 12, 2.25, None),
          ("arr_i32", 9, [1, -2, 3], 5), ("arr_str", 9, ["a", "", "ç"], 8),
          ("arr_bool", 9, [True, False], 7), ("arr_f64", 9, [0.5], 12),
          ("arr_arr", 9, [(4, [1, 2]), (8, ["x"])], 9)]
    p = tmp_path / "kv.gguf"
    p.write_bytes(build_gguf(kv, []))
    md = open_gguf(p).metadata
    assert md["u8"] == 255 and md["i8"] == -5 and md["u16"] == 65535 and md["i16"] == -300
    assert md["u32"] == 4_000_000_000 and md["i32"] == -2_000_000_000 and md["f32"] == 1.5
    assert md["bool"] is True and md["str"] == "héllo" and md["u64"] == 2**63 + 5
    assert md["i64"] == -2**62 and md["f64"] == 2.25
    assert md["arr_i32"].tolist() == [1, -2, 3] and md["arr_i32"].dtype == np.int32
    assert md["arr_str"] == ["a", "", "ç"] and md["arr_bool"].tolist() == [True, False]
    assert md["arr_f64"].tolist() == [0.5]
    assert md["arr_arr"][0].tolist() == [1, 2] and md["arr_arr"][1] == ["x"]


@pytest.mark.parametrize("version", [2, 3])
def test_versions_2_and_3(tmp_path, version):
    p = tmp_path / "v.gguf"
    p.write_bytes(_basic(version=version))
    f = open_gguf(p)
    assert f.version == version
    np.testing.assert_array_equal(f.data("a").view(np.float32).ravel(), np.arange(8))


def test_custom_alignment_and_zero_copy(tmp_path):
    kv = [("general.architecture", 8, "test", None), ("general.alignment", 4, 64, None)]
    p = tmp_path / "al.gguf"
    p.write_bytes(build_gguf(kv, [_f32_tensor("a", np.arange(3)), _f32_tensor("b", [7, 8])],
                             alignment=64))
    f = open_gguf(p)
    assert f.alignment == 64
    assert all(t.offset % 64 == 0 for t in f)
    b = f.data("b")
    assert b.base is not None and not b.flags.owndata  # a view into the map, not a copy
    assert b.view(np.float32).ravel().tolist() == [7.0, 8.0]
    assert f.tensors["b"].shape == (2,) and f.tensors["b"].n_elements == 2


def test_synth_file_agrees_with_gguf_py_reader(tiny_model):
    r = gguf.GGUFReader(tiny_model)
    f = open_gguf(tiny_model)
    assert len(r.tensors) == len(f.tensors)
    for t in r.tensors:
        o = f.tensors[t.name]
        assert o.type_id == int(t.tensor_type) and o.ne == tuple(int(x) for x in t.shape)
        assert o.offset == t.data_offset and o.nbytes == t.n_bytes
        assert np.array_equal(np.asarray(t.data).view(np.uint8).ravel(), f.data(t.name).ravel())


# ---- broken files ---------------------------------------------------------------------------------

def _write(tmp_path, data: bytes, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_not_a_gguf(tmp_path):
    with pytest.raises(GGUFError, match="not a GGUF file"):
        open_gguf(_write(tmp_path, b"PK\x03\x04 zip file"))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        open_gguf(_write(tmp_path, b"", "empty.gguf"))


def test_missing_file_and_folder_without_model(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        open_gguf(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="holds no .gguf"):
        open_gguf(tmp_path)


def test_unsupported_version_and_big_endian(tmp_path):
    data = bytearray(_basic())
    data[4:8] = struct.pack("<I", 1)
    with pytest.raises(GGUFError, match="unsupported GGUF version 1"):
        open_gguf(_write(tmp_path, bytes(data)))
    data[4:8] = struct.pack(">I", 3)
    with pytest.raises(GGUFError, match="big-endian"):
        open_gguf(_write(tmp_path, bytes(data)))


@pytest.mark.parametrize("cut", [6, 20, 30, 60, 110])
def test_truncated_header(tmp_path, cut):
    data = _basic()
    with pytest.raises(GGUFError, match="truncated|corrupt"):
        open_gguf(_write(tmp_path, data[:cut]))


def test_truncated_data(tmp_path):
    data = _basic()
    with pytest.raises(GGUFError, match="tensor 'b' data .* runs past the end of the file"):
        open_gguf(_write(tmp_path, data[:-8]))


def test_tensor_offset_past_end(tmp_path):
    data = build_gguf([], [_f32_tensor("a", np.arange(8))], offsets=[1 << 20])
    with pytest.raises(GGUFError, match="runs past the end"):
        open_gguf(_write(tmp_path, data))


def test_unaligned_offset(tmp_path):
    data = build_gguf([], [_f32_tensor("a", np.arange(8))], offsets=[4])
    with pytest.raises(GGUFError, match="not a multiple of the alignment"):
        open_gguf(_write(tmp_path, data))


def test_unknown_type_id(tmp_path):
    data = build_gguf([], [("a", (32,), 99, bytes(64))])
    with pytest.raises(GGUFError, match="unknown ggml type id 99"):
        open_gguf(_write(tmp_path, data))


def test_partial_block_rows(tmp_path):
    data = build_gguf([], [("a", (20,), Q8, bytes(34))])
    with pytest.raises(GGUFError, match="not a whole number of 32-weight blocks"):
        open_gguf(_write(tmp_path, data))


def test_duplicate_tensor_and_key(tmp_path):
    data = build_gguf([], [_f32_tensor("a", [1.0]), _f32_tensor("a", [2.0])])
    with pytest.raises(GGUFError, match="duplicate tensor name 'a'"):
        open_gguf(_write(tmp_path, data))
    data = build_gguf([("k", 4, 1, None), ("k", 4, 2, None)], [])
    with pytest.raises(GGUFError, match="duplicate metadata key 'k'"):
        open_gguf(_write(tmp_path, data))


def test_unknown_value_type(tmp_path):
    data = bytearray(build_gguf([("k", 4, 1, None)], []))
    # value type u32 sits right after the key string: magic(4)+ver(4)+counts(16)+len(8)+"k"(1)
    data[33:37] = struct.pack("<I", 77)
    with pytest.raises(GGUFError, match="unknown metadata value type 77"):
        open_gguf(_write(tmp_path, bytes(data)))


# ---- split sets -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def split_set(tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    whole = synthesize(d / "whole" / "m.gguf", SynthOptions(), threads=2)[0]
    parts = synthesize(d / "parts" / "m.gguf", SynthOptions(split_max_size=2 << 20), threads=2)
    return whole, parts


def test_split_set_opens_from_any_shard_or_folder(split_set):
    whole, parts = split_set
    assert len(parts) >= 3 and parts[0].name == f"m-00001-of-{len(parts):05d}.gguf"
    ref = open_gguf(whole)
    for target in (parts[0], parts[-1], parts[0].parent):
        f = open_gguf(target)
        assert f.paths == parts
        assert set(f.tensors) == set(ref.tensors)
        assert set(f.metadata) == set(ref.metadata)
        for name in ("token_embd.weight", "blk.3.ffn_down_exps.weight", "output.weight"):
            assert np.array_equal(f.data(name), ref.data(name))


def test_split_missing_shard(split_set, tmp_path):
    _, parts = split_set
    for p in parts[:-1]:
        (tmp_path / p.name).write_bytes(p.read_bytes())
    with pytest.raises(GGUFError, match=f"missing shard.*{parts[-1].name}"):
        open_gguf(tmp_path / parts[0].name)


def test_split_shards_that_disagree(split_set, tmp_path):
    _, parts = split_set
    for p in parts:
        (tmp_path / p.name).write_bytes(p.read_bytes())
    # swap two shards' contents: their split.no no longer matches their position
    a, b = tmp_path / parts[0].name, tmp_path / parts[1].name
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    with pytest.raises(GGUFError, match="shards disagree"):
        open_gguf(a)


def test_folder_with_two_models(tmp_path):
    _write(tmp_path, _basic(), "a.gguf")
    _write(tmp_path, _basic(), "b.gguf")
    with pytest.raises(GGUFError, match="more than one model"):
        open_gguf(tmp_path)
