"""The lean GGUF header reader as the runtime patch runs it: FreeToken 0.2.1's own functions
(metadata, split sets, tensor index, tensor bytes, config's vocabulary size), with the hook
applied, against gguf-py's reader on the same files: llama.cpp's vocabulary file, synthetic
models, a split set opened from every shard, and the pull request's file of every value type
and nesting."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from freetoken_patch.upstream.doctor import _same

PR_TEST = (Path(__file__).resolve().parents[3] / "pr_notes" / "1-gguf-header-reader" / "change"
           / "tests" / "models" / "test_gguf_reader.py")


@pytest.fixture
def lean(patched):
    """The patch applied, FreeToken's header caches empty before and after."""
    from freetoken_patch.upstream.doctor import _clear_header_caches
    _clear_header_caches()
    yield patched
    _clear_header_caches()


def _expected(path):
    """What FreeToken 0.2.1 gets from gguf-py: metadata, and tensors as its index records them."""
    from freetoken.third_party import gguf
    r = gguf.GGUFReader(str(path))
    meta = {name: f.contents() for name, f in r.fields.items()}
    tensors = {t.name: (str(path), int(t.data_offset), int(t.n_bytes), int(t.tensor_type),
                        tuple(int(x) for x in t.shape), t.data.tobytes()[:64]) for t in r.tensors}
    return meta, tensors


def _check_file(path, root=None):
    from freetoken.models.gguf import reader
    meta, tensors = _expected(path)
    assert _same(reader.load_gguf_metadata(str(path)), meta)
    got = {n: (i.path, i.offset, i.nbytes, i.ggml_type, i.ne, i.data().tobytes()[:64])
           for n, i in reader.gguf_tensor_index(str(path)).items()
           if i.path == str(path)}
    assert got == tensors


def test_hook_is_on_every_header_read(lean):
    from freetoken.models.gguf import reader

    from freetoken_patch.upstream import header
    assert reader._reader is header.reader


@pytest.mark.slow   # gguf-py takes 10-20 s on its 151,936 tokens
def test_llama_cpp_vocab_file(lean, vocab_path):
    _check_file(vocab_path)


@pytest.mark.parametrize("kw", [{}, {"type": "Q4_K", "down_type": "Q6_K", "mtp": True}],
                         ids=["tiny-IQ3_S", "tiny-Q4_K-mtp"])
def test_synthetic_models(lean, synth_model, kw):
    from freetoken.models.gguf.config import _vocab_size
    path = synth_model(**kw)
    _check_file(path)
    meta, _ = _expected(path)
    assert _vocab_size(str(path)) == len(meta["tokenizer.ggml.tokens"])


def test_split_set_from_every_shard(lean, synth_model):
    from freetoken.models.gguf import reader
    from loaders.gguf_file import split_paths
    paths = [str(p) for p in split_paths(synth_model(type="IQ3_S", split_max_size=400_000))]
    assert len(paths) > 2
    for p in paths:
        _check_file(p)
    assert reader.gguf_split_paths(paths[0]) == tuple(paths)
    index = reader.gguf_tensor_index(paths[0])
    assert {i.path for i in index.values()} == set(paths)
    assert sum(len(_expected(p)[1]) for p in paths) == len(index)


def _pr_test_module():
    spec = importlib.util.spec_from_file_location("pr1_test_gguf_reader", PR_TEST)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_value_type_and_nesting(lean, tmp_path):
    """The pull request's file of every value type and nesting, through the hook."""
    from freetoken.models.gguf import reader
    pr = _pr_test_module()
    path = pr.write_gguf(tmp_path / "kv.gguf", pr.KV, pr._tensors())
    assert _same(reader.load_gguf_metadata(path), pr._gguf_py_metadata(path))
    _check_file(path)


def test_comparison_sees_a_wrong_value(lean, tmp_path):
    """The check above can fail: a value gguf-py renders differently is caught."""
    from freetoken.models.gguf import reader
    pr = _pr_test_module()
    path = pr.write_gguf(tmp_path / "kv.gguf", [("a", "arr", ("arr", [("u8", []), ("str", ["é"])]))])
    got = reader.load_gguf_metadata(path)
    assert got["a"] == [0xC3, 0xA9]   # gguf-py's rendering: the string's bytes
    assert not _same(got, {**got, "a": ["é"]})


def test_no_view_per_value(lean, vocab_path, monkeypatch):
    from freetoken.models.gguf import reader
    views = []
    finalize = np.memmap.__array_finalize__
    monkeypatch.setattr(np.memmap, "__array_finalize__",
                        lambda self, obj: views.append(1) or finalize(self, obj))
    assert len(reader.load_gguf_metadata(str(vocab_path))["tokenizer.ggml.tokens"]) > 100_000
    assert len(views) < 16


def test_doctor_times_the_parse(lean, synth_model):
    from freetoken_patch.upstream import doctor
    path = synth_model()
    h = doctor.header_parse(str(path), compare=True)
    assert h["same_metadata"] and h["same_tensor_index"]
    assert h["tensors"] == len(_expected(path)[1]) and h["files"] == 1
    assert 0 < h["seconds"] < h["gguf_py_seconds"]
    from freetoken.models.gguf import reader

    from freetoken_patch.upstream import header
    assert reader._reader is header.reader   # the comparison put the hook back


def test_doctor_refuses_a_file_that_is_not_gguf_in_one_line(lean, tmp_path):
    from freetoken_patch.errors import CLIError
    from freetoken_patch.upstream import doctor
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"hello, not a model at all")
    with pytest.raises(CLIError, match="not a GGUF file"):
        doctor.header_parse(str(bad))


def test_measure_header_refuses_a_file_that_is_not_gguf_before_any_run(tmp_path, monkeypatch):
    from loaders import GGUFError
    from freetoken_patch.upstream import measure
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"hello, not a model at all")
    monkeypatch.setattr(measure.subprocess, "run", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        measure.header(str(bad), repeats=1)
