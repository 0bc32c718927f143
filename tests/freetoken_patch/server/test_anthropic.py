"""Anthropic's Messages API (`POST /v1/messages`) with the real `anthropic` client: text on the
tiny model (greedy = generate(), usage, stop reasons), the named SSE events, stop_sequences,
a tool_use round trip and thinking on a scripted model, count_tokens, and Anthropic's error
objects for bad requests, unknown models, a wrong key and a full queue."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")

from moe_offload import SamplingParams, generate  # noqa: E402

ASK = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0}   # this client has no temperature argument; the API still takes it
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                            "days": {"type": "integer"}},
                           "required": ["city"]}}]
XML_REPLY = ["<think>\nThe user wants", " weather.\n</think>\n\n", "Let me look.", "<tool_",
             "call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"]


@pytest.fixture(scope="module")
def server(tiny_parts, kit):
    served = kit.make_served(tiny_parts, api_key="sekrit")
    with kit.live(served) as url:
        yield served, url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[1], api_key="sekrit", max_retries=0, timeout=120)


def _reference(parts, messages, max_tokens, stop=()):
    model, tok, tmpl = parts
    # no `thinking` field: the template is told enable_thinking=False, as Anthropic's API
    # gives no thinking unless asked
    ids = tmpl.render_prompt(messages, tok, enable_thinking=False).ids
    *toks, done = generate(model, model.new_state(1, 256), ids,
                           SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop),
                           tokenizer=tok)
    return "".join(e.text for e in toks) + done.text, done, ids


def test_text_greedy_matches_generate_with_usage(client, tiny_parts):
    r = client.messages.create(model="tiny", max_tokens=5, messages=ASK, extra_body=GREEDY)
    text, done, ids = _reference(tiny_parts, ASK, 5)
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny"
    assert r.id.startswith("msg_")
    assert "".join(b.text for b in r.content if b.type == "text") == text.strip()
    assert r.stop_reason == ("max_tokens" if done.reason == "length" else "end_turn")
    assert r.stop_sequence is None
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == len(ids)
    assert u.output_tokens == len(done.tokens)


def test_stream_events_and_final_message(client, server):
    kw = dict(model="default", max_tokens=5, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    names = [e.type for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    # the raw wire: named events, `type` equal to the event's name
    with httpx.stream("POST", server[1] + "/v1/messages", timeout=60,
                      headers={"x-api-key": "sekrit", "anthropic-version": "2023-06-01"},
                      json={"model": "default", "max_tokens": 5, "messages": ASK,
                            "temperature": 0, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    pairs = list(zip(lines[::2], lines[1::2]))
    assert all(e.startswith("event: ") and d.startswith("data: ") for e, d in pairs)
    assert all(json.loads(d[6:])["type"] == e[7:] for e, d in pairs)


def test_stop_sequences(client, tiny_parts):
    text, _, _ = _reference(tiny_parts, ASK, 6)
    text = text.strip()
    assert len(text) >= 3
    stop = text[1:3]
    for stream in (False, True):
        kw = dict(model="tiny", max_tokens=6, messages=ASK, extra_body=GREEDY,
                  stop_sequences=["never-seen", stop])
        if stream:
            with client.messages.stream(**kw) as s:
                r = s.get_final_message()
        else:
            r = client.messages.create(**kw)
        assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
        assert "".join(b.text for b in r.content) == text[:text.find(stop)].strip()


def test_count_tokens(client, tiny_parts):
    _, _, ids = _reference(tiny_parts, ASK, 1)
    assert client.messages.count_tokens(model="tiny", messages=ASK).input_tokens == len(ids)


# ---- a scripted model: tool use and thinking -----------------------------------------------------

@pytest.fixture(scope="module")
def served_script(tiny_parts, kit):
    """A live server on the tool template whose model says script.reply (conftest)."""
    with kit.scripted_tool_server(tiny_parts) as (url, script):
        yield url, script


@pytest.fixture(scope="module")
def scripted(served_script):
    url, _ = served_script
    yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def script(served_script):
    return served_script[1]


def test_tool_use_round_trip(scripted, script):
    script.reply = XML_REPLY
    think = {"type": "enabled", "budget_tokens": 1024}
    # no `thinking` field: no thinking block, even where the model thinks anyway
    r = scripted.messages.create(model="tiny", max_tokens=100, tools=TOOLS,
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert [b.type for b in r.content] == ["text", "tool_use"]
    r = scripted.messages.create(model="tiny", max_tokens=100, tools=TOOLS, thinking=think,
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert '"name": "get_weather"' in script.prompts[-1]          # the template saw the tool
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"]
    thinking, text, use = r.content
    assert thinking.thinking == "The user wants weather." and text.text == "Let me look."
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3}
    assert use.id.startswith("toolu_") and r.stop_reason == "tool_use"
    with scripted.messages.stream(model="tiny", max_tokens=100, tools=TOOLS, thinking=think,
                                  messages=[{"role": "user", "content": "Weather?"}]) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text", "tool_use"]
    assert streamed.content[2].input == {"city": "Paris", "days": 3}
    assert streamed.stop_reason == "tool_use"
    # the result goes back: tool_use -> the assistant's call, tool_result -> a tool message
    script.reply = ["It is 22 C."]
    r = scripted.messages.create(model="tiny", max_tokens=100, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The user wants weather.", "signature": ""},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": use.id, "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id,
             "content": [{"type": "text", "text": "22 C"}]},
            {"type": "text", "text": "And tomorrow?"}]}])
    prompt = script.prompts[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<|im_start|>tool\n<tool_response>\n22 C\n</tool_response>" in prompt
    assert prompt.index("<tool_response>") < prompt.index("And tomorrow?")
    assert [(b.type, b.text) for b in r.content] == [("text", "It is 22 C.")]
    assert r.stop_reason == "end_turn"


def test_tool_choice_any_and_tool_force_a_tool_use(scripted, script):
    """any: the prompt opens the reply with a call (thinking closed first) and the model writes
    the rest; tool: the tool's name is written for it too. Both end in one tool_use block."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    script.reply = ['{"name": "get_weather", "arguments": {"city": "Rome"}}\n', "</tool_call>"]
    r = scripted.messages.create(model="tiny", max_tokens=100, tools=TOOLS, messages=ask,
                                 tool_choice={"type": "any"})
    assert script.prompts[-1].endswith("</think>\n\n<tool_call>\n")
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "get_weather",
                                                              {"city": "Rome"})]
    assert r.stop_reason == "tool_use"
    script.reply = ['{"city": "Oslo"}}\n', "</tool_call>"]
    with scripted.messages.stream(model="tiny", max_tokens=100, tools=TOOLS, messages=ask,
                                  tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed = s.get_final_message()
    assert script.prompts[-1].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert [(b.type, b.input) for b in streamed.content] == [("tool_use", {"city": "Oslo"})]


def test_thinking_switch_system_and_tool_choice_none(scripted, script):
    script.reply = ["Four."]
    r = scripted.messages.create(model="tiny", max_tokens=10, system="Be brief.",
                                 thinking={"type": "disabled"}, tools=TOOLS,
                                 tool_choice={"type": "none"},
                                 messages=[{"role": "user", "content": "2+2?"}])
    prompt = script.prompts[-1]
    assert prompt.endswith("<think>\n\n</think>\n\n") and "<tools>" not in prompt
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt
    assert r.content[0].text == "Four."
    scripted.messages.create(model="tiny", max_tokens=10,
                             system=[{"type": "text", "text": "Be kind."}],
                             thinking={"type": "enabled", "budget_tokens": 1024},
                             messages=[{"role": "user", "content": "2+2?"}])
    assert not script.prompts[-1].endswith("</think>\n\n")
    assert "Be kind." in script.prompts[-1]


# ---- errors --------------------------------------------------------------------------------------

def _post(url, body, key="sekrit", **headers):
    return httpx.post(url + "/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": key, **headers})


def _error(r, status, kind, *words):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    for w in words:
        assert w in body["error"]["message"]


def test_bad_requests_name_the_problem(server):
    url = server[1]
    ok = {"model": "tiny", "max_tokens": 4, "messages": ASK}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}
    cases = [
        ({**ok, "max_tokens": None}, "max_tokens"),
        ({k: v for k, v in ok.items() if k != "max_tokens"}, "max_tokens is required"),
        ({**ok, "messages": [{"role": "user", "content": [image]}]}, "image block"),
        ({**ok, "messages": []}, "messages is empty"),
        # Anthropic's wording, which Claude Code matches to retry without the message
        ({**ok, "messages": [{"role": "tool", "content": "x"}]},
         'Unexpected role "tool". Allowed input message role'),
        ({**ok, "temperature": 5}, "temperature"),
        ({**ok, "thinking": {"type": "sometimes"}}, "thinking.type"),
        ({**ok, "tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "nope"),
        ({**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "client tools"),
    ]
    for body, words in cases:
        _error(_post(url, body), 400, "invalid_request_error", words)
    _error(_post(url, {**ok, "model": "claude-sonnet-4-5"}), 404, "not_found_error",
           "ANTHROPIC_MODEL")
    r = _post(url, ok, key="wrong")
    _error(r, 401, "authentication_error", "x-api-key")
    # Anthropic's SDK (Claude Code) retries a 401 for minutes unless told not to
    assert r.headers["x-should-retry"] == "false"
    r = httpx.post(url + "/v1/messages", json=ok, timeout=60,
                   headers={"Authorization": "Bearer sekrit", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200
    _error(httpx.post(url + "/v1/messages/batches", json=ok, timeout=60,
                      headers={"x-api-key": "sekrit"}), 404, "not_found_error", "/v1/messages")
    # the server still serves
    assert _post(url, ok).status_code == 200


def test_full_queue_is_overloaded(tiny_parts, kit):
    gate = threading.Event()

    def held(model, state, prompt, params, **kw):
        gate.wait(30)
        yield from kit.scripted(["x"])(model, state, prompt, params, **kw)

    served = kit.make_served(tiny_parts, parallel=1, queue=0, generate_fn=held)
    body = {"model": "tiny", "max_tokens": 2, "messages": ASK}
    with kit.live(served) as url:
        first = threading.Thread(target=_post, args=(url, body))
        first.start()
        deadline = time.monotonic() + 30
        while served.engine.n_active < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = _post(url, body)
        _error(r, 529, "overloaded_error", "busy")
        assert r.headers["Retry-After"] == "1" and r.headers["x-should-retry"] == "true"
        gate.set()
        first.join(60)
