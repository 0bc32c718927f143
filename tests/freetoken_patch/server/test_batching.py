"""The engine's batched mode on the tiny model: running sequences advance together in one
decode_many step, a newcomer's prompt goes in by chunks between those steps, and each request's
sampling (seed, penalties, stops, max_tokens) gives the same text alone and alongside others."""
from __future__ import annotations

import asyncio

import pytest

from moe_offload import DoneEvent, SamplingParams, generate

pytest.importorskip("fastapi")


class Logged:
    """The tiny model, logging its calls: ("prefill", tokens) and ("decode", batch size)."""

    def __init__(self, model):
        self.model, self.device, self.log = model, model.device, []

    def new_state(self, *a, **kw):
        return self.model.new_state(*a, **kw)

    def prefill(self, tokens, state, **kw):
        self.log.append(("prefill", tokens.shape[1]))
        return self.model.prefill(tokens, state, **kw)

    def decode_many(self, tokens, states):
        self.log.append(("decode", len(states)))
        return self.model.decode_many(tokens, states)


def _run_jobs(engine, jobs_at):
    """Submit Jobs [(prompt, params, after_n_events_of_job_0)]; -> (texts, dones) in order.
    A job with a delay is submitted once job 0 has streamed that many events."""
    from freetoken_patch.server.engine import Job

    async def run():
        jobs = [Job(p, params) for p, params, _ in jobs_at]
        engine.start()
        texts, dones = [""] * len(jobs), [None] * len(jobs)
        later = [(after, j) for j, (_, _, after) in zip(jobs, jobs_at) if after]
        for j, (_, _, after) in zip(jobs, jobs_at):
            if not after:
                engine.submit(j)

        async def drain(i, j):
            n = 0
            while True:
                ev = await j.events.get()
                assert not hasattr(ev, "status"), ev
                texts[i] += ev.text
                n += 1
                if i == 0:
                    for after, other in [x for x in later if x[0] <= n]:
                        engine.submit(other)
                        later.remove((after, other))
                if isinstance(ev, DoneEvent):
                    dones[i] = ev
                    return
        await asyncio.gather(*(drain(i, j) for i, j in enumerate(jobs)))
        engine.shutdown()
        return texts, dones

    return asyncio.run(run())


def _engine(parts, **kw):
    from freetoken_patch.server.engine import Engine
    model, tok, _ = parts
    return Engine(model, tok, 256, **kw)


def _alone(parts, prompt, params):
    model, tok, _ = parts
    *toks, done = generate(model, model.new_state(1, 256), prompt, params, tokenizer=tok)
    return "".join(e.text for e in toks) + done.text, done


def _prompts(tok):
    return [tok.encode(t, add_special=True) for t in
            ("The river runs", "A long time ago in a valley of stones and lanterns",
             "Copper", "Market day in the harbor town")]


PARAMS = [SamplingParams(temperature=0.9, top_k=0, top_p=0.95, min_p=0.0, seed=7, max_tokens=8),
          SamplingParams(temperature=0.0, repeat_penalty=1.3, penalty_last_n=16, max_tokens=6),
          SamplingParams(temperature=1.2, seed=123, frequency_penalty=0.5, max_tokens=9),
          SamplingParams(temperature=0.7, seed=99, presence_penalty=0.4, max_tokens=5)]


def test_seeded_requests_equal_alone_and_batched(tiny_parts):
    model, tok, tmpl = tiny_parts
    prompts, logged = _prompts(tok), Logged(model)
    eng = _engine((logged, tok, tmpl), parallel=4)
    assert eng.mode == "batched"
    texts, dones = _run_jobs(eng, [(p, q, 0) for p, q in zip(prompts, PARAMS)])
    assert max(b for kind, b in logged.log if kind == "decode") >= 3
    for p, q, text, done in zip(prompts, PARAMS, texts, dones):
        ref, ref_done = _alone(tiny_parts, p, q)
        assert (text, done.tokens, done.reason) == (ref, ref_done.tokens, ref_done.reason)


def test_running_sequences_step_together(tiny_parts):
    model, tok, tmpl = tiny_parts
    logged = Logged(model)
    eng = _engine((logged, tok, tmpl), parallel=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eog=True)
    _run_jobs(eng, [(p, params, 0) for p in _prompts(tok)[:3]])
    decodes = [b for kind, b in logged.log if kind == "decode"]
    assert max(decodes) == 3                      # all three in one step
    assert sum(decodes) == 3 * 5                  # 6 tokens: one from the prompt, 5 decode steps


def test_long_newcomer_prefilled_in_chunks_between_decode_steps(tiny_parts):
    model, tok, tmpl = tiny_parts
    logged = Logged(model)
    eng = _engine((logged, tok, tmpl), parallel=2, prefill_chunk=16)
    short = tok.encode("Once", add_special=True)
    long = tok.encode(" ".join(["river stone cloud garden lantern"] * 14), add_special=True)
    assert len(long) > 64
    run = SamplingParams(temperature=0, max_tokens=40, ignore_eog=True)
    late = SamplingParams(temperature=0, max_tokens=3, ignore_eog=True)
    texts, dones = _run_jobs(eng, [(short, run, 0), (long, late, 3)])
    chunks = [i for i, (kind, n) in enumerate(logged.log) if kind == "prefill" and n != len(short)]
    assert len(chunks) == -(-len(long) // 16)
    assert all(n <= 16 for kind, n in logged.log if kind == "prefill")
    # the running stream took a decode step between each two chunks of the newcomer's prompt
    for a, b in zip(chunks, chunks[1:]):
        assert ("decode", 1) in logged.log[a + 1:b]
    assert texts[1] == _alone(tiny_parts, long, late)[0]
    assert dones[0].tokens == _alone(tiny_parts, short, run)[1].tokens


def test_a_prompt_with_no_one_waiting_goes_in_whole(tiny_parts):
    """Chunks exist so running streams keep flowing; alone, a long prompt is one prefill."""
    model, tok, tmpl = tiny_parts
    logged = Logged(model)
    eng = _engine((logged, tok, tmpl), parallel=2, prefill_chunk=16)
    long = tok.encode(" ".join(["river stone cloud garden lantern"] * 14), add_special=True)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eog=True)
    texts, _ = _run_jobs(eng, [(long, params, 0)])
    assert [e for e in logged.log if e[0] == "prefill"] == [("prefill", len(long))]
    assert texts[0] == _alone(tiny_parts, long, params)[0]


def test_stop_strings_and_limits_batched(tiny_parts):
    """Stops cut mid-stream while the others go on; each ends for its own reason."""
    prompts = _prompts(tiny_parts[1])
    free = SamplingParams(temperature=0, max_tokens=7)
    ref, _ = _alone(tiny_parts, prompts[0], free)
    assert len(ref) >= 3
    stop = SamplingParams(temperature=0, max_tokens=7, stop=(ref[2:4],))
    eng = _engine(tiny_parts, parallel=4)
    texts, dones = _run_jobs(eng, [(prompts[0], stop, 0), (prompts[1], free, 0),
                                   (prompts[2], SamplingParams(temperature=0, max_tokens=2), 0)])
    assert texts[0] == ref[:ref.find(ref[2:4])] and dones[0].reason == "stop"
    assert texts[1] == _alone(tiny_parts, prompts[1], free)[0]
    assert len(dones[2].tokens) <= 2


def test_mode_is_chosen_and_shown(tiny_parts, kit):
    import httpx
    from freetoken_patch.cli.serve import describe
    eng = _engine(tiny_parts, batch=False)
    assert eng.mode == "interleaved" and describe(eng).startswith("interleaved")
    served = kit.make_served(tiny_parts)
    assert served.engine.mode == "batched" and describe(served.engine).startswith("batched")
    scripted = kit.make_served(tiny_parts, generate_fn=kit.scripted(["a"]))
    assert scripted.engine.mode == "interleaved"          # a stand-in stream cannot batch
    with kit.live(served) as url:
        h = httpx.get(url + "/health").json()
        assert h["mode"] == "batched" and h["prefill_chunk"] == 256
        text = httpx.get(url + "/metrics").text
        assert "ftpatch_decode_batch_size" in text
        assert 'ftpatch_engine_busy_seconds_total{phase="decode"}' in text
        assert "# TYPE ftpatch_engine_busy_seconds_total counter" in text


class NanRowOnce(Logged):
    """Logged, but the second decode step's first row comes back as NaN (a broken sequence)."""

    def decode_many(self, tokens, states):
        out = super().decode_many(tokens, states)
        if sum(kind == "decode" for kind, _ in self.log) == 2:
            out = out.clone()
            out[0] = float("nan")
        return out


def _collect(engine, *waves):
    """Submit each wave of requests [(prompt, params)] once the one before has ended; -> the
    last event of every request (a DoneEvent or a Failure), in order."""
    from freetoken_patch.server.engine import Job

    async def drain(j):
        while True:
            ev = await j.events.get()
            if isinstance(ev, DoneEvent) or hasattr(ev, "status"):
                return ev

    async def run():
        engine.start()
        out = []
        for wave in waves:
            jobs = [Job(p, params) for p, params in wave]
            for j in jobs:
                engine.submit(j)
            out += await asyncio.gather(*(drain(j) for j in jobs))
        engine.shutdown()
        return out
    return asyncio.run(run())


def test_a_sequence_whose_sampling_fails_leaves_the_batch_alone(tiny_parts):
    """A NaN row fails its request (the logits named as the cause), the others finish as alone."""
    model, tok, tmpl = tiny_parts
    prompts = _prompts(tok)[:3]
    sampled = SamplingParams(temperature=0.9, seed=1, max_tokens=6, ignore_eog=True)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eog=True)
    eng = _engine((NanRowOnce(model), tok, tmpl), parallel=4)
    last = _collect(eng, [(prompts[0], sampled), (prompts[1], greedy), (prompts[2], greedy)])
    assert getattr(last[0], "status", None) == 500 and "are not finite" in last[0].message
    for p, ev in zip(prompts[1:], last[1:]):
        assert isinstance(ev, DoneEvent) and ev.tokens == _alone(tiny_parts, p, greedy)[1].tokens


def test_the_engine_outlives_a_failed_step(tiny_parts):
    """An error the step's own guards do not catch fails the sequences of that step; the
    engine thread goes on and serves the next request."""
    model, tok, tmpl = tiny_parts
    eng = _engine(tiny_parts, parallel=2)
    real, calls = eng._batch_step, []

    def flaky(ring):
        calls.append(len(ring))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(ring)
    eng._batch_step = flaky
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eog=True)
    p = _prompts(tok)[0]
    first, second = _collect(eng, [(p, greedy)], [(p, greedy)])
    assert getattr(first, "status", None) == 500 and "boom" in first.message
    assert isinstance(second, DoneEvent) and second.tokens == _alone(tiny_parts, p, greedy)[1].tokens


@pytest.mark.parametrize("batch", [True, False])
def test_a_follow_up_continues_from_the_reply_ids_it_was_sent_as_text(tiny_parts, batch):
    """The client returns the reply as text, which need not tokenize into the sampled ids again
    (this random model's rarely do): the follow-up continues from the cached ids, only the new
    text tokenized, and answers as a cold run fed those same ids."""
    from freetoken_patch.server.engine import Job
    model, tok, tmpl = tiny_parts
    eng = _engine(tiny_parts, parallel=2, batch=None if batch else False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eog=True)
    user = [{"role": "user", "content": "What is copper"}]
    text1 = tmpl.render(user, add_generation_prompt=True)
    ids1 = tok.encode(text1, parse_special=True)

    async def run():
        eng.start()
        job1 = Job(ids1, params, text=text1)
        eng.submit(job1)
        while not isinstance(ev := await job1.events.get(), DoneEvent):
            pass
        reply = list(ev.tokens)
        text2 = tmpl.render(user + [{"role": "assistant", "content": tok.decode(reply)},
                                    {"role": "user", "content": "And then?"}],
                            add_generation_prompt=True)
        job2 = Job(tok.encode(text2, parse_special=True), params, text=text2)
        eng.submit(job2)
        while not isinstance(ev2 := await job2.events.get(), DoneEvent):
            pass
        eng.shutdown()
        return reply, text2, job2, ev2
    reply, text2, job2, done2 = asyncio.run(run())
    fed = ids1 + reply[:-1]                      # the last sampled id is never fed
    rest = text2[len(text1 + tok.decode(reply[:-1])):]
    assert text2.startswith(text1 + tok.decode(reply[:-1]))
    assert job2.n_cached == len(fed) and job2.prompt == fed + tok.encode(rest, parse_special=True)
    canonical = tok.encode(text2, parse_special=True)
    assert canonical[:len(fed)] != fed           # this reply re-tokenizes into other ids
    ref = generate(model, model.new_state(1, 256), job2.prompt, params, tokenizer=tok)
    assert list(done2.tokens) == list([*ref][-1].tokens)


def test_a_short_newcomer_goes_in_pieces_that_fill_the_decode_steps(tiny_parts, monkeypatch):
    """A backend that runs short prompts as decode-sized steps (the offload runtime's
    prompt_piece: 8 tokens a step in all) has a newcomer's short prompt fed beside the running
    stream, 7 tokens a step, through decode_many_with_prompt (here one after the other), the
    last piece what is left; both texts equal alone."""
    from types import SimpleNamespace as NS

    from moe_offload.backend import PlainBackend
    from moe_offload.config import OffloadPolicy
    from moe_offload.offload import prompts
    runtime_like = NS(policy=OffloadPolicy(), engine=NS(max_tok=8))
    monkeypatch.setattr(PlainBackend, "prompt_piece", lambda self, n, chunk, beside=0:
                        prompts.prompt_piece(runtime_like, n, chunk, beside))
    model, tok, tmpl = tiny_parts
    logged = Logged(model)
    eng = _engine((logged, tok, tmpl), parallel=2, prefill_chunk=1024)
    short = tok.encode("Once", add_special=True)
    newcomer = tok.encode("A long time ago in a valley of stones and lanterns, by the river, "
                          "the market opened", add_special=True)
    assert 16 < len(newcomer) <= OffloadPolicy().short_prompt and len(newcomer) % 7
    run = SamplingParams(temperature=0, max_tokens=40, ignore_eog=True)
    late = SamplingParams(temperature=0, max_tokens=3, ignore_eog=True)
    texts, dones = _run_jobs(eng, [(short, run, 0), (newcomer, late, 3)])
    pieces = [i for i, (kind, n) in enumerate(logged.log) if kind == "prefill" and i > 0]
    assert [logged.log[i][1] for i in pieces] == [7] * (len(newcomer) // 7) + [len(newcomer) % 7]
    for i in pieces:   # each piece in the step of the running stream's decode
        assert logged.log[i - 1] == ("decode", 1)
    assert texts[1] == _alone(tiny_parts, newcomer, late)[0]
    assert dones[0].tokens == _alone(tiny_parts, short, run)[1].tokens
