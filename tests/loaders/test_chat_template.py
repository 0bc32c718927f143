"""loaders.chat_template: a Qwen3-style template (written here), ChatML, the sandbox, errors."""
from __future__ import annotations

import pytest

from loaders import ChatTemplate, GGUFError, Tokenizer, render_chat

# A Qwen3-style template written for this test: system + tools block, reasoning kept only after
# the last real user query, tool calls as JSON, consecutive tool results grouped in one user turn,
# and an empty think block when thinking is off. It uses what real Qwen templates use: namespace,
# loop.index0/first/last/previtem/nextitem, string methods, slicing, tojson, raise_exception.
QWEN3_STYLE = """
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' and not m.content.startswith('<tool_response>') %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools or messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content.strip() }}
        {%- if tools %}{{- '\\n\\n' }}{%- endif %}
    {%- endif %}
    {%- if tools %}
        {{- '# Tools\\n<tools>' }}
        {%- for t in tools %}{{- '\\n' + t | tojson }}{%- endfor %}
        {{- '\\n</tools>' }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('a system message must come first') }}
        {%- endif %}
    {%- elif m.role == 'user' %}
        {{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set answer = m.content or '' %}
        {%- set thought = m.reasoning_content if m.reasoning_content is string else '' %}
        {%- if '</think>' in answer %}
            {%- set thought = answer.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set answer = answer.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and thought %}
            {{- '<think>\\n' + thought + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- answer }}
        {%- for call in m.tool_calls or [] %}
            {{- '\\n<tool_call>\\n' + {'name': call.name, 'arguments': call.arguments} | tojson }}
            {{- '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('unknown role: ' + m.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

CHAT = [
    {"role": "system", "content": "You are terse.  \n"},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\ngreet back\n</think>\n\nHello!"},
    {"role": "user", "content": "2+2?"},
]
CHAT_PROMPT = ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
               "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
               "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen3() -> ChatTemplate:
    return ChatTemplate(QWEN3_STYLE)


def test_multi_turn_with_system_thinking_on_and_off(qwen3):
    # earlier turns lose their reasoning; thinking on = the template's default
    assert qwen3.render(CHAT) == CHAT_PROMPT
    assert qwen3.render(CHAT, enable_thinking=True) == CHAT_PROMPT
    assert qwen3.render(CHAT, enable_thinking=False) == CHAT_PROMPT + "<think>\n\n</think>\n\n"
    assert qwen3.render(CHAT, add_generation_prompt=False) == \
        CHAT_PROMPT[:-len("<|im_start|>assistant\n")]


def test_tools_calls_and_grouped_results(qwen3):
    tools = [{"name": "get_weather", "description": "Météo & <température>",
              "parameters": {"city": "string"}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "need the tool",
         "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"role": "tool", "content": "18°C"},
        {"role": "tool", "content": "sunny"},
    ]
    assert qwen3.render(messages, tools=tools) == (
        '<|im_start|>system\n# Tools\n<tools>\n{"name": "get_weather", "description": '
        '"Météo & <température>", "parameters": {"city": "string"}}\n</tools><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nneed the tool\n</think>\n\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18°C\n</tool_response>\n<tool_response>\nsunny\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_template_refusals_and_errors_are_one_line_gguf_errors(qwen3):
    with pytest.raises(GGUFError, match="refused the conversation: a system message must come "
                                        "first"):
        qwen3.render([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}])
    with pytest.raises(GGUFError, match="unknown role: robot"):
        qwen3.render([{"role": "robot", "content": "beep"}])
    with pytest.raises(GGUFError, match="syntax error at template line 2") as e:
        ChatTemplate("ok\n{{ foo( }}\nmore\n")
    assert "\n" not in str(e.value)
    with pytest.raises(GGUFError, match="template line 3: ZeroDivisionError") as e:
        render_chat("a\n\n{{ 1 / 0 }}", [])
    assert "\n" not in str(e.value)
    with pytest.raises(GGUFError, match="refused the conversation: two lines"):
        render_chat("{{ raise_exception('two\\nlines') }}", [])


def test_sandbox_blocks_mutation_and_internals():
    with pytest.raises(GGUFError, match="SecurityError"):
        render_chat("{{ messages.append(1) }}", [])
    # no walking out of the sandbox through internals
    assert render_chat("{{ ''.__class__ }}|", []) == "|"
    with pytest.raises(GGUFError, match="SecurityError: access to attribute '__class__'"):
        render_chat("{{ messages.__class__.__mro__ }}", [])


def test_inputs_reach_the_template():
    src = ("{{ bos_token }}{{ enable_thinking is defined }}/{{ enable_thinking }}/"
           "{{ tools is none }}/{{ extra }}{{ eos_token }}")
    assert render_chat(src, [], bos_token="<s>", eos_token="</s>", extra=7) == \
        "<s>False//True/7</s>"
    assert render_chat(src, [], enable_thinking=False, tools=[{}]) == "True/False/False/"
    assert render_chat("{{ messages[0].content | length }}{{ messages[0]['role'] }}",
                       [{"role": "user", "content": "abc"}]) == "3user"


def test_bad_messages():
    with pytest.raises(GGUFError, match="list of"):
        render_chat(None, "hello")
    with pytest.raises(GGUFError, match="message 1 must be an object with a string 'role'"):
        render_chat(None, [{"role": "user", "content": "x"}, {"content": "no role"}])


def test_chatml_when_the_file_has_none_and_the_fixture_template(vocab_path):
    chatml = ChatTemplate(None)
    assert chatml.is_default
    msgs = [{"role": "user", "content": "hi"}]
    assert chatml.render(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chatml.render(msgs, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    fixture = ChatTemplate.from_gguf(vocab_path)         # a generic ChatML with a default system
    assert not fixture.is_default
    prompt = fixture.render(msgs)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n")
    tok = Tokenizer.from_gguf(vocab_path)
    ids = tok.encode(prompt, parse_special=True)
    assert ids[0] == 151644 and ids.count(151645) == 2 and tok.decode(ids) == prompt
