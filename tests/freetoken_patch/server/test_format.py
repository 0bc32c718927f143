"""The reply parsers on scripted text: the reasoning block and tool calls (XML and JSON
styles), fed whole and one character at a time (a stream's worst case), which must agree."""
from __future__ import annotations

import json

import pytest

from freetoken_patch.server.openai_format import (ApiError, OutputParser, ReasoningSplitter,
                                                  collect, content_text, parse_tool_block,
                                                  template_messages)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]

XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
JSON_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
             '</tool_call>')


def _run(text, prompt="", tools=None, step=None):
    p = OutputParser(prompt, tools, parse_tools=tools is not None)
    parts = []
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    for piece in pieces:
        parts += p.push(piece)
    parts += p.finish()
    return collect(parts)


@pytest.mark.parametrize("step", [None, 1, 3])
def test_reasoning_block_split_from_content(step):
    r, c, calls = _run("<think>\nLet me see.\n</think>\n\nThe answer is 4.", step=step)
    assert (r, c, calls) == ("Let me see.", "The answer is 4.", [])
    # the template opened the block in the prompt: the output starts inside it
    r, c, _ = _run("Hmm, 2+2.\n</think>\n\n4", prompt="<|im_start|>assistant\n<think>\n", step=step)
    assert (r, c) == ("Hmm, 2+2.", "4")
    # no block at all; text that merely starts like the tag
    assert _run("<thin air", step=step)[:2] == ("", "<thin air")
    assert _run("plain answer", step=step)[:2] == ("", "plain answer")
    # an unfinished block (max_tokens hit mid-thought) stays reasoning
    assert _run("<think>still going", step=step)[:2] == ("still going", "")


@pytest.mark.parametrize("step", [None, 1, 7])
def test_tool_calls_parsed_in_both_styles(step):
    r, c, calls = _run("<think>need weather</think>\n\n" + XML_CALL, tools=TOOLS, step=step)
    assert r == "need weather" and c == ""
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == \
        [("get_weather", {"city": "Paris", "days": 3})]
    _, c, calls = _run("Checking.\n" + JSON_CALL + "\n" + XML_CALL, tools=TOOLS, step=step)
    assert c == "Checking.\n"
    assert [json.loads(x["arguments"]) for x in calls] == [{"city": "Oslo", "days": 2},
                                                          {"city": "Paris", "days": 3}]
    assert len({x["id"] for x in calls}) == 2
    # a block cut by the end of the stream (no </tool_call>) is still read
    _, _, calls = _run(XML_CALL[:-len("</tool_call>")], tools=TOOLS, step=step)
    assert [x["name"] for x in calls] == ["get_weather"]


def test_unreadable_tool_block_is_content_and_tools_off_leaves_text():
    bad = "<tool_call>{not json}</tool_call>"
    assert _run(bad, tools=TOOLS) == ("", bad, [])
    assert _run(XML_CALL) == ("", XML_CALL, [])          # no tools in the request: plain text


def test_parameter_values_follow_the_schema():
    block = XML_CALL[len("<tool_call>"):-len("</tool_call>")].replace("Paris", "1789")
    (call,) = parse_tool_block(block, {"get_weather": {"city": "string", "days": "integer"}})
    assert json.loads(call["arguments"]) == {"city": "1789", "days": 3}   # a string stays one


def test_content_parts_and_tool_messages_for_the_template():
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "x") == "ab"
    with pytest.raises(ApiError, match=r"messages\[0\].content\[0\] is a image_url part"):
        content_text([{"type": "image_url", "image_url": {}}], "messages[0].content")
    msgs = template_messages([
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}])
    assert msgs[0]["content"] == ""
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert msgs[1] == {"role": "tool", "tool_call_id": "c1", "content": "42"}


def test_reasoning_splitter_holds_back_a_partial_close_tag():
    s = ReasoningSplitter("<think>\n")
    assert s.push("abc</th") == [("reasoning", "abc")]
    assert s.push("ink>x") == [("content", "x")]
