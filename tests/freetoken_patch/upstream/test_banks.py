"""The patched bank loader against FreeToken's own, byte for byte, on tiny synthetic GGUFs."""
from __future__ import annotations

import pytest
import torch

from freetoken_patch.upstream.measure import PARITY_CASES, compare

THEIRS = ("freetoken.models.gguf.experts", "load_gguf_expert_banks")


def _loaders(upstream):
    from freetoken_patch.upstream import hooks
    return hooks.original(*THEIRS), hooks.hook("parallel-banks").ours()


def _paths(synth_model, kw):
    from loaders.gguf_file import split_paths
    return split_paths(synth_model(**kw))


@pytest.mark.parametrize("device", [None, "cpu"], ids=["host-banks", "device-cpu"])
@pytest.mark.parametrize("label,kw,shard", PARITY_CASES, ids=[c[0] for c in PARITY_CASES])
def test_parity(patched, synth_model, label, kw, shard, device):
    theirs, ours = _loaders(patched)
    paths = _paths(synth_model, kw)
    dev = None if device is None else torch.device(device)
    a = theirs(str(paths[0]), 4, device=dev)
    b = ours(str(paths[min(shard, len(paths) - 1)]), 4, device=dev)
    got = compare(a, b)
    assert got["identical"], (label, got)
    if kw.get("split_max_size"):
        assert len(paths) > 2


def test_compare_sees_one_byte(patched, synth_model):
    theirs, _ = _loaders(patched)
    path = str(_paths(synth_model, {"type": "IQ3_S"})[0])
    a = theirs(path, 4, device=torch.device("cpu"))
    b = theirs(path, 4, device=torch.device("cpu"))
    b.sources["down"][3][7, 11, 5] ^= 1
    assert not compare(a, b)["identical"]


@pytest.mark.parametrize("threads", ["1", "3"])
def test_thread_count_does_not_change_bytes(patched, synth_model, monkeypatch, threads):
    theirs, ours = _loaders(patched)
    path = str(_paths(synth_model, {"type": "Q4_K", "down_type": "Q6_K"})[0])
    monkeypatch.setenv("FTPATCH_FT_BANK_THREADS", threads)
    monkeypatch.setattr("freetoken_patch.upstream.banks.JOB_BYTES", 4096)   # many small jobs
    assert compare(theirs(path, 4), ours(path, 4))["identical"]


def test_gate_up_types_differ_refused_like_freetoken(patched, synth_model):
    theirs, ours = _loaders(patched)
    path = str(_paths(synth_model, {"type": "IQ3_S", "tensor_types": (
        (r"blk\.0\.ffn_gate_exps", "Q4_K"),)})[0])
    for fn in (theirs, ours):
        with pytest.raises(NotImplementedError, match="different ggml types"):
            fn(path, 4)


def test_freetoken_caller_reaches_patched_loader(patched, synth_model, monkeypatch):
    """FreeToken's own `load_expert_banks` imports the loader at call time: it gets ours."""
    from types import SimpleNamespace

    from freetoken.layers.quantization import QuantKind
    from freetoken.moe.expert_banks import load_expert_banks

    import freetoken_patch.upstream.banks as banks
    calls = []
    plan = banks._plan
    monkeypatch.setattr(banks, "_plan", lambda *a: calls.append(a) or plan(*a))
    theirs, _ = _loaders(patched)
    path = str(_paths(synth_model, {"type": "IQ3_S", "down_type": "Q4_K"})[0])
    cfg = SimpleNamespace(num_moe_layers=4, first_k_dense_replace=0)
    got = load_expert_banks(path, cfg, method=SimpleNamespace(kind=QuantKind.GGUF),
                            device=torch.device("cpu"), parallel=False)
    assert len(calls) == 1
    assert compare(theirs(path, 4), got)["identical"]
