"""Sampling, the token stream (stop conditions, timings) and the chat Session on a tiny model."""
from __future__ import annotations

import pytest
import torch

from loaders import open_model
from moe_offload.errors import OffloadError
from moe_offload.gen import (GREEDY, DoneEvent, Sampler, SamplingParams, Session, TokenEvent,
                                  StopScanner, generate)
from moe_offload.models import build_model

pytestmark = pytest.mark.usefixtures("reference_kernels")


@pytest.fixture(scope="module")
def session_parts(synth_model):
    path = synth_model(type="Q4_K")
    s = Session.load(path)
    return s.model, s.tokenizer, s.template


def _session(parts, n_ctx=None) -> Session:
    model, tok, tmpl = parts
    return Session(model, model.new_state(1, n_ctx), tok, tmpl)


def _run(events):
    events = list(events)
    assert isinstance(events[-1], DoneEvent)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


# ---- sampler ---------------------------------------------------------------------------------------

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0, 0.0]])


def test_greedy_and_degenerate_filters_pick_the_argmax():
    assert Sampler(GREEDY)(LOGITS).tolist() == [4]
    for p in (SamplingParams(top_k=1, seed=0), SamplingParams(top_k=0, top_p=0.01, min_p=0, seed=0),
              SamplingParams(top_k=0, top_p=1.0, min_p=1.0, seed=0)):
        assert Sampler(p)(LOGITS.repeat(50, 1)).unique().tolist() == [4]


def test_filters_keep_the_right_sets():
    def support(p):
        return set(Sampler(SamplingParams(temperature=1.0, seed=0, **p))(LOGITS.repeat(4000, 1)).tolist())
    assert support(dict(top_k=2, top_p=1.0, min_p=0)) == {0, 4}
    probs = torch.softmax(LOGITS[0], -1)                    # 4: .63, 0: .23, 1: .09, ...
    assert support(dict(top_k=0, top_p=0.8, min_p=0)) == {0, 4}
    assert support(dict(top_k=0, top_p=1.0, min_p=0.1)) == {i for i in range(6) if probs[i] >= 0.1 * probs.max()}


def test_sampling_follows_softmax_and_seed_repeats():
    p = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    draws = Sampler(p)(LOGITS.repeat(20000, 1))
    freq = torch.bincount(draws, minlength=6).float() / draws.numel()
    assert torch.allclose(freq, torch.softmax(LOGITS[0] / 0.7, -1), atol=0.015)
    assert torch.equal(Sampler(p)(LOGITS.repeat(100, 1)), Sampler(p)(LOGITS.repeat(100, 1)))


@pytest.mark.parametrize("params", [dict(top_k=40, top_p=0.95, min_p=0.05),
                                    dict(top_k=5, top_p=1.0, min_p=0.0),
                                    dict(top_k=100, top_p=0.5, min_p=0.0, presence_penalty=0.7)])
def test_top_k_draws_from_the_same_distribution_over_k_candidates(params):
    """With top-k the draw is made over the k best ids (the other filters sort k values, not
    the vocabulary): scattered back, the same probabilities as probs() over the vocabulary."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5000, generator=g) * 3
    recent = torch.randint(0, 5000, (3, 16), generator=g)
    sp = Sampler(SamplingParams(temperature=0.8, seed=1, **params))
    probs, ids = sp.candidates(logits, recent)
    full = torch.zeros_like(logits).scatter_(-1, ids, probs)
    torch.testing.assert_close(full, sp.probs(logits, recent), rtol=1e-5, atol=1e-7)
    draws = sp(logits, recent)
    assert all(full[b, t] > 0 for b, t in enumerate(draws.tolist()))


def test_penalties():
    recent = torch.tensor([[4]])
    # 3.0 / 2 = 1.5 < 2.0: the repeated top token loses to token 0
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))(LOGITS, recent).tolist() == [0]
    assert Sampler(SamplingParams(temperature=0, presence_penalty=1.5))(LOGITS, recent).tolist() == [0]
    neg = torch.tensor([[-1.0, -2.0]])                      # negative logits are multiplied
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=3.0))(neg, torch.tensor([[0]])).tolist() == [1]
    # frequency: once per occurrence -- token 4 seen twice, 3.0 - 2 * 0.6 = 1.8 < 2.0; seen once it stays on top
    freq = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert Sampler(freq)(LOGITS, torch.tensor([[4, 4]])).tolist() == [0]
    assert Sampler(freq)(LOGITS, torch.tensor([[4]])).tolist() == [4]


def test_logit_bias_after_the_penalties():
    """OpenAI's logit_bias: added to the logits after the penalties, before top-k and the rest;
    -100 takes the best id out of a greedy draw, +100 makes a sampled one certain."""
    top = LOGITS.argmax(-1).item()
    banned = Sampler(SamplingParams(temperature=0, logit_bias=((top, -100.0),)))(LOGITS)
    assert banned.item() != top
    sure = SamplingParams(temperature=1.0, top_k=2, seed=3, logit_bias=((1, 100.0),))
    assert Sampler(sure)(LOGITS.repeat(64, 1)).tolist() == [1] * 64
    # the penalty first, then the bias: token 4 (3.0) halved to 1.5, +0.6 puts it back above 2.0
    both = SamplingParams(temperature=0, repeat_penalty=2.0, logit_bias=((4, 0.6),))
    assert Sampler(both)(LOGITS, torch.tensor([[4]])).tolist() == [4]
    x = Sampler(SamplingParams(logit_bias=((2, 1.5), (0, -1.0)))).penalized(LOGITS)
    torch.testing.assert_close(x - LOGITS, torch.tensor([[-1.0, 0, 1.5, 0, 0, 0]]))


def test_stop_scanner_holds_back_partial_matches():
    s = StopScanner(["</end>", "STOP"])
    assert s.push("hello </") == ("hello ", False)
    assert s.push("en") == ("", False)
    assert s.push("x more") == ("</enx more", False)
    assert s.push(" ST") == (" ", False)
    assert s.push("OP tail") == ("", True)
    assert StopScanner([]).push("abc") == ("abc", False)


# ---- the loop --------------------------------------------------------------------------------------

def test_greedy_stream_matches_a_manual_loop(session_parts):
    model, tok, _ = session_parts
    prompt = tok.encode("The quick brown fox", add_special=True)
    toks, done = _run(generate(model, model.new_state(), prompt,
                               SamplingParams(temperature=0, max_tokens=6), tokenizer=tok,
                               eog_ids=()))
    state = model.new_state()
    want = [int(model.prefill(torch.tensor([prompt]), state).argmax(-1))]
    for _ in range(5):
        want.append(int(model.decode(torch.tensor([want[-1]]), state).argmax(-1)))
    assert [e.token for e in toks] == want and list(done.tokens) == want
    assert done.reason == "length"
    assert "".join(e.text for e in toks) + done.text == tok.decode(want)
    t = done.timings
    assert (t.n_prompt, t.n_decode) == (len(prompt), 5)
    assert t.prompt_tps > 0 and t.decode_tps > 0 and 0 < t.ttft_s
    assert "tok/s" in t.summary()


def test_stops_on_eog_strings_and_context(session_parts):
    model, tok, _ = session_parts
    prompt = tok.encode("Once upon a time", add_special=True)
    base = SamplingParams(temperature=0, max_tokens=8)
    toks, done = _run(generate(model, model.new_state(), prompt, base, tokenizer=tok, eog_ids=()))
    ids = [e.token for e in toks]
    # the third greedy token as end-of-generation: two tokens come out, the eog id is not shown
    toks2, done2 = _run(generate(model, model.new_state(), prompt, base, tokenizer=tok,
                                 eog_ids={ids[2]}))
    assert ids[2] not in ids[:2]  # (true for this model and prompt; the check needs it)
    assert [e.token for e in toks2] == ids[:2] and done2.reason == "eog"
    assert done2.tokens == tuple(ids[:3])
    # a stop string taken from the middle of the greedy text: the text stops right before it
    text = tok.decode(ids)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    toks3, done3 = _run(generate(model, model.new_state(), prompt,
                                 SamplingParams(temperature=0, max_tokens=8, stop=(stop,)),
                                 tokenizer=tok, eog_ids=()))
    assert done3.reason == "stop"
    assert "".join(e.text for e in toks3) + done3.text == text[:text.find(stop)]
    # a context of prompt + 3 tokens: three sampled, two fed, then "context"
    toks4, done4 = _run(generate(model, model.new_state(n_ctx=len(prompt) + 3), prompt, base,
                                 tokenizer=tok, eog_ids=()))
    assert done4.reason == "context" and len(done4.tokens) == 4
    with pytest.raises(OffloadError, match="do not fit the context"):
        next(generate(model, model.new_state(n_ctx=2), prompt, base))
    with pytest.raises(OffloadError, match="prompt is empty"):
        next(generate(model, model.new_state(), [], base))


# ---- the chat session -----------------------------------------------------------------------------

def test_chat_continues_without_re_prefilling(session_parts):
    s = _session(session_parts)
    p = SamplingParams(temperature=0, max_tokens=6)
    msgs = [{"role": "user", "content": "Hello there"}]
    toks, done = _run(s.chat(msgs, p))
    reply = "".join(e.text for e in toks) + done.text
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    first_n = s.state.n_past
    toks2, done2 = _run(s.chat(msgs, p))
    assert done2.timings.n_prompt < len(_render_ids(s, msgs))        # earlier turns reused
    assert s.state.n_past == len(s.tokens) >= first_n
    fresh = _session(session_parts)
    toks3, _ = _run(fresh.chat(msgs, p))
    assert [e.token for e in toks2] == [e.token for e in toks3]


def test_chat_rewinds_when_history_changes_and_survives_early_exit(session_parts):
    s = _session(session_parts)
    p = SamplingParams(temperature=0, max_tokens=5)
    msgs = [{"role": "user", "content": "Tell me a story"}]
    toks, done = _run(s.chat(msgs, p))
    msgs.append({"role": "assistant", "content": "".join(e.text for e in toks) + done.text})
    for ev in s.chat(msgs + [{"role": "user", "content": "go on"}], p):
        break                                                       # the UI stops early
    assert s.state.n_past == len(s.tokens)
    edited = msgs + [{"role": "user", "content": "now a joke"}]     # the last turn changed
    got, done = _run(s.chat(edited, p))
    assert done.timings.n_prompt < len(_render_ids(s, edited))      # rewound, not reset
    want, _ = _run(_session(session_parts).chat(edited, p))
    assert [e.token for e in got] == [e.token for e in want]
    s.reset()
    assert s.state.n_past == 0 and not s.tokens


def test_session_without_tokenizer_takes_ids(session_parts):
    model, _, _ = session_parts
    s = Session(model, model.new_state())
    with pytest.raises(OffloadError, match="no tokenizer"):
        s.complete("hi")
    toks, done = _run(s.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3)))
    assert len(done.tokens) == 3 and all(e.text == "" for e in toks)


def _render_ids(s: Session, msgs) -> list[int]:
    text = s.template.render(msgs, add_generation_prompt=True)
    return s.tokenizer.encode(text, parse_special=True)


def test_chat_keeps_the_reply_ids_when_their_text_tokenizes_otherwise(session_parts):
    """The next turn's text extends the cached one: the cache keeps the ids the model sampled
    (which this random model's text does not tokenize back into), only the new text is
    tokenized and prefilled, and the reply is a cold run's on those same ids."""
    model, tok, tmpl = session_parts
    s = _session(session_parts)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eog=True)
    user = [{"role": "user", "content": "What is copper"}]
    *_, first = s.chat(user, params)
    cached, text1 = list(s.tokens), s.text
    msgs = user + [{"role": "assistant", "content": tok.decode(first.tokens)},
                   {"role": "user", "content": "And then?"}]
    text2 = tmpl.render(msgs, add_generation_prompt=True, bos_token=tok.bos_token,
                        eos_token=tok.eos_token)
    assert text2.startswith(text1)
    assert tok.encode(text2, parse_special=True)[:len(cached)] != cached   # re-tokenizes otherwise
    *_, second = s.chat(msgs, params)
    new = tok.encode(text2[len(text1):], parse_special=True)
    assert second.timings.n_prompt == len(new)
    *_, cold = generate(model, model.new_state(1, 256), cached + new, params, tokenizer=tok)
    assert second.tokens == cold.tokens
    list(s.generate(tok.encode("x"), params))   # plain ids: the session no longer claims a text
    assert s.text is None
