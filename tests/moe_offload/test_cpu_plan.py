"""The CPU decode loop (models/cpu_plan.py, native/csrc/cpu/decode_loop.cpp): a B = 1, T = 1
token, a few tokens of one sequence (a speculative verify step, with or without kept delta-net
steps, hidden states too), or a decode_many step of B sequences, in one native call gives the
per-op path's logits bit for bit (torch.equal) and leaves the same state, on every weight type
mix and every ISA this CPU runs; where the plan does not mirror the per-op path, the per-op path
runs."""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch

from loaders import open_model
from moe_offload.gen import GREEDY, TokenEvent, generate
from moe_offload.instrument import switches
from moe_offload.models import Qwen35Moe, build_model, layers, upload_weights
from moe_offload.models import cpu_plan
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
    monkeypatch.setattr(switches, "CPU_PLAN", True)   # whatever FTPATCH_DECODE_LOOP says


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
    return _counted(monkeypatch, cpu_plan.DecodeLoop)


@pytest.fixture
def many_calls(monkeypatch):
    """How many decode_many steps the native loop ran."""
    return _counted(monkeypatch, cpu_plan.ManyLoop)


def _per_op(fn, *args):
    switches.CPU_PLAN = False
    try:
        return fn(*args)
    finally:
        switches.CPU_PLAN = True


def _assert_same_states(on, off):
    for name in ("conv", "ssm", "k", "v"):
        for i, t in getattr(on, name).items():
            assert torch.equal(t, getattr(off, name)[i]), (name, i)


def _lockstep(model, steps=16, prompt=PROMPT, kv_type="f32"):
    """Two states fed the same tokens, one through the loop and one through the per-op path:
    every step's logits equal, then the states."""
    on, off = model.new_state(1, 64, kv_type), model.new_state(1, 64, kv_type)
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
    assert len(loop_calls) == 2 + 16   # the two prompts (T = 6) as well


@pytest.mark.parametrize("kv_type", ["f16", "q8_0", "q4_0"])
def test_loop_with_a_packed_kv_is_the_per_op_path_bit_for_bit(models, kv_type, loop_calls):
    """The loop takes an f16 / q8_0 / q4_0 KV cache (the C++ mixer packs the rows and attends
    them as stored): the per-op path's logits and states, bit for bit."""
    _lockstep(models[next(iter(TYPES))], kv_type=kv_type)
    assert len(loop_calls) == 2 + 16


def _variant(loaded, drop):
    """The CPU model of `loaded` without the tensors drop(name) picks."""
    tensors, experts = upload_weights(loaded, "cpu")
    return Qwen35Moe(loaded.config, {k: v for k, v in tensors.items() if not drop(k)}, experts)


def test_no_shared_expert_and_tied_head(synth_model, loop_calls):
    loaded = open_model(synth_model(seed=1, **TYPES["mixed"]))
    _lockstep(_variant(loaded, lambda k: k.endswith("_shexp.weight")), steps=4)
    _lockstep(_variant(loaded, lambda k: k == "output.weight"), steps=4)   # the head is token_embd
    assert len(loop_calls) == 2 * (2 + 4)


def test_greedy_generation_is_the_same(models, loop_calls):
    model = models["mixed"]

    def tokens():
        return [e.token for e in generate(model, model.new_state(1, 64), PROMPT,
                                          replace(GREEDY, max_tokens=12), eog_ids=())
                if isinstance(e, TokenEvent)]
    with_loop = tokens()
    assert loop_calls
    switches.CPU_PLAN = False
    try:
        assert tokens() == with_loop
    finally:
        switches.CPU_PLAN = True


def test_the_per_op_path_runs_where_the_loop_does_not_mirror_it(models, loop_calls, monkeypatch):
    model = models["Q4_K"]
    tok = torch.tensor([[3]])
    st = model.new_state(1, 64)
    model.forward(torch.tensor([list(range(cpu_plan.max_tokens() + 1))]), st)   # a longer prompt
    model.forward(torch.tensor([[3], [4]]), model.new_state(2, 64))   # a batch
    monkeypatch.setattr(switches, "STEP_KERNELS", False)
    model.forward(tok, model.new_state(1, 64))
    monkeypatch.setattr(switches, "STEP_KERNELS", True)
    wrapped = Qwen35Moe(model.config, {**{f"blk.{i}.{k}": v for i, L in enumerate(model.blk)
                                          for k, v in L.items()},
                                       "token_embd.weight": model.embd, "output.weight": model.head,
                                       "output_norm.weight": model.out_norm},
                        [lambda x, ids, w, e=e: e(x, ids, w) for e in model.experts])
    wrapped.forward(tok, wrapped.new_state(1, 64))            # experts not plain ResidentExperts
    assert loop_calls == []
    model.forward(tok, model.new_state(1, 64))
    model.forward(tok, st, hidden=True)                       # the MTP head's hidden states
    model.forward(torch.tensor([[3, 4]]), st)                 # a short prompt
    kept = model.new_state(1, 64)
    kept.keep_steps(2)                                        # speculative decoding
    model.forward(tok, kept)
    model.forward(torch.tensor([[3, 4, 5]]), kept, hidden=True)
    model.forward(tok, model.new_state(1, 64, kv_type="q8_0"))  # a packed KV
    assert loop_calls == [1] * 6


def test_a_plan_follows_the_experts_it_was_built_for(models, loop_calls):
    model = models["Q8_0"]
    st = model.new_state(1, 64)
    model.decode(torch.tensor([3]), st)
    old = model.experts[0]
    try:
        model.experts[0] = dataclasses.replace(old)          # the same banks, another object
        first = cpu_plan.plan_for(model, st)
        assert first is not None and cpu_plan.plan_for(model, st) is first
        model.experts[0] = lambda x, ids, w: old(x, ids, w)
        assert cpu_plan.plan_for(model, st) is None
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


def test_decode_many_takes_the_per_op_path_unless_every_state_takes_the_loop(models, many_calls,
                                                                             monkeypatch):
    model = models["Q4_K"]
    tok = torch.tensor([3, 4])
    from native import ops
    with monkeypatch.context() as m:   # an extension that reads f32 caches only
        m.setattr(ops._cpu, "ATTENTION_KV_TYPES", 1)
        model.decode_many(tok, [model.new_state(1, 64, kv_type="f16"), model.new_state(1, 64)])
    _per_op(model.decode_many, tok, [model.new_state(1, 64), model.new_state(1, 64)])
    assert many_calls == []
    model.decode_many(tok, [model.new_state(1, 64), model.new_state(1, 64)])
    model.decode_many(tok, [model.new_state(1, 64, kv_type="q8_0"), model.new_state(1, 64)])
    assert many_calls == [1, 1]


def test_run_many_takes_one_models_plans(models):
    a, b = models["Q4_K"], models["Q8_0"]
    sa, sb = a.new_state(1, 64), b.new_state(1, 64)
    plans = [cpu_plan.plan_for(a, sa).plan, cpu_plan.plan_for(b, sb).plan]
    logits = torch.empty(2, a.head.shape[0])
    with pytest.raises(ValueError, match="not of one model's weights"):
        ops._cpu.DecodePlan.run_many(plans, [3, 4], [0, 0], [1, 1], logits.data_ptr())


# ---- a few tokens of one sequence: speculative decoding's verify step (forward T <= MAX_TOKENS) ----

VERIFY_TS = [2, 4, 1, 3, 4, 2, 3, 1, 4]   # a verify step's T = k+1 (T = 1: a plain step)


def _same_state(on, off, keep):
    _assert_same_states(on, off)
    assert on.n_past == off.n_past and int(on.pos) == int(off.pos) == on.n_past
    assert on.steps_taken == off.steps_taken
    if keep:
        for i, pair in on.steps.items():
            for t, u in zip(pair, off.steps[i]):
                assert torch.equal(t, u), ("steps", i)


def _verify_lockstep(model, prompt, depth, rewinds=True):
    """Two states, one through the loop and one through the per-op path, fed the prompt and then
    forwards of T = VERIFY_TS tokens with hidden=True (a speculative decoder's verify and plain
    steps), kept delta-net steps when depth > 0, each followed (where steps are kept) by a rewind
    of some of its tokens: logits, hidden states and the states after equal at every step."""
    on, off = model.new_state(1, 64), model.new_state(1, 64)
    for st in (on, off):
        st.keep_steps(depth)
    a = model.prefill(torch.tensor([prompt]), on, hidden=True)
    b = _per_op(model.prefill, torch.tensor([prompt]), off, 512, False, True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    tok = int(a[0].argmax(-1))
    for j, T in enumerate(VERIFY_TS):
        toks = torch.tensor([[tok] + [(tok * 7 + 13 * t) % model.head.shape[0] for t in range(1, T)]])
        la, ha = model.forward(toks, on, hidden=True)
        lb, hb = _per_op(model.forward, toks, off, False, True)
        assert la.shape == lb.shape == (1, T, model.head.shape[0]) and hb.shape == (1, T, model.config.n_embd)
        assert torch.equal(la, lb), (j, T)
        assert torch.equal(ha, hb), (j, T)
        keep = bool(depth) and 1 < T <= depth + 1
        assert on.steps_taken == (T if keep else 0)
        _same_state(on, off, keep)
        back = (j % T) if keep and rewinds else 0   # drop the last `back` tokens, as a rejection does
        for st in (on, off):
            st.rewind(back)
        _same_state(on, off, keep)
        tok = int(la[0, T - 1 - back].argmax(-1))
    return on


@pytest.fixture
def tokens_calls(monkeypatch):
    """The token counts of the native loop's calls."""
    calls = []
    run = cpu_plan.DecodeLoop.__call__
    monkeypatch.setattr(cpu_plan.DecodeLoop, "__call__",
                        lambda self, tokens, *a: (calls.append(tokens.shape[-1]), run(self, tokens, *a))[1])
    return calls


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("depth", [0, 3])
@pytest.mark.parametrize("types", ["Q4_K", "IQ3_S"])
def test_verify_steps_are_the_per_op_path_bit_for_bit(models, types, depth, isa_name, isa, tokens_calls):
    isa(isa_name)
    _verify_lockstep(models[types], PROMPT, depth)
    assert tokens_calls == [len(PROMPT)] + VERIFY_TS   # the prompt (T = 6 <= MAX_TOKENS) as well


@pytest.mark.parametrize("prompt", [[77], list(range(30, 43)), list(range(1, 40))])
def test_verify_steps_at_other_positions(models, prompt, tokens_calls):
    """Positions 1 to ~70 (a longer prompt in chunks: per-op past MAX_TOKENS), the mixed types."""
    _verify_lockstep(models["mixed"], prompt, 3)
    assert tokens_calls[-len(VERIFY_TS):] == VERIFY_TS


def test_kept_steps_shallower_than_the_step(models, tokens_calls):
    """depth 1: T = 2 keeps its steps, T = 3 and 4 run the delta-net on all tokens at once, as the
    per-op path does (a depth < T-1 keeps none)."""
    _verify_lockstep(models["IQ3_S"], PROMPT, 1)
    assert tokens_calls[1:] == VERIFY_TS


def test_a_plan_follows_keep_steps(models, tokens_calls):
    """keep_steps reallocates State.steps (deeper) or drops them: the plan writes the new ones."""
    model = models["Q4_K"]
    on, off = model.new_state(1, 64), model.new_state(1, 64)
    for depth, toks in ((1, [[3, 4]]), (3, [[5, 6, 7, 8]]), (0, [[9, 10, 11]]), (2, [[12, 13, 14]])):
        for st in (on, off):
            st.keep_steps(depth)
        la, ha = model.forward(torch.tensor(toks), on, hidden=True)
        lb, hb = _per_op(model.forward, torch.tensor(toks), off, False, True)
        assert torch.equal(la, lb) and torch.equal(ha, hb)
        _same_state(on, off, bool(depth))
        for st in (on, off):
            st.rewind(1 if depth else 0)
        a = model.decode(torch.tensor([3]), on)
        assert torch.equal(a, _per_op(model.decode, torch.tensor([3]), off))
    assert len(tokens_calls) == 8


def test_last_only_and_no_hidden(models, tokens_calls):
    """A short prompt's forward (last_only, no hidden states) runs natively too, the same bits."""
    model = models["mixed"]
    on, off = model.new_state(1, 64), model.new_state(1, 64)
    for toks, last in (([5, 17, 99], True), ([3, 4, 5, 6, 7, 8, 9, 10], False), ([42], True), ([7, 8], False)):
        a = model.forward(torch.tensor([toks]), on, last_only=last)
        b = _per_op(model.forward, torch.tensor([toks]), off, last)
        assert a.shape == b.shape == (1, 1 if last else len(toks), model.head.shape[0])
        assert torch.equal(a, b)
    _same_state(on, off, False)
    assert tokens_calls == [3, 8, 1, 2]


def test_speculative_decoding_takes_the_loop(synth_model, tokens_calls):
    """SpeculativeDecoder on the CPU: its verify and plain steps run natively, and its tokens
    and final state are the per-op path's."""
    from moe_offload.models import build_model as build
    from moe_offload.models.mtp import MtpHead
    from moe_offload.spec import SpeculativeDecoder

    loaded = open_model(synth_model(mtp=True, mtp_agree=0.7, type="Q4_K", seed=3))
    model = build(loaded, "cpu")
    head = MtpHead.load(loaded, model)

    def run(k):
        st = model.new_state(1, 128)
        toks = [e.token for e in generate(model, st, PROMPT, replace(GREEDY, max_tokens=24), eog_ids=(),
                                          draft=SpeculativeDecoder(model, head, k))
                if isinstance(e, TokenEvent)]
        return toks, st
    for k in (1, 2, 3):
        tokens_calls.clear()
        got, st = run(k)
        # the prompt, then every step: verify steps of T = k+1 (and plain ones of T = 1)
        assert tokens_calls[0] == len(PROMPT) and k + 1 in tokens_calls[1:]
        assert all(1 <= t <= k + 1 for t in tokens_calls[1:]) and sum(tokens_calls[1:]) >= 23
        switches.CPU_PLAN = False
        try:
            want, st_off = run(k)
        finally:
            switches.CPU_PLAN = True
        assert got == want
        _assert_same_states(st, st_off)
        assert st.mtp_past == st_off.mtp_past and torch.equal(st.mtp_k, st_off.mtp_k)


@pytest.fixture(scope="module")
def mtp_models(synth_model):
    from moe_offload.models.mtp import MtpHead
    out = {}
    for name in ("Q4_K", "IQ3_S"):
        loaded = open_model(synth_model(mtp=True, seed=2, **TYPES[name]))
        model = build_model(loaded, "cpu")
        out[name] = (model, MtpHead.load(loaded, model))
    return out


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("types", ["Q4_K", "IQ3_S"])
def test_mtp_head_is_the_per_op_path_bit_for_bit(mtp_models, types, isa_name, isa, monkeypatch):
    """The MTP block after its eh_proj in one native call (cpu_plan.mtp_plan_for): its
    logits (all, last, none), normed states g and MTP KV rows equal the per-op path's."""
    isa(isa_name)
    calls = _counted(monkeypatch, cpu_plan.MtpLoop)
    model, head = mtp_models[types]
    on, off = model.new_state(1, 64), model.new_state(1, 64)
    gen = torch.Generator().manual_seed(0)
    n = 0
    for j, (T, mode) in enumerate([(5, "none"), (1, "last"), (2, "all"), (3, "last"), (4, "all"), (1, "none"),
                                   (1, "all"), (2, "last")]):
        hidden = torch.randn(1, T, model.config.n_embd, generator=gen)
        toks = torch.tensor([[(11 * j + 5 * t) % model.head.shape[0] for t in range(T)]])
        la, ga = head.forward(hidden, toks, on, mode)
        lb, gb = _per_op(head.forward, hidden, toks, off, mode)
        assert torch.equal(ga, gb), (j, T, mode)
        assert (la is None) == (lb is None) == (mode == "none")
        if la is not None:
            assert la.shape == lb.shape == (1, T if mode == "all" else 1, model.head.shape[0])
            assert torch.equal(la, lb), (j, T, mode)
        n += T
        assert on.mtp_past == off.mtp_past == n
        assert torch.equal(on.mtp_k, off.mtp_k) and torch.equal(on.mtp_v, off.mtp_v)
    assert len(calls) == 8
