"""The token stream's mask hook and logprobs on the tiny model: generate() under a grammar
gives only what the grammar allows (the server's batched step, which drives the same
TokenStream, is held to the same ids in tests/freetoken_patch/server/test_agents.py), and each
token's logprob is the model's log-softmax."""
from __future__ import annotations

import json

import pytest
import torch

from moe_offload import GrammarConstraint, SamplingParams, TokenStream, generate

llguidance = pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99},
                                           "c": {"enum": ["red", "blue"]}},
          "required": ["n", "c"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def parts(tiny_model):
    from loaders import open_model
    from loaders.tokenizer import Tokenizer
    from moe_offload import build_model
    lm = open_model(tiny_model)
    return build_model(lm, "cpu"), Tokenizer.from_metadata(lm.metadata, str(tiny_model))


def _grammar():
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))


@pytest.mark.parametrize("seed", range(3))
def test_generate_under_a_grammar_gives_what_it_allows(parts, seed):
    model, tok = parts
    ids = tok.encode("json:")
    c = GrammarConstraint(_grammar(), tok, model.config.n_vocab)
    *evs, done = generate(model, model.new_state(1, 256), ids,
                          SamplingParams(temperature=1.5, seed=seed, max_tokens=200),
                          tokenizer=tok, constraint=c)
    assert done.reason == "eog"
    out = json.loads("".join(e.text for e in evs) + done.text)
    assert set(out) == {"n", "c"} and 0 <= out["n"] <= 99 and out["c"] in ("red", "blue")
    # without the grammar the same seed writes something else entirely
    *evs2, _ = generate(model, model.new_state(1, 256), ids,
                        SamplingParams(temperature=1.5, seed=seed, max_tokens=20), tokenizer=tok)
    with pytest.raises(ValueError):
        json.loads("".join(e.text for e in evs2))


def test_logprobs_are_the_models_log_softmax(parts):
    model, tok = parts
    ids = tok.encode("The sea")
    st = model.new_state(1, 64)
    logits = model.prefill(torch.tensor([ids]), st)
    s = TokenStream(SamplingParams(temperature=0, logprobs=3, max_tokens=5), "cpu", tok, ids,
                    len(ids))
    ev = s.push(logits, 10)[0]
    lp = torch.log_softmax(logits.float(), -1)[0]
    assert ev.logprob.token == ev.token == int(lp.argmax())
    assert ev.logprob.logprob == pytest.approx(float(lp.max()), abs=1e-5)
    top = lp.topk(3)
    assert [i for i, _ in ev.logprob.top] == top.indices.tolist()
    assert [v for _, v in ev.logprob.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    off = TokenStream(SamplingParams(temperature=0, max_tokens=5), "cpu", tok, ids, len(ids))
    assert off.push(logits, 10)[0].logprob is None


@pytest.mark.parametrize("seed", range(3))
def test_a_triggered_grammar_holds_only_what_follows_its_trigger(parts, seed):
    """TriggeredConstraint in generate(): the reply is the unconstrained one up to and with the
    trigger id (no mask before it), then what the grammar allows, closed; then free again."""
    from moe_offload import TriggeredConstraint
    model, tok = parts
    ids = tok.encode("json:")
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=120, ignore_eog=True)
    *free, _ = generate(model, model.new_state(1, 256), ids, params, tokenizer=tok)
    trigger = free[2].token                     # the third id the model takes by itself
    grammar = 'start: "<" /[a-z]{1,6}/ ">"\n'   # a short tag, then free again
    c = TriggeredConstraint([trigger], lambda: GrammarConstraint(grammar, tok, model.config.n_vocab))
    *evs, _ = generate(model, model.new_state(1, 256), ids, params, tokenizer=tok, constraint=c)
    got = [e.token for e in evs]
    cut = got.index(trigger) + 1
    assert got[:cut] == [e.token for e in free[:cut]]
    assert c.triggered >= 1
    text = tok.decode(got[cut:])
    import re
    assert re.match(r"<[a-z]{1,6}>", text), text


def test_a_reasoning_block_pauses_the_trigger():
    """Between a pause id and a resume id the trigger opens nothing."""
    from moe_offload import TriggeredConstraint

    class Once:
        finished = False

        def allowed(self):
            return torch.ones(1, dtype=torch.int32)

        def advance(self, token):
            self.finished = True
    c = TriggeredConstraint([5], Once, pause_ids=[1], resume_ids=[2], paused=True)
    for t in (5, 3, 2):
        c.advance(t)
    assert c.triggered == 0 and c.allowed() is None
    c.advance(1), c.advance(5)
    assert c.triggered == 0 and c.paused
    c.advance(2), c.advance(5)
    assert c.triggered == 1 and c.allowed() is not None
    c.advance(9)
    assert c.finished and c.allowed() is None
