"""Logits that are NaN or Inf: the token stream refuses the id drawn from them at take() (the
moment the host reads an id back), naming the position, whatever the sampling and whichever of
the sampler's entry points saw them; the draw itself never raises (a CUDA sampler must never see
NaN) and always gives a valid id (a step may be queued on it before the host looks). generate() on a model whose weights decode to NaN stops
at the first step."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import poison
from moe_offload import (GREEDY, DoneEvent, NonFiniteLogits, SamplingParams, TokenStream,
                         generate)
from moe_offload.gen.stream import screen_logits

V = 64
SAMPLINGS = [GREEDY, SamplingParams(seed=1), SamplingParams(seed=1, top_k=0, top_p=1.0, min_p=0.0),
             SamplingParams(seed=1, repeat_penalty=1.3, presence_penalty=0.5)]


def _logits(bad: float | None = None, at: int = 7) -> torch.Tensor:
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    if bad is not None:
        x[0, at] = bad
    return x


@pytest.mark.parametrize("params", SAMPLINGS, ids=["greedy", "top-k", "plain", "penalties"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_id_drawn_from_bad_logits_is_refused_when_taken(params, bad):
    st = TokenStream(params, "cpu", None, [1, 2, 3], 3, eog_ids=())
    tok = st.draw(_logits(bad))
    assert 0 <= int(tok) < V                       # a valid id: a step queued on it is safe
    with pytest.raises(NonFiniteLogits, match=r"position 2 are not finite") as e:
        st.take(int(tok), 10)
    assert e.value.position == 2 and st.done and st.out == []   # nothing of it was sent


def test_finite_logits_pass_and_the_position_follows_the_context():
    st = TokenStream(SamplingParams(seed=3), "cpu", None, [5, 6], 2, eog_ids=())
    for _ in range(3):
        assert st.take(int(st.draw(_logits())), 10)
    st.draw(_logits(math.nan))
    with pytest.raises(NonFiniteLogits) as e:
        st.take(0, 10)
    assert e.value.position == 4                   # 2 prompt ids + 3 replies: the last fed at 4


def test_a_take_without_a_draw_after_good_rows_passes():
    """Ids drawn elsewhere (a speculative step's accepted drafts) are taken without a draw."""
    st = TokenStream(GREEDY, "cpu", None, [1], 1, eog_ids=())
    st.take(int(st.draw(_logits())), 10)
    st.take(3, 10)     # no draw in between: nothing to check, nothing stale
    assert st.out[-1] == 3


@pytest.mark.parametrize("use", ["filtered", "probs", "candidates", "call"])
def test_every_way_the_sampler_is_used_is_screened(use):
    """The speculative decoder samples verify rows through filtered / probs / the call itself:
    a NaN row met there is remembered until the stream takes an id."""
    st = TokenStream(SamplingParams(seed=2), "cpu", None, [1, 2, 3], 3, eog_ids=())
    rows = torch.cat([_logits(), _logits(math.nan)])
    fn = {"filtered": st.sample.filtered, "probs": st.sample.probs,
          "candidates": st.sample.candidates, "call": st.sample}[use]
    out = fn(rows)
    for t in (out if isinstance(out, tuple) else (out,)):
        assert not t.is_floating_point() or not torch.isnan(t).any()   # nothing NaN downstream
    with pytest.raises(NonFiniteLogits):
        st.take(4, 10)


def test_screen_logits_keeps_good_rows_and_flags_bad_ones():
    good = _logits()
    same, ok = screen_logits(good)
    assert ok is True and same is good             # no copy on the CPU when nothing is wrong
    fixed, ok = screen_logits(_logits(math.nan))
    assert ok is False and torch.isfinite(fixed).all()
    big = torch.full((1, V), 3e38)                 # finite, but a float32 sum would overflow
    assert screen_logits(big)[1] is True


@pytest.mark.gpu
def test_on_a_gpu_the_flag_comes_back_with_the_id():
    st = TokenStream(GREEDY, "cuda", None, [1, 2], 2, eog_ids=())
    tok = st.draw(_logits(math.nan).cuda())
    with pytest.raises(NonFiniteLogits):
        st.take(int(tok), 10)
    st2 = TokenStream(GREEDY, "cuda", None, [1, 2], 2, eog_ids=())
    assert st2.take(int(st2.draw(_logits().cuda())), 10)


def test_generate_stops_at_the_first_step(tiny_model, tmp_path):
    """token_embd's scales for one id are NaN: the prompt's logits are fine until that id is in
    the context, so the error comes at the first sampled token after it, not before."""
    from loaders import open_model
    from moe_offload import build_model
    bad_id = 17
    path = poison(tiny_model, tmp_path / "nan.gguf", "token_embd.weight", row=bad_id)
    model = build_model(open_model(path), "cpu")
    four = SamplingParams(temperature=0, max_tokens=4)
    clean = list(generate(model, model.new_state(1, 64), [1, 2, 3], four, eog_ids=()))
    assert isinstance(clean[-1], DoneEvent) and clean[-1].reason == "length"   # no bad id fed
    with pytest.raises(NonFiniteLogits) as e:
        list(generate(model, model.new_state(1, 64), [1, bad_id, 3], four, eog_ids=()))
    assert e.value.position == 2                   # the prompt's last position: its first step
