"""The CPU decode loop (models/decode_loop.py, native/csrc/cpu/decode_loop.cpp): a B = 1, T = 1
token, or a decode_many step of B sequences, in one native call gives the per-op path's logits
bit for bit (torch.equal) and leaves the same state, on every weight type mix and every ISA this
CPU runs; where the plan does not mirror the per-op path, the per-op path runs."""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch

from loaders import open_model
from moe_offload.generate import GREEDY, TokenEvent, generate
from moe_offload.models import Qwen35Moe, build_model, decode_loop, layers, upload_weights
from native import ops

pytestmark = pytest.mark.skipif(ops._cpu is None or not hasattr(ops._cpu, "DecodePlan"),
                                reason="native._cpu without DecodePlan")

TYPES = {"Q4_K": dict(type="Q4_K"), "IQ3_S": dict(type="IQ3_S"), "Q8_0": dict(type="Q8_0"),
         "mixed": dict(type="Q4_K", expert_type="IQ3_S", down_type="Q6_K", output_type="Q8_0",
                       tensor_types=(("attn_gate", "Q5_K"), ("ssm_out", "IQ4_XS")))}
ISAS = ops._cpu.available_isas() if ops._cpu is not None else []
PROMPT = [5, 17, 99, 3, 42, 7]


@pytest.fixture(autouse=True)
def loop_on(monkeypatch):
    monkeypatch.setattr(decode_loop, "ENABLED", True)   # whatever FTPATCH_DECODE_LOOP says


@pytest.fixture(scope="module")
def models(synth_model):
    return {name: build_model(open_model(synth_model(seed=1, **kw)), "cpu") for name, kw in TYPES.items()}


@pytest.fixture
def isa(request):
    before = ops._cpu.isa()
    yield ops._cpu.set_isa
    ops._cpu.set_isa(before)


def _counted(monkeypatch, cls) -> list:
    """A list that grows by one at each call of a cls instance."""
    calls = []
    run = cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *a: (calls.append(1), run(self, *a))[1])
    return calls


@pytest.fixture
def loop_calls(monkeypatch):
    """How many tokens the native loop ran."""
    return _counted(monkeypatch, decode_loop.DecodeLoop)


@pytest.fixture
def many_calls(monkeypatch):
    """How many decode_many steps the native loop ran."""
    return _counted(monkeypatch, decode_loop.ManyLoop)


def _per_op(fn, *args):
    decode_loop.ENABLED = False
    try:
        return fn(*args)
    finally:
        decode_loop.ENABLED = True


def _assert_same_states(on, off):
    for name in ("conv", "ssm", "k", "v"):
        for i, t in getattr(on, name).items():
            assert torch.equal(t, getattr(off, name)[i]), (name, i)


def _lockstep(model, steps=16, prompt=PROMPT):
    """Two states fed the same tokens, one through the loop and one through the per-op path:
    every step's logits equal, then the states."""
    on, off = model.new_state(1, 64), model.new_state(1, 64)
    model.prefill(torch.tensor([prompt]), off)
    tok = model.prefill(torch.tensor([prompt]), on).argmax(-1)
    for _ in range(steps):
        a = model.decode(tok, on)
        b = _per_op(model.decode, tok, off)
        assert torch.equal(a, b)
        tok = a.argmax(-1)
    assert on.n_past == off.n_past == len(prompt) + steps and int(on.pos) == on.n_past
    _assert_same_states(on, off)


MANY_PROMPTS = [PROMPT, [9, 4], list(range(30, 43)), [77]]   # each sequence at its own position


def _lockstep_many(model, prompts, steps=12):
    """decode_many over len(prompts) states through the loop and over a copy through the
    per-op path: every step's logits equal, then every state."""
    on, off = ([model.new_state(1, 64) for _ in prompts] for _ in range(2))
    for p, a, b in zip(prompts, on, off):
        model.prefill(torch.tensor([p]), b)
        model.prefill(torch.tensor([p]), a)
    tok = torch.tensor([p[0] for p in prompts])
    for _ in range(steps):
        a = model.decode_many(tok, on)
        b = _per_op(model.decode_many, tok, off)
        assert torch.equal(a, b)
        tok = a.argmax(-1)
    for p, a, b in zip(prompts, on, off):
        assert a.n_past == b.n_past == len(p) + steps and int(a.pos) == a.n_past
        _assert_same_states(a, b)


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("types", list(TYPES))
def test_loop_is_the_per_op_path_bit_for_bit(models, types, isa_name, isa, loop_calls):
    isa(isa_name)
    _lockstep(models[types])
    assert len(loop_calls) == 16


def _variant(loaded, drop):
    """The CPU model of `loaded` without the tensors drop(name) picks."""
    tensors, experts = upload_weights(loaded, "cpu")
    return Qwen35Moe(loaded.config, {k: v for k, v in tensors.items() if not drop(k)}, experts)


def test_no_shared_expert_and_tied_head(synth_model, loop_calls):
    loaded = open_model(synth_model(seed=1, **TYPES["mixed"]))
    _lockstep(_variant(loaded, lambda k: k.endswith("_shexp.weight")), steps=4)
    _lockstep(_variant(loaded, lambda k: k == "output.weight"), steps=4)   # the head is token_embd
    assert len(loop_calls) == 8


def test_greedy_generation_is_the_same(models, loop_calls):
    model = models["mixed"]

    def tokens():
        return [e.token for e in generate(model, model.new_state(1, 64), PROMPT,
                                          replace(GREEDY, max_tokens=12), eog_ids=())
                if isinstance(e, TokenEvent)]
    with_loop = tokens()
    assert loop_calls
    decode_loop.ENABLED = False
    try:
        assert tokens() == with_loop
    finally:
        decode_loop.ENABLED = True


def test_the_per_op_path_runs_where_the_loop_does_not_mirror_it(models, loop_calls, monkeypatch):
    model = models["Q4_K"]
    tok = torch.tensor([[3]])
    st = model.new_state(1, 64)
    model.forward(tok, st, hidden=True)                       # the MTP head's hidden states
    model.forward(torch.tensor([[3, 4]]), st)                 # a prompt
    model.forward(torch.tensor([[3], [4]]), model.new_state(2, 64))   # a batch
    kept = model.new_state(1, 64)
    kept.keep_steps(2)                                        # speculative decoding
    model.forward(tok, kept)
    model.forward(tok, model.new_state(1, 64, kv_dtype=torch.float16))
    monkeypatch.setattr(layers, "STEP_KERNELS", False)
    model.forward(tok, model.new_state(1, 64))
    monkeypatch.setattr(layers, "STEP_KERNELS", True)
    wrapped = Qwen35Moe(model.config, {**{f"blk.{i}.{k}": v for i, L in enumerate(model.blk)
                                          for k, v in L.items()},
                                       "token_embd.weight": model.embd, "output.weight": model.head,
                                       "output_norm.weight": model.out_norm},
                        [lambda x, ids, w, e=e: e(x, ids, w) for e in model.experts])
    wrapped.forward(tok, wrapped.new_state(1, 64))            # experts not plain ResidentExperts
    assert loop_calls == []
    model.forward(tok, model.new_state(1, 64))
    assert loop_calls == [1]


def test_a_plan_follows_the_experts_it_was_built_for(models, loop_calls):
    model = models["Q8_0"]
    st = model.new_state(1, 64)
    model.decode(torch.tensor([3]), st)
    old = model.experts[0]
    try:
        model.experts[0] = dataclasses.replace(old)          # the same banks, another object
        first = decode_loop.loop_for(model, st)
        assert first is not None and decode_loop.loop_for(model, st) is first
        model.experts[0] = lambda x, ids, w: old(x, ids, w)
        assert decode_loop.loop_for(model, st) is None
    finally:
        model.experts[0] = old


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("n_seq", [2, 4])
@pytest.mark.parametrize("types", ["Q4_K", "IQ3_S", "mixed"])
def test_decode_many_loop_is_the_per_op_path_bit_for_bit(models, types, n_seq, isa_name, isa, many_calls):
    isa(isa_name)
    _lockstep_many(models[types], MANY_PROMPTS[:n_seq])
    assert len(many_calls) == 12


def test_decode_many_without_shared_expert_and_tied_head(synth_model, many_calls):
    loaded = open_model(synth_model(seed=1, **TYPES["mixed"]))
    _lockstep_many(_variant(loaded, lambda k: k.endswith("_shexp.weight")), MANY_PROMPTS[:3], steps=4)
    _lockstep_many(_variant(loaded, lambda k: k == "output.weight"), MANY_PROMPTS[:3], steps=4)
    assert len(many_calls) == 8


def test_decode_many_takes_the_per_op_path_unless_every_state_takes_the_loop(models, many_calls):
    model = models["Q4_K"]
    tok = torch.tensor([3, 4])
    kept = model.new_state(1, 64)
    kept.keep_steps(2)                                        # speculative decoding
    model.decode_many(tok, [model.new_state(1, 64), kept])
    model.decode_many(tok, [model.new_state(1, 64, kv_dtype=torch.float16), model.new_state(1, 64)])
    _per_op(model.decode_many, tok, [model.new_state(1, 64), model.new_state(1, 64)])
    assert many_calls == []
    model.decode_many(tok, [model.new_state(1, 64), model.new_state(1, 64)])
    assert many_calls == [1]


def test_run_many_takes_one_models_plans(models):
    a, b = models["Q4_K"], models["Q8_0"]
    sa, sb = a.new_state(1, 64), b.new_state(1, 64)
    plans = [decode_loop.loop_for(a, sa).plan, decode_loop.loop_for(b, sb).plan]
    logits = torch.empty(2, a.head.shape[0])
    with pytest.raises(ValueError, match="not of one model's weights"):
        ops._cpu.DecodePlan.run_many(plans, [3, 4], [0, 0], [1, 1], logits.data_ptr())
