"""GGUF headers read by ``freetoken.models.gguf.reader`` against gguf-py's ``GGUFReader`` (the vendored copy).

The files are written here from the GGUF spec (ggml's docs/gguf.md) with ``struct``, not with gguf-py's writer,
which refuses empty arrays; every metadata value must equal ``ReaderField.contents()`` in type and bits, every
tensor record and tensor byte must equal gguf-py's. ``FREETOKEN_GGUF_VOCAB_DIR`` names a folder of llama.cpp's
vocabulary files (``models/ggml-vocab-*.gguf`` in the llama.cpp tree) to compare as well.
"""

from __future__ import annotations

import glob
import math
import os
import struct

import numpy as np
import pytest

from freetoken.models.gguf import reader
from freetoken.third_party import gguf

_TYPES = {"u8": 0, "i8": 1, "u16": 2, "i16": 3, "u32": 4, "i32": 5, "f32": 6, "bool": 7, "str": 8, "arr": 9, "u64": 10, "i64": 11, "f64": 12}
_PACK = {"u8": "<B", "i8": "<b", "u16": "<H", "i16": "<h", "u32": "<I", "i32": "<i", "f32": "<f", "bool": "<B", "u64": "<Q", "i64": "<q", "f64": "<d"}


def _value(kind: str, v) -> bytes:
    if kind == "str":
        raw = v.encode() if isinstance(v, str) else v
        return struct.pack("<Q", len(raw)) + raw
    if kind == "arr":  # v = (element kind, items); nested arrays are (kind, items) items again
        etype, items = v
        return struct.pack("<IQ", _TYPES[etype], len(items)) + b"".join(_value(etype, x) for x in items)
    return struct.pack(_PACK[kind], v)


def write_gguf(path, kv, tensors=(), alignment: int = 32) -> str:
    """``kv``: (key, kind, value); ``tensors``: (name, ggml type, ne, data bytes), data placed at aligned offsets."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for key, kind, v in kv:
        out += _value("str", key) + struct.pack("<I", _TYPES[kind]) + _value(kind, v)
    offset = 0
    for name, ggml_type, ne, data in tensors:
        out += _value("str", name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type, offset)
        offset += -(-len(data) // alignment) * alignment
    out += bytes(-len(out) % alignment)
    for *_, data in tensors:
        out += data + bytes(-len(data) % alignment)
    with open(path, "wb") as f:
        f.write(out)
    return str(path)


def _gguf_py_metadata(path) -> dict:
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}


def _same(a, b) -> bool:
    """Equal in type and value, floats by their bits (NaN included), dicts in key order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


SCALARS = [
    ("u8", 255), ("i8", -128), ("u16", 65535), ("i16", -32768), ("u32", 2**32 - 1), ("i32", -(2**31)),
    ("u64", 2**64 - 1), ("i64", -(2**63)), ("f32", 0.1), ("f32", float("nan")), ("f32", -0.0), ("f64", 1e-300),
    ("bool", 0), ("bool", 1), ("bool", 2), ("str", ""), ("str", "Grüße ✓ 𝄞"),
]
ARRAYS = [
    *[(kind, [v, v]) for kind, v in SCALARS],
    ("i32", []), ("str", []), ("arr", []),
    ("arr", [("i32", [1, 2]), ("i32", [3])]),  # ragged
    ("arr", [("str", ["a", "bc"]), ("str", [""])]),
    ("arr", [("arr", [("f32", [0.5])]), ("arr", [("f32", [1.5, 2.5])])]),  # three levels
    ("arr", [("u8", []), ("u8", [7])]),  # an empty first array
    ("arr", [("i32", [1]), ("str", ["xy"])]),  # leaf types differ: gguf-py gives the string's bytes
    ("arr", [("str", ["xy"]), ("i32", [65])]),  # ...and a number's bytes in a string list
    ("arr", [("u8", []), ("str", ["é"])]),
]
KV = [(f"s.{i}.{kind}", kind, v) for i, (kind, v) in enumerate(SCALARS)] + [
    (f"a.{i}.{kind}", "arr", (kind, items)) for i, (kind, items) in enumerate(ARRAYS)
]


def test_every_value_type_and_nesting_equals_gguf_py(tmp_path):
    path = write_gguf(tmp_path / "kv.gguf", KV)
    want, got = _gguf_py_metadata(path), reader.load_gguf_metadata(path)
    assert list(got) == list(want)
    bad = [k for k in want if not _same(got[k], want[k])]
    assert not bad, {k: (got[k], want[k]) for k in bad}


def _tensors():
    rng = np.random.default_rng(0)
    # (name, ggml type, ne): F32, F16, Q8_0 (34-byte blocks of 32), Q4_K (144-byte blocks of 256), I32
    specs = [("token_embd.weight", 8, (64, 10)), ("a.f32", 0, (3,)), ("b.f16", 1, (4, 2)), ("c.q4k", 12, (256, 2, 3)), ("d.i32", 26, (5,))]
    out = []
    for name, ggml_type, ne in specs:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        out.append((name, ggml_type, ne, rng.integers(0, 256, math.prod(ne) // block * size, dtype=np.uint8).tobytes()))
    return out


@pytest.mark.parametrize("alignment", [32, 64])
def test_tensor_index_and_bytes_equal_gguf_py(tmp_path, alignment):
    kv = [("general.architecture", "str", "llama")] + ([("general.alignment", "u32", alignment)] if alignment != 32 else [])
    path = write_gguf(tmp_path / "t.gguf", kv, _tensors(), alignment)
    theirs = gguf.GGUFReader(path)
    index = reader.gguf_tensor_index(path)
    assert list(index) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        info = index[t.name]
        assert (info.path, info.offset, info.nbytes, info.ggml_type, info.ne) == (
            path, int(t.data_offset), int(t.n_bytes), int(t.tensor_type), tuple(int(x) for x in t.shape))
        assert info.data().tobytes() == t.data.tobytes()
    assert reader.gguf_tensor_names(path) == {t.name for t in theirs.tensors}
    assert reader.gguf_architecture(path) == "llama"


def test_split_set_equals_gguf_py(tmp_path):
    """Three shards as llama.cpp's gguf-split writes them: the metadata in the first, ``split.*`` keys in each."""
    tensors = _tensors()
    paths = []
    for no, part in enumerate((tensors[:2], tensors[2:4], tensors[4:])):
        kv = [("split.no", "u16", no), ("split.count", "u16", 3), ("split.tensors.count", "i32", len(tensors))]
        if no == 0:
            kv = [("general.architecture", "str", "llama"), ("tokenizer.ggml.tokens", "arr", ("str", ["a", "b"])), *kv]
        paths.append(write_gguf(tmp_path / f"m-{no + 1:05d}-of-00003.gguf", kv, part))
    assert reader.gguf_split_paths(paths[0]) == tuple(paths)
    for p in paths:
        assert _same(reader.load_gguf_metadata(p), _gguf_py_metadata(p))
    index = reader.gguf_tensor_index(paths[0])
    want = {t.name: (p, int(t.data_offset), int(t.n_bytes)) for p in paths for t in gguf.GGUFReader(p).tensors}
    assert {n: (i.path, i.offset, i.nbytes) for n, i in index.items()} == want
    assert all(i.root == paths[0] for i in index.values())


VOCAB_DIR = os.environ.get("FREETOKEN_GGUF_VOCAB_DIR", "")


@pytest.mark.skipif(not VOCAB_DIR, reason="set FREETOKEN_GGUF_VOCAB_DIR to a folder of llama.cpp's ggml-vocab-*.gguf")
def test_llama_cpp_vocab_files_equal_gguf_py():
    paths = sorted(glob.glob(os.path.join(VOCAB_DIR, "ggml-vocab-*.gguf")))
    assert paths, f"no ggml-vocab-*.gguf in {VOCAB_DIR}"
    for path in paths:
        want, got = _gguf_py_metadata(path), reader.load_gguf_metadata(path)
        assert "tokenizer.ggml.tokens" in got, path
        bad = [k for k in want if k not in got or not _same(got[k], want[k])]
        assert list(got) == list(want) and not bad, (path, bad)


def test_header_parse_makes_no_view_per_value(tmp_path, monkeypatch):
    """The cost this reader removes: gguf-py builds numpy memmap views per token and per merge."""
    n = 20_000
    kv = [("tokenizer.ggml.tokens", "arr", ("str", [f"t{i}" for i in range(n)])),
          ("tokenizer.ggml.merges", "arr", ("str", [f"t{i} t{i + 1}" for i in range(n)]))]
    path = write_gguf(tmp_path / "vocab.gguf", kv)
    views = []
    finalize = np.memmap.__array_finalize__
    monkeypatch.setattr(np.memmap, "__array_finalize__", lambda self, obj: views.append(1) or finalize(self, obj))
    meta = reader.load_gguf_metadata(path)
    assert len(meta["tokenizer.ggml.tokens"]) == n
    assert len(views) < 16, f"{len(views)} numpy memmap views made to read {2 * n} strings"


@pytest.mark.parametrize("cut", ["magic", "inside the tokens", "tensor data"])
def test_broken_files_fail_as_with_gguf_py(tmp_path, cut):
    kv = [("general.architecture", "str", "llama"), ("tokenizer.ggml.tokens", "arr", ("str", ["x" * 50] * 100))]
    raw = open(write_gguf(tmp_path / "ok.gguf", kv, _tensors()[:1]), "rb").read()
    broken = {"magic": b"GGUX" + raw[4:], "inside the tokens": raw[:2000], "tensor data": raw[:-100]}[cut]
    path = tmp_path / "broken.gguf"
    path.write_bytes(broken)
    with pytest.raises(Exception):
        gguf.GGUFReader(str(path))
    with pytest.raises(ValueError):
        reader.load_gguf_metadata(str(path))
