"""A request's prompt: its messages (and tools) through the chat template to text and token
ids, or a completion's text or ids; each checked to fit the context. Runs in a worker thread
(a template or a long prompt can take a while).

Client text never becomes control tokens (ChatTemplate.render_prompt; --allow-special-in-content
turns that off). System messages may come anywhere in a conversation (Claude Code sends them
mid-conversation): they are rendered as the template renders system turns; where the template
refuses a system turn after the first message, or drops its text, every system message is
merged, in order, into one leading system turn instead."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import anthropic_format as anthropic
from .anthropic_format import MessagesRequest
from .openai_format import ApiError, forced_call_prefix, template_messages
from .served import Served
from .validate import ChatRequest, bad_value

# set by the server when it renders; a request's chat_template_kwargs may not
RESERVED_TEMPLATE_KEYS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


@dataclass
class Prompt:
    """A rendered chat prompt: its text and ids, how to tokenize the end of its text as its ids
    were (prefix reuse), the opening of a forced tool call it ends with, the tools the template
    saw, and whether system messages were merged into one."""
    text: str
    ids: list[int]
    encode: Callable[[str], list[int]] | None = None
    prefix: str = ""
    tools: list | None = None
    merged_system: bool = False
    forced: tuple[bool, str | None] = (False, None)
    think: bool | None = None
    extra: dict = field(default_factory=dict)


def render_chat(served: Served, req: ChatRequest, tools: list | None,
                forced: tuple[bool, str | None] = (False, None),
                structured: bool = False) -> Prompt:
    """Render the conversation with the chat template and tokenize it. structured: the reply
    is constrained (response_format): no reasoning block before it."""
    if not req.messages:
        raise ApiError(400, "messages is empty; send at least one message", param="messages",
                       code="invalid_value")
    msgs = template_messages(m.model_dump(exclude_none=True) for m in req.messages)
    for m in msgs:
        if m["role"] == "developer":
            m["role"] = "system"
    kwargs = dict(req.chat_template_kwargs or {})
    bad = RESERVED_TEMPLATE_KEYS & kwargs.keys()
    if bad:
        raise ApiError(400, f"chat_template_kwargs.{sorted(bad)[0]} is set by the server; leave "
                            "it out", param="chat_template_kwargs", code="invalid_value")
    think = kwargs.pop("enable_thinking", None)
    if think is not None and not isinstance(think, bool):
        raise bad_value("chat_template_kwargs.enable_thinking", think, "give true or false")
    prefix = forced_call_prefix(served.template.source, forced[1]) if forced[0] else ""
    if prefix or structured:
        think = False   # the constrained reply is the first text: no reasoning block before it
    p = render(served, msgs, tools, think, kwargs, "", prefix, api="openai")
    p.forced = forced
    return p


def render_messages(served: Served, req: MessagesRequest, check: bool = True) -> Prompt:
    """An Anthropic request's prompt (tools: those the template saw, or None)."""
    msgs, prefill = anthropic.template_messages(req)
    tools = anthropic.tools_for_template(req)
    force, name = anthropic.forced_tool(req) if tools else (False, None)
    prefix = forced_call_prefix(served.template.source, name) if force else ""
    think = False if prefix else anthropic.enable_thinking(req)
    p = render(served, template_messages(msgs), tools, think, {}, prefill, prefix, check,
               api="anthropic")
    p.forced = (force, name)
    return p


def render(served: Served, msgs: list[dict], tools: list | None, think: bool | None,
           kwargs: dict, prefill: str = "", prefix: str = "", check: bool = True,
           api: str = "openai") -> Prompt:
    """Template messages -> Prompt, the generation prompt last, then `prefill` (the client's
    start of the reply) and `prefix` (a forced tool call's opening)."""
    rp, merged = _render_systems(served, msgs, tools, think, kwargs)
    if prefill:
        rp = rp.append(prefill)
    if prefix:
        rp = rp.append(prefix)
    if check:
        check_fits(served, rp.ids, "messages", api)
    return Prompt(rp.text, rp.ids, rp.encode_suffix, prefix, tools, merged, think=think)


def _render_systems(served: Served, msgs: list[dict], tools, think, kwargs):
    """render_prompt, system messages where they are; merged into one leading system turn
    when the template refuses them there or leaves their text out. -> (RenderedPrompt,
    merged)."""
    later = [m for i, m in enumerate(msgs) if i and m["role"] == "system"]
    if later:
        try:
            rp = _render(served, msgs, tools, think, kwargs)
            if all(m["content"] in rp.text for m in later if m["content"]):
                return rp, False
        except ApiError:
            pass
        systems = [m["content"] for m in msgs if m["role"] == "system" and m["content"]]
        msgs = [{"role": "system", "content": "\n\n".join(systems)}] + \
            [m for m in msgs if m["role"] != "system"]
        return _render(served, msgs, tools, think, kwargs), True
    return _render(served, msgs, tools, think, kwargs), False


def _render(served: Served, msgs, tools, think, kwargs):
    from loaders import GGUFError
    tok = served.tokenizer
    try:
        return served.template.render_prompt(
            msgs, tok, tools=tools, add_generation_prompt=True, enable_thinking=think,
            allow_special_in_content=served.allow_special, **kwargs)
    except GGUFError as e:
        raise ApiError(400, f"the chat template could not render these messages: {e}",
                       param="messages", code="template_error") from None


def encode_prompt(served: Served, prompt: str | list[int]) -> list[int]:
    """A completion's prompt (text, or token ids checked against the vocabulary) -> ids. A
    completion is raw text: control-token text in it is parsed (llama-server's rule)."""
    tok = served.tokenizer
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_special=True, parse_special=True)
    else:
        bad = [i for i in prompt if not 0 <= i < len(tok)]
        if bad:
            raise bad_value("prompt", bad[0], f"token ids run from 0 to {len(tok) - 1}")
        ids = list(prompt)
    if not ids:
        raise ApiError(400, "prompt is empty; give some text", param="prompt",
                       code="invalid_value")
    check_fits(served, ids, "prompt")
    return ids


def check_fits(served: Served, ids: list[int], param: str, api: str = "openai") -> None:
    """The prompt leaves the context room for at least one generated token. The wording is
    what each API's clients act on: Anthropic's `prompt is too long: N tokens > M maximum`
    (Claude Code then compacts the conversation), OpenAI's code context_length_exceeded."""
    n, limit = len(ids), served.n_ctx - 1
    if n <= limit:
        return
    if api == "anthropic":
        raise ApiError(400, f"prompt is too long: {n} tokens > {limit} maximum", param=param,
                       code="context_length_exceeded")
    raise ApiError(400, f"This model's maximum context length is {served.n_ctx} tokens. However, "
                        f"your {param} resulted in {n} tokens and the reply needs at least one "
                        f"more; shorten the {param} or restart the server with a larger --ctx",
                   param=param, code="context_length_exceeded")
