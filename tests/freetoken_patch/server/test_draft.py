"""`serve --draft`: speculative decoding with the MTP head in the engine (one sequence at a time).
Greedy replies equal the plain server's, also when a follow-up takes over a cached State (whole,
rewound to a snapshot, or left by a client mid-step); the draft counters in /metrics and /health
move and agree with each other; the CLI defaults --parallel to 1 with --draft and refuses more."""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import httpx
import pytest

from moe_offload import DoneEvent, SamplingParams, TokenEvent

pytest.importorskip("fastapi")

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eog=True)   # the tiny model
# would often end its reply at once


@pytest.fixture(scope="module")
def mtp_parts(synth_model):
    """(model, tokenizer, template, MTP head, path) of a tiny model whose head agrees ~90%."""
    from loaders import open_model
    from loaders.chat_template import ChatTemplate
    from loaders.tokenizer import Tokenizer
    from moe_offload import build_model
    from moe_offload.models.mtp import MtpHead
    path = synth_model(mtp_agree=0.9)
    lm = open_model(path)
    model = build_model(lm, "cpu")
    return (model, Tokenizer.from_metadata(lm.metadata, str(path)),
            ChatTemplate.from_metadata(lm.metadata, str(path)), MtpHead.load(lm, model), path)


def _engine(parts, draft=None, pipeline=None, **kw):
    from freetoken_patch.server.engine import Engine
    from freetoken_patch.server.metrics import Metrics
    from moe_offload.spec import SpeculativeDecoder
    model, tok, _, head, _ = parts
    dec = None if draft is None else SpeculativeDecoder(model, head, draft, pipeline=pipeline)
    return Engine(model, tok, 256, parallel=1, metrics=Metrics(), draft=dec, **kw)


def _conversation(engine, prompts_of):
    """Run requests one after the other; prompts_of(i, earlier replies) -> (prompt, leave_after)
    or None to stop. -> [(tokens the request streamed, prompt tokens taken from the cache)]."""
    from freetoken_patch.server.engine import Job

    @dataclass(eq=False)
    class Leaving(Job):
        """A client that leaves after `after` tokens (0: stays), seen at the engine's next turn,
        inside a speculative step."""
        after: int = 0

        def put(self, item):
            super().put(item)
            if isinstance(item, TokenEvent) and self.after:
                self.after -= 1
                self.cancelled = self.after == 0

    async def run():
        engine.start()
        out = []
        while (nxt := prompts_of(len(out), [t for t, _ in out])) is not None:
            job = Leaving(nxt[0], GREEDY, after=nxt[1])
            engine.submit(job)
            toks = []
            while not nxt[1] or len(toks) < nxt[1]:
                ev = await job.events.get()
                assert not hasattr(ev, "status"), ev
                if isinstance(ev, DoneEvent):
                    break
                toks.append(ev.token)
            while engine.n_active or engine.queue_length:   # retired and cached
                await asyncio.sleep(0.005)
            if engine.draft is not None and engine.cache.size:
                # the MTP head's bookkeeping is in step with what the kept State holds
                e = engine.cache.entries[-1]
                st, owed = e.state, e.state.mtp_hidden
                assert st.mtp_past + (0 if owed is None else owed.shape[0]) == st.n_past
                assert engine.draft.ids[:st.n_past] == e.tokens
            out.append((toks, job.n_cached))
        engine.shutdown()
        return out

    return asyncio.run(run())


def test_greedy_replies_equal_the_plain_server_with_and_without_reuse(mtp_parts):
    _, tok, tmpl = mtp_parts[:3]

    def chat(system, user):
        return tok.encode(tmpl.render([{"role": "system", "content": system},
                                       {"role": "user", "content": user}],
                                      add_generation_prompt=True), add_special=False,
                          parse_special=True)

    p1 = chat("You answer briefly.", "Name three rivers")
    p3 = chat("You answer briefly.", "Which stones float")
    more = tok.encode(" and then?", add_special=False)
    turns = [lambda got: (p1, 0),                           # the first turn apart, snapshots
             lambda got: (p1 + got[0] + more, 0),            # the whole cached state goes on
             lambda got: (p1 + got[0][:3] + more, 0),        # rewound to p1's end
             lambda got: (p3, 0),                            # rewound to the system turn
             lambda got: (p3 + more, 7),                     # the client leaves mid-step ...
             lambda got: (p3 + more + got[4] + more, 0)]     # ... and that state goes on

    def prompts(i, got):
        return turns[i](got) if i < len(turns) else None

    plain = _conversation(_engine(mtp_parts), prompts)
    cut = next(i + 1 for i, t in enumerate(p1) if t in tok.eog_ids)
    assert [n for _, n in plain] == [0, len(p1) + len(plain[0][0]) - 1, len(p1), cut, len(p3),
                                     len(p3 + more) + 6]
    assert len(plain[4][0]) == 7
    for draft in (3, "auto"):
        eng = _engine(mtp_parts, draft)
        assert eng.mode == "speculative" and not eng.batched
        assert _conversation(eng, prompts) == plain, draft
        assert eng.draft.stats.accepted > 0
    # plain steps queued ahead (as on a GPU): the same replies; the client that left has its
    # last token in the cache too (the step queued on it), so the follow-up reuses one more
    queued = _conversation(_engine(mtp_parts, 0, pipeline=True), prompts)
    assert [t for t, _ in queued] == [t for t, _ in plain]
    assert [n for _, n in queued] == [n for _, n in plain][:5] + [len(p3 + more) + 7]
    nocache = _conversation(_engine(mtp_parts, 2, prefix_cache=0), prompts)
    assert [t for t, _ in nocache] == [t for t, _ in plain]
    assert all(n == 0 for _, n in nocache)


def _scrape(text: str) -> dict:
    return {m[1]: float(m[2]) for m in re.finditer(r"^ftpatch_(\w+) ([0-9.e+-]+)$", text, re.M)}


def test_counters_move_and_agree(mtp_parts, kit):
    from freetoken_patch.server.app import Served
    model, tok, tmpl, _, _ = mtp_parts
    eng = _engine(mtp_parts, 3)
    served = Served(eng, tok, tmpl, "mtp", 256, None, eng.metrics)
    with kit.live(served) as url:
        m0 = _scrape(httpx.get(url + "/metrics").text)
        assert m0["draft_steps_total"] == m0["draft_tokens_total"] == 0   # there from the start
        n_req = 3
        for i in range(n_req):
            r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": f"Count to {i + 3}"}],
                "max_tokens": 16 + 5 * i, "temperature": 0}).json()
            assert set(r["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens",
                                       "prompt_tokens_details"}       # nothing new in usage
        m = _scrape(httpx.get(url + "/metrics").text)
        h = httpx.get(url + "/health").json()
    steps, drafted, acc = m["draft_steps_total"], m["draft_tokens_total"], m["draft_accepted_total"]
    assert 0 < acc <= drafted <= 3 * steps
    assert m["draft_acceptance"] == pytest.approx(acc / drafted, abs=1e-4)
    assert m["draft_acceptance"] > 0.5                    # the head agrees ~90% with the trunk
    # every token but a request's first comes out of a step
    assert m["draft_tokens_per_step"] * steps == pytest.approx(
        m["generated_tokens_total"] - n_req, abs=1e-3 * steps)
    assert m["draft_tokens_per_step"] <= 1 + acc / steps + 1e-3
    d = h["draft"]
    assert h["mode"] == "speculative" and h["parallel"] == 1
    assert d["setting"] == 3 and (d["steps"], d["drafted"], d["accepted"]) == (steps, drafted, acc)
    assert d["acceptance"] == m["draft_acceptance"]
    # with 3 drafts a step, drafts after a refused one are not judged: the per-draft rate is higher
    assert d["judged_acceptance"] == m["draft_judged_acceptance"] >= m["draft_acceptance"]


def test_plain_server_has_no_draft_series(tiny_parts, kit):
    served = kit.make_served(tiny_parts, parallel=1)
    assert served.engine.draft_summary() is None
    assert "draft" not in served.metrics.render()


def test_engine_refuses_several_sequences(mtp_parts):
    with pytest.raises(ValueError, match="use parallel=1"):
        from freetoken_patch.server.engine import Engine
        from moe_offload.spec import SpeculativeDecoder
        model, tok, _, head, _ = mtp_parts
        Engine(model, tok, 256, parallel=2, draft=SpeculativeDecoder(model, head, 2))


def test_cli_draft_means_one_request_at_a_time(mtp_parts, tiny_model, monkeypatch, capsys):
    from freetoken_patch.cli import build_parser, main, serve
    assert main(["serve", str(mtp_parts[4]), "--draft", "2", "--parallel", "4"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ftpatch: error: --draft decodes one request at a time, not --parallel 4; "
                   "use --parallel 1, or drop --draft to batch several"]
    assert main(["serve", str(tiny_model), "--draft", "1"]) == 1     # no MTP block
    assert "--draft needs an MTP block" in capsys.readouterr().err
    seen = {}

    def load(args):
        seen["parallel"] = args.parallel
        raise SystemExit(3)
    monkeypatch.setattr(serve, "load", load)
    with pytest.raises(SystemExit):
        serve.run(build_parser().parse_args(["serve", "--draft", "auto"]))
    assert seen["parallel"] == 1
    monkeypatch.undo()
    args = build_parser().parse_args(["serve", str(mtp_parts[4]), "--ctx", "128", "--draft",
                                      "auto"])
    serve.check_draft_parallel(args)
    served = serve.load(args)
    assert serve.describe(served.engine).startswith("speculative: one sequence, auto draft")
    assert served.engine.draft_summary()["setting"] == "auto"

