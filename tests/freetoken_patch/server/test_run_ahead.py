"""The batched engine running ahead (a GPU's default, forced here on the CPU): the step after
the drawn ids is queued before the host reads them. Every request streams what it streams
without that, and a sequence that ends on an end-of-generation id, which a step ran ahead on,
is cached with that id: a follow-up that reuses it answers as a cold run."""
from __future__ import annotations

import asyncio

import pytest

from moe_offload import DoneEvent, SamplingParams, generate

from .test_batching import PARAMS, Logged, _alone, _prompts, _run_jobs

pytest.importorskip("fastapi")


class EogAt:
    """The tokenizer with `eog` as its end-of-generation ids (to end a random model's reply)."""

    def __init__(self, tok, eog):
        self._tok, self.eog_ids = tok, frozenset(eog)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _engine(model, tok, **kw):
    from freetoken_patch.server.engine import Engine
    return Engine(model, tok, 256, **kw)


def test_running_ahead_streams_what_the_plain_steps_stream(tiny_parts):
    model, tok, _ = tiny_parts
    prompts, logged = _prompts(tok), Logged(model)
    eng = _engine(logged, tok, parallel=4, run_ahead=True)
    reads = []
    plain = eng._readback
    eng._readback = lambda ids, queue_next: reads.append(len(ids)) or plain(ids, queue_next)
    texts, dones = _run_jobs(eng, [(p, q, 0) for p, q in zip(prompts, PARAMS)])
    assert max(reads) >= 3                          # steps of several ran ahead
    for p, q, text, done in zip(prompts, PARAMS, texts, dones):
        ref, ref_done = _alone(tiny_parts, p, q)
        assert (text, done.tokens, done.reason) == (ref, ref_done.tokens, ref_done.reason)


def test_no_step_runs_ahead_where_the_host_must_look_first(tiny_parts):
    """Stop strings, the last allowed token: the next step waits for the host's read."""
    model, tok, _ = tiny_parts
    p = _prompts(tok)[0]
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eog=True)
    ref, _ = _alone(tiny_parts, p, free)
    for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eog=True, stop=("\x00",)),
                   SamplingParams(temperature=0, max_tokens=1, ignore_eog=True)):
        logged = Logged(model)
        eng = _engine(logged, tok, parallel=2, run_ahead=True)
        texts, dones = _run_jobs(eng, [(p, params, 0)])
        assert texts[0] == ref[:len(texts[0])] and len(dones[0].tokens) == params.max_tokens
        # one decode step for each token after the first, none wasted
        assert sum(b for kind, b in logged.log if kind == "decode") == params.max_tokens - 1


@pytest.mark.parametrize("run_ahead", [True, False])
def test_a_reply_ended_by_eog_is_cached_as_its_state_holds_it(tiny_parts, run_ahead):
    from freetoken_patch.server.engine import Job
    model, tok, _ = tiny_parts
    p = _prompts(tok)[1]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eog=True)
    reply = list(_alone(tiny_parts, p, greedy)[1].tokens)
    end = next(i for i, t in enumerate(reply) if i >= 2 and t not in reply[:i])
    eog_tok = EogAt(tok, {reply[end]})
    eng = _engine(model, eog_tok, parallel=2, run_ahead=run_ahead)
    params = SamplingParams(temperature=0, max_tokens=12)

    async def run(prompt):
        job = Job(prompt, params)
        eng.submit(job)
        while not isinstance(ev := await job.events.get(), DoneEvent):
            pass
        return job, ev

    async def both():
        eng.start()
        first = await run(p)
        for _ in range(500):   # the engine caches the State once the reply has gone out
            if eng.cache.entries:
                break
            await asyncio.sleep(0.01)
        entry = eng.cache.entries[-1]
        held = (list(entry.tokens), entry.state.n_past)
        follow = p + reply[:end + 1] + tok.encode(" and then", add_special=False)
        second = await run(follow)
        eng.shutdown()
        return first, held, follow, second

    (_, done1), (tokens, n_past), follow, (job2, done2) = asyncio.run(both())
    assert done1.reason == "eog" and list(done1.tokens) == reply[:end + 1]
    # the State holds the eog id iff a step ran ahead on it, and the entry says what it holds
    assert n_past == len(p) + end + (1 if run_ahead else 0)
    assert tokens == (p + reply)[:n_past]
    assert job2.n_cached == n_past
    ref = [*generate(model, model.new_state(1, 256), follow, params, tokenizer=eog_tok)][-1]
    assert (done2.tokens, done2.reason) == (ref.tokens, ref.reason)


def test_a_batch_of_the_same_states_keeps_one_order(tiny_parts):
    """The engine passes a batch's States in one order (first seen first) whichever request
    arrived first: a batch's rows do not move as requests come and go."""
    model, tok, _ = tiny_parts

    class Orders(Logged):
        def decode_many(self, tokens, states):
            self.log.append(tuple(id(st) for st in states))
            return self.model.decode_many(tokens, states)

    logged = Orders(model)
    eng = _engine(logged, tok, parallel=2, prefix_cache=0)
    a, b, c = _prompts(tok)[:3]
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eog=True)
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eog=True)
    # c takes a's State once a is done, and joins the ring after b's
    _run_jobs(eng, [(a, short, 0), (b, long, 0), (c, short, 4)])
    pairs = [o for o in logged.log if o[0] != "prefill" and len(o) == 2]
    assert len(pairs) >= 2 and len({frozenset(o) for o in pairs}) == 1
    assert len(set(pairs)) == 1


@pytest.mark.parametrize("run_ahead", [True, False])
def test_a_failed_decode_step_fails_its_requests_and_caches_none_of_their_states(tiny_parts,
                                                                                   run_ahead):
    from .test_batching import _collect
    model, tok, _ = tiny_parts

    class FailsOnce(Logged):
        def decode_many(self, tokens, states):
            if not getattr(self, "failed", False) and len(states) == 2:
                self.failed = True
                raise RuntimeError("step boom")
            return self.model.decode_many(tokens, states)

    eng = _engine(FailsOnce(model), tok, parallel=2, run_ahead=run_ahead)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eog=True)
    a, b = _prompts(tok)[:2]
    first = _collect(eng, [(a, greedy), (b, greedy)])
    assert all(getattr(ev, "status", None) == 500 and "step boom" in ev.message for ev in first)
    assert eng.cache.entries == []        # half-written States are emptied, not kept for reuse
    healthy = FailsOnce(model)
    healthy.failed = True
    eng2 = _engine(healthy, tok, parallel=2, run_ahead=run_ahead)
    eng2._free, eng2._n_states = eng._free, eng._n_states   # the same States, emptied
    again = _collect(eng2, [(a, greedy), (b, greedy)])
    for p, ev in zip((a, b), again):
        assert isinstance(ev, DoneEvent) and ev.tokens == _alone(tiny_parts, p, greedy)[1].tokens


def test_a_failed_prompt_chunk_fails_its_request_once_and_the_batch_goes_on(tiny_parts):
    from .test_batching import _collect
    model, tok, _ = tiny_parts

    class PrefillFailsOnce(Logged):
        def prefill(self, tokens, state, **kw):
            self.log.append(("prefill", tokens.shape[1]))
            if not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("prefill boom")
            return self.model.prefill(tokens, state, **kw)

    logged = PrefillFailsOnce(model)
    eng = _engine(logged, tok, parallel=2)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eog=True)
    a, b = _prompts(tok)[:2]
    first, second = _collect(eng, [(a, greedy)], [(b, greedy)])
    assert getattr(first, "status", None) == 500 and "prefill boom" in first.message
    assert isinstance(second, DoneEvent) and second.tokens == _alone(tiny_parts, b, greedy)[1].tokens
    # the failed request left: its prompt was not fed again, nor decoded
    assert [e for e in logged.log if e[0] == "prefill"] == [("prefill", len(a)), ("prefill", len(b))]
