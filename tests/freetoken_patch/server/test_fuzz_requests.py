"""Property-based fuzz of the request schemas (Hypothesis): valid requests of every route, with a
random value put anywhere in them (any JSON type, strings with lone surrogates and control
characters, deep nesting), and random keys added. Whatever a client sends, the answer is a 2xx
or a 4xx with an error object in the route's format: never a 500, never a dropped connection.
The model behind is a scripted stream (the schemas and checks are what is under test)."""
from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import httpx  # noqa: E402

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}
BASES = {
    "/v1/chat/completions": {
        "model": "tiny", "max_tokens": 4, "temperature": 0.5, "stop": ["x"], "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": "{\"city\": \"x\"}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]},
    "/v1/completions": {"model": "tiny", "prompt": "once upon", "max_tokens": 4, "seed": 3},
    "/v1/messages": {
        "model": "tiny", "max_tokens": 4, "system": [{"type": "text", "text": "be brief"}],
        "thinking": {"type": "enabled", "budget_tokens": 64},
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": [
                         {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
}

_text = st.one_of(
    st.text(alphabet=st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff", "\x00"])),
            max_size=12),
    st.sampled_from(["<|im_end|>\n<|im_start|>system", "text", "tool_use", "function", "any",
                     "enabled", "user", "assistant", "system"]))
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
              st.floats(allow_nan=False, allow_infinity=False), _text),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(_text, inner, max_size=4)),
    max_leaves=12)


def _paths(v, here=()):
    """Every place in a JSON value: tuples of keys and indices."""
    yield here
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, here + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, here + (i,))


@st.composite
def mutated(draw):
    route = draw(st.sampled_from(sorted(BASES)))
    body = copy.deepcopy(BASES[route])
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(body) if p]
        path = draw(st.sampled_from(paths))
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()):
            parent[path[-1]] = draw(_json)          # a value of any type in its place
        elif isinstance(parent, dict):
            parent[draw(_text)] = draw(_json)       # a key nobody expects
    return route, body


@pytest.fixture(scope="module")
def url(tiny_parts, kit):
    served = kit.make_served(tiny_parts, n_ctx=256, generate_fn=kit.scripted(["a", "b"]))
    with kit.live(served) as u:
        yield u


@settings(max_examples=250, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=mutated())
def test_no_request_shape_is_a_server_error(url, case):
    route, body = case
    data = json.dumps(body, ensure_ascii=True)   # lone surrogates travel as \ud800 escapes
    r = httpx.post(url + route, content=data, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (route, data[:400], r.status_code, r.text[:400])
    if r.status_code >= 400:
        err = r.json()
        assert "error" in err and err["error"].get("message"), err


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {**BASES["/v1/chat/completions"],
                              "tool_choice": {"type": "function", "function": "x"}}),
    ("/v1/chat/completions", {**BASES["/v1/chat/completions"],
                              "tool_choice": {"type": "function", "function": {"name": [1]}}}),
    ("/v1/chat/completions", {**BASES["/v1/chat/completions"], "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"function": "x"}]}]}),
    ("/v1/chat/completions", {**BASES["/v1/chat/completions"], "messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "tool_calls": [{"function": [1, 2]}]}]}),
    ("/v1/chat/completions", {**BASES["/v1/chat/completions"], "messages": [
        {"role": "user", "content": [{"type": "\ud800", "text": "x"}]}]}),
    ("/v1/messages", {**BASES["/v1/messages"], "messages": [
        {"role": "user", "content": [{"type": "\ud800", "text": "x"}]}]}),
    ("/v1/messages", {**BASES["/v1/messages"], "thinking": {"type": []}}),
    ("/v1/messages", {**BASES["/v1/messages"], "tool_choice": {"type": "tool", "name": [1]}}),
])
def test_the_shapes_that_were_server_errors_are_400s_naming_the_field(url, route, body):
    r = httpx.post(url + route, content=json.dumps(body), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert any(f in msg for f in ("tool_choice", "tool_calls", "content[0].type", "thinking")), msg
