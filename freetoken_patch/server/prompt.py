"""A request's prompt: its messages (and tools) through the chat template to text and token
ids, or a completion's text or ids; each checked to fit the context. Runs in a worker thread
(a template or a long prompt can take a while)."""
from __future__ import annotations

from . import anthropic_format as anthropic
from .anthropic_format import MessagesRequest
from .openai_format import ApiError, forced_call_prefix, template_messages
from .served import Served
from .validate import ChatRequest, bad_value

# set by the server when it renders; a request's chat_template_kwargs may not
RESERVED_TEMPLATE_KEYS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


def render_chat(served: Served, req: ChatRequest, tools: list | None,
                forced: tuple[bool, str | None] = (False, None)) -> tuple[str, list[int], str]:
    """Render the conversation with the chat template and tokenize it:
    (prompt text, ids, the forced tool call's opening the prompt ends with, or "")."""
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
    if prefix:
        think = False   # a forced call is the reply's first text: no reasoning block before it
    text, ids = render(served, msgs, tools, think, kwargs, prefix)
    return text, ids, prefix


def render_messages(served: Served, req: MessagesRequest, check: bool = True
                    ) -> tuple[str, list[int], list | None, str]:
    """An Anthropic request's prompt: (text, ids, the tools the template saw or None, the
    forced tool call's opening the prompt ends with, or "")."""
    msgs, prefill = anthropic.template_messages(req)
    tools = anthropic.tools_for_template(req)
    force, name = anthropic.forced_tool(req) if tools else (False, None)
    prefix = forced_call_prefix(served.template.source, name) if force else ""
    think = False if prefix else anthropic.enable_thinking(req)
    text, ids = render(served, template_messages(msgs), tools, think, {}, prefill + prefix, check)
    return text, ids, tools, prefix


def render(served: Served, msgs: list[dict], tools: list | None, think: bool | None,
           kwargs: dict, prefill: str = "", check: bool = True) -> tuple[str, list[int]]:
    """Template messages -> (prompt text, ids), the generation prompt (and a prefill) last."""
    from loaders import GGUFError
    tok = served.tokenizer
    try:
        text = served.template.render(msgs, add_generation_prompt=True, enable_thinking=think,
                                      bos_token=tok.bos_token, eos_token=tok.eos_token,
                                      tools=tools, **kwargs) + prefill
    except GGUFError as e:
        raise ApiError(400, f"the chat template could not render these messages: {e}",
                       param="messages", code="template_error") from None
    ids = tok.encode(text, add_special=False, parse_special=True)
    if check:
        check_fits(served, ids, "messages")
    return text, ids


def encode_prompt(served: Served, prompt: str | list[int]) -> list[int]:
    """A completion's prompt (text, or token ids checked against the vocabulary) -> ids."""
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


def check_fits(served: Served, ids: list[int], param: str) -> None:
    """The prompt leaves the context room for at least one generated token."""
    if len(ids) >= served.n_ctx:
        raise ApiError(400, f"the prompt is {len(ids)} tokens and the context holds "
                            f"{served.n_ctx} (the reply needs at least one more); shorten the "
                            "{} or restart the server with a larger --ctx".format(param),
                       param=param, code="context_length_exceeded")
