"""Quantized KV caches on the model (CPU): logits with q8_0 and q4_0 KV against f16 and f32 on
a tiny synthetic model, short and long prompts, prefill chunks and decode steps; the bounds
below are the ones docs/BENCHMARKS.md states ("KV cache types")."""
from __future__ import annotations

import pytest
import torch

from loaders import open_model
from moe_offload.errors import OffloadError
from moe_offload.models import build_model
from moe_offload.state import State

# mean |logit difference| from the f32 cache (logits up to ~2.5 on this model) and the share of
# positions whose top token is f32's
BOUNDS = {"f16": (0.002, 0.99), "q8_0": (0.004, 0.98), "q4_0": (0.015, 0.93)}
GREEDY = 24


@pytest.fixture(scope="module")
def model(synth_model):
    return build_model(open_model(synth_model(type="IQ3_S")), "cpu")


def _run(model, kv: str, n: int):
    toks = torch.randint(0, model.config.n_vocab, (1, n),
                         generator=torch.Generator().manual_seed(n))
    st = model.new_state(1, 2048, kv)
    logits = model.prefill(toks, st, chunk=512, all_logits=True)
    nxt, gen = logits[:, -1].argmax(-1), []
    for _ in range(GREEDY):
        nxt = model.decode(nxt, st).argmax(-1)
        gen.append(int(nxt))
    return logits, gen, st


@pytest.mark.parametrize("n", [70, 1500])
def test_quantized_kv_logits_stay_within_their_bounds(model, n):
    """Prompts of 70 and 1,500 tokens (three chunks): every KV type's logits against the f32
    cache's within its bounds, and with q8_0 the next 24 greedy tokens are f16's."""
    ref, _, _ = _run(model, "f32", n)
    runs = {kv: _run(model, kv, n) for kv in ("f16", "q8_0", "q4_0")}
    for kv, (logits, _, st) in runs.items():
        mean_bound, agree_bound = BOUNDS[kv]
        diff = float((logits - ref).abs().mean())
        agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        assert diff <= mean_bound and agree >= agree_bound, (kv, diff, agree)
        assert st.kv_type.name == kv
    assert runs["q8_0"][1] == runs["f16"][1]
    # a quantized cache is not a float one in disguise: q4_0 moves the logits more than f16
    assert float((runs["q4_0"][0] - ref).abs().mean()) > float((runs["f16"][0] - ref).abs().mean())


def test_quantized_kv_is_smaller_and_says_what_it_is(model):
    c = model.config
    states = {kv: State(c, 1, 1024, "cpu", kv) for kv in ("f32", "f16", "q8_0", "q4_0")}
    sizes = {kv: st.nbytes - st.recurrent_nbytes for kv, st in states.items()}
    assert sizes["f16"] * 2 == sizes["f32"]
    assert sizes["q8_0"] == sizes["f16"] * 17 // 32 and sizes["q4_0"] == sizes["f16"] * 9 // 32
    with pytest.raises(OffloadError, match="unknown KV type 'q3'"):
        State(c, 1, 64, "cpu", "q3")


def test_rewind_and_snapshots_with_a_quantized_kv(model):
    """Prefix reuse's tools on a q8_0 cache: a snapshot taken after a prompt, more tokens, then
    restore and the same continuation give the same logits as the first time."""
    toks = torch.randint(0, model.config.n_vocab, (1, 40),
                         generator=torch.Generator().manual_seed(2))
    st = model.new_state(1, 256, "q8_0")
    model.prefill(toks[:, :30], st)
    snap = st.snapshot()
    first = model.forward(toks[:, 30:40], st)
    st.restore(snap)
    assert st.n_past == 30
    assert torch.equal(model.forward(toks[:, 30:40], st), first)
