"""The real `openai` client against `ftpatch serve`'s app on the tiny model (uvicorn on
127.0.0.1, one server for the module): chat and completions, streamed and not, usage, stop
strings, seeds, greedy decoding and prefix reuse (equal tokens, fewer prefilled)."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from moe_offload import Backend, Capabilities, SamplingParams, generate  # noqa: E402

MSGS = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def server(tiny_parts, kit):
    served = kit.make_served(tiny_parts)
    with kit.live(served) as url:
        yield served, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _reference(parts, ids, params):
    """What generate() gives on a fresh state (no server, no reuse)."""
    model, tok, _ = parts
    *toks, done = generate(model, model.new_state(1, 256), ids, params, tokenizer=tok)
    return "".join(e.text for e in toks) + done.text, done


def _chat_ids(parts, messages):
    _, tok, tmpl = parts
    return tok.encode(tmpl.render(messages, add_generation_prompt=True, bos_token=tok.bos_token,
                                  eos_token=tok.eos_token), parse_special=True)


def test_chat_greedy_matches_generate_with_usage(client, tiny_parts):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0)
    ids = _chat_ids(tiny_parts, MSGS)
    text, done = _reference(tiny_parts, ids, SamplingParams(temperature=0, max_tokens=4))
    assert r.choices[0].message.content == text.strip()
    assert r.choices[0].finish_reason == ("length" if done.reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(done.tokens)
    assert r.usage.total_tokens == len(ids) + len(done.tokens)
    assert r.model == "tiny" and r.object == "chat.completion"


def test_chat_stream_equals_non_stream_and_reports_usage(client):
    kw = dict(model="default", messages=MSGS, max_completion_tokens=4, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    plain = list(client.chat.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in plain)                  # usage only when asked


def test_completions_stream_and_not(client, tiny_parts):
    _, tok, _ = tiny_parts
    prompt = "Once upon a time"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    ids = tok.encode(prompt, add_special=True, parse_special=True)
    text, done = _reference(tiny_parts, ids, SamplingParams(temperature=0, max_tokens=4))
    assert r.choices[0].text == text and r.usage.prompt_tokens == len(ids)
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text


def test_seed_reproducible(client):
    kw = dict(model="tiny", prompt="The weather today", max_tokens=4, temperature=1.0, top_p=1.0,
              extra_body={"top_k": 0, "min_p": 0.0})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b


def test_stop_string_cut_across_tokens(client, tiny_parts):
    model, tok, _ = tiny_parts
    prompt = "In the beginning"
    ids = tok.encode(prompt, add_special=True, parse_special=True)
    *toks, _ = generate(model, model.new_state(1, 256), ids,
                        SamplingParams(temperature=0, max_tokens=6), tokenizer=tok)
    pieces = [e.text for e in toks]
    b = len(pieces[0])                       # the boundary between the first two tokens' text
    full = "".join(pieces)
    assert b >= 1 and pieces[1]
    stop = full[b - 1:b + 1]                 # its last character and the next one's first
    cut = full[:full.find(stop)]
    for stream in (False, True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                      stop=[stop, "never-seen"], stream=stream)
        chunks = list(r) if stream else [r]
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == \
            ["stop"]


def test_prefix_reuse_equals_fresh_prefill(client, server, tiny_parts):
    served, _ = server
    first = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3,
                                           temperature=0)
    follow = MSGS + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And the mountains?"}]
    before = served.engine.prefilled_tokens
    r = client.chat.completions.create(model="tiny", messages=follow, max_tokens=4,
                                       temperature=0)
    ids = _chat_ids(tiny_parts, follow)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens                  # the first prompt was reused
    assert served.engine.prefilled_tokens - before == len(ids) - cached
    text, _ = _reference(tiny_parts, ids, SamplingParams(temperature=0, max_tokens=4))
    assert r.choices[0].message.content == text.strip()


def test_models_health_metrics(client, server):
    served, url = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok" and h["parallel"] == 4
    text = httpx.get(url + "/metrics").text
    assert 'ftpatch_requests_total{endpoint="/v1/models",status="200"} 1' in text
    for name in ("ftpatch_prompt_tokens_total", "ftpatch_generated_tokens_total",
                 "ftpatch_queue_length", "ftpatch_requests_in_flight",
                 "ftpatch_time_to_first_token_seconds_bucket",
                 "ftpatch_decode_tokens_per_second_count"):
        assert name in text


class OneState(Backend):
    """The tiny model as the offload runtime presents it: one State for every new_state()
    call, and stats()."""

    caps = Capabilities(max_sequences=1, batched=False, speculative=False, shared_state=True,
                        offload=True)

    def __init__(self, model):
        self.model, self.device = model, model.device
        self.state = model.new_state(1, 256)

    def new_state(self, batch=1, n_ctx=None):
        self.state.reset()
        return self.state

    def prefill(self, *a, **kw):
        return self.model.prefill(*a, **kw)

    def decode(self, *a, **kw):
        return self.model.decode(*a, **kw)

    def stats(self):
        return {"hit_rate": 0.75, "cache_bytes": 1 << 20, "kv_bytes": 4096, "pcie_bytes": 0}


def test_one_state_runtime_runs_one_sequence_and_reuses_it(tiny_parts, kit):
    model, tok, tmpl = tiny_parts
    served = kit.make_served((OneState(model), tok, tmpl), parallel=4)
    assert served.engine.single_state and served.engine.parallel == 1
    with kit.live(served) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        first = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, temperature=0)
        follow = MSGS + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "More?"}]
        r = c.chat.completions.create(model="tiny", messages=follow, max_tokens=3, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        text, _ = _reference(tiny_parts, _chat_ids(tiny_parts, follow),
                             SamplingParams(temperature=0, max_tokens=3))
        assert r.choices[0].message.content == text.strip()
        # a conversation that shares nothing starts over on the same State
        other = [{"role": "system", "content": "Be brief."}] + MSGS
        r2 = c.chat.completions.create(model="tiny", messages=other, max_tokens=2, temperature=0)
        text2, _ = _reference(tiny_parts, _chat_ids(tiny_parts, other),
                              SamplingParams(temperature=0, max_tokens=2))
        assert r2.choices[0].message.content == text2.strip()
        metrics = httpx.get(url + "/metrics").text
    assert "ftpatch_expert_cache_hit_rate 0.75" in metrics
    assert "ftpatch_expert_cache_bytes 1048576" in metrics


class FewStates(OneState):
    """The tiny model as an offload runtime opened for `n` sequences presents it: distinct States
    up to n in use at once (new_state refuses more), release() hands one back, decode_many."""

    def __init__(self, model, n):
        self.model, self.device, self.max_sequences = model, model.device, n
        self.caps = Capabilities(max_sequences=n, batched=True, speculative=False,
                                 shared_state=False, offload=True)
        self.free = [model.new_state(1, 256) for _ in range(n)]
        self.in_use: list = []

    def new_state(self, batch=1, n_ctx=None):
        assert self.free, f"more than {self.max_sequences} states asked for"
        st = self.free.pop()
        self.in_use.append(st)
        st.reset()
        return st

    def release(self, st):
        self.in_use.remove(st)
        self.free.append(st)

    def decode_many(self, tokens, states):
        return self.model.decode_many(tokens, states)

    def prepare_batches(self, states):
        self.prepared = len(states)


def test_runtime_of_a_few_sequences_batches_within_them(tiny_parts, kit):
    """--vram with --parallel 2: the engine asks the runtime for no more states than it holds,
    takes them at start and has their batched steps made ready (captured, on a GPU), batches
    them, and three clients at once all finish with the text each would get alone."""
    import concurrent.futures as cf
    model, tok, tmpl = tiny_parts
    rt = FewStates(model, 2)
    served = kit.make_served((rt, tok, tmpl), parallel=4, prefix_cache=4)
    eng = served.engine
    assert (eng.mode, eng.parallel, eng.single_state) == ("batched", 2, False)
    assert len(rt.in_use) == 2 and rt.prepared == 2   # the engine's states, steps made ready
    asks = [[{"role": "user", "content": f"Count to {n}."}] for n in (3, 4, 5)]
    with kit.live(served) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with cf.ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda m: c.chat.completions.create(
                model="tiny", messages=m, max_tokens=4, temperature=0), asks))
    for m, r in zip(asks, outs):
        text, _ = _reference(tiny_parts, _chat_ids(tiny_parts, m),
                             SamplingParams(temperature=0, max_tokens=4))
        assert r.choices[0].message.content == text.strip()
    assert len(rt.in_use) <= 2


def test_shared_system_prompt_reused_across_conversations(client, server, tiny_parts):
    served, _ = server
    system = {"role": "system", "content": "You answer questions about geography, briefly."}
    a = [system, {"role": "user", "content": "Where is Lima?"}]
    b = [system, {"role": "user", "content": "Which river runs through Cairo?"}]
    ra = client.chat.completions.create(model="tiny", messages=a, max_tokens=2, temperature=0)
    rb = client.chat.completions.create(model="tiny", messages=b, max_tokens=3, temperature=0)
    ids_a, ids_b = _chat_ids(tiny_parts, a), _chat_ids(tiny_parts, b)
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    cached = rb.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= shared                  # the system turn, not more
    assert ra.usage.prompt_tokens_details.cached_tokens < cached
    text, _ = _reference(tiny_parts, ids_b, SamplingParams(temperature=0, max_tokens=3))
    assert rb.choices[0].message.content == text.strip()
