"""Tool calls and reasoning end to end with the `openai` client: the tools reach the chat
template, a scripted model reply (the tiny model cannot write one) comes back as tool_calls
(whole and as stream deltas) or reasoning_content, and tool results go back in."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}]
XML_REPLY = ["<think>\nThe user wants", " weather.\n</think>\n\n", "<tool_", "call>\n<function=",
             "get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n",
             "</parameter>\n</function>\n</tool_call>"]


@pytest.fixture(scope="module")
def served_script(tiny_parts, kit):
    """A live server on the tool template whose model says script.reply (conftest)."""
    with kit.scripted_tool_server(tiny_parts) as (url, script):
        yield url, script


@pytest.fixture(scope="module")
def client(served_script):
    url, _ = served_script
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def script(served_script):
    return served_script[1]


ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_tool_call_returned_whole(client, script):
    script.reply = XML_REPLY
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
    assert '"name": "get_weather"' in script.prompts[-1]            # the template saw the tools
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert choice.message.content is None
    assert choice.message.reasoning_content == "The user wants weather."


def test_tool_call_streamed_as_deltas(client, script):
    script.reply = XML_REPLY
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                                 stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks)
    assert reasoning == "The user wants weather."
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_json_style_call_and_tool_choice_none(client, script):
    script.reply = ['<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n',
                    "</tool_call>"]
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "<tools>" not in script.prompts[-1]
    assert r.choices[0].message.content == "".join(script.reply)


def test_tool_result_round_trip(client, script):
    script.reply = ["It is ", "22 C in Paris."]
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "22 C"}]}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS)
    prompt = script.prompts[-1]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n22 C\n</tool_response>" in prompt
    assert r.choices[0].message.content == "It is 22 C in Paris."
    assert r.choices[0].finish_reason == "stop"


def test_reasoning_split_and_thinking_switch(client, script):
    script.reply = ["<think>", "\n2+2", " is 4\n</think>", "\n\nFour."]
    r = client.chat.completions.create(model="tiny", messages=ASK)
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == ("2+2 is 4", "Four.")
    script.reply = ["Four."]
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model="tiny", messages=ASK, extra_body=no_think)
    assert script.prompts[-1].endswith("<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == "Four."
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


def test_tool_choice_required_and_named_force_a_call(client, script):
    """required: the prompt opens the reply with a call (thinking closed first), and the model
    only writes the rest; a named function: the call's name is written for it too. Both come
    back as tool_calls, whole and streamed."""
    script.reply = ['{"name": "get_weather", "arguments": {"city": "Oslo"}}\n', "</tool_call>"]
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                       tool_choice="required")
    assert script.prompts[-1].endswith("</think>\n\n<tool_call>\n")
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                          {"city": "Oslo"})
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content

    script.reply = ['{"city": "Lima", "days": 2}}\n', "</tool_call>"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                                 tool_choice=named, stream=True))
    assert script.prompts[-1].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Lima", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice,param", [
    ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ("sometimes", "tool_choice")])
def test_bad_tool_choice_is_a_400(client, choice, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice)
    assert e.value.body["param"] == param


def test_required_without_tools_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required")
    assert "required needs tools" in e.value.body["message"]


def test_forced_prefix_follows_the_templates_call_style():
    from freetoken_patch.server.openai_format import forced_call_prefix
    assert forced_call_prefix("{{ x }}", None) == "<tool_call>\n"
    assert forced_call_prefix("<function={{ name }}>", "f") == "<tool_call>\n<function=f>\n"
    assert forced_call_prefix("{{ tojson }}", "f") == '<tool_call>\n{"name": "f", "arguments": '
