"""Anthropic's Messages API (`POST /v1/messages`, what Claude Code speaks) around the same
engine: the request model, its messages turned into the chat template's (tool_use -> the
assistant's tool call, tool_result -> a tool message, thinking -> reasoning_content), the reply
as content blocks (thinking, text, tool_use) whole or as named SSE events, stop reasons, usage
and Anthropic's error objects. The `<think>` and `<tool_call>` parsing is openai_format's."""
from __future__ import annotations

import json
import secrets
from typing import Any, Union

from pydantic import BaseModel, ConfigDict

from .openai_format import ApiError

ROUTES = ("/v1/messages", "/v1/messages/count_tokens")

# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 529: "overloaded_error"}


# ---- request ------------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class AnthropicMessage(_Strict):
    role: str                 # user, assistant, or system (a mid-conversation system message)
    content: Union[str, list[dict[str, Any]]]


class AnthropicTool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoice(_Strict):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: str
    budget_tokens: int | None = None


class MessagesRequest(_Strict):
    model: str
    max_tokens: int
    messages: list[AnthropicMessage]
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1


# ---- request -> the template's messages ----------------------------------------------------------

def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _text_of(blocks: Union[str, list, None], where: str, what: str = "text") -> str:
    """A string, or text blocks joined; any other block is refused, naming it."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    out = []
    for i, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else type(b).__name__
        if kind == "text" and isinstance(b.get("text"), str):
            out.append(b["text"])
        else:
            raise _unsupported(kind, f"{where}[{i}]", f"{what} blocks")
    return "".join(out)


def _unsupported(kind: Any, where: str, accepted: str) -> ApiError:
    if kind in ("image", "document"):
        return _bad(f"{where} is an {kind} block; this model reads text only: send the content "
                    f"as text", where)
    return _bad(f"{where} is a {kind!s} block; here this server reads {accepted}", where)


def template_messages(req: MessagesRequest) -> tuple[list[dict], str]:
    """The request's system and messages as the template's (OpenAI-style) messages, and the
    text of a final assistant message (a prefill the reply continues; '' if none)."""
    msgs: list[dict] = []
    if req.system:
        msgs.append({"role": "system", "content": _text_of(req.system, "system")})
    if not req.messages:
        raise _bad("messages is empty; send at least one user message", "messages")
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if m.role == "user":
            msgs += _user(m.content, where)
        elif m.role == "assistant":
            msgs.append(_assistant(m.content, where))
        elif m.role == "system":   # Claude Code's mid-conversation system messages
            msgs.append({"role": "system", "content": _text_of(m.content, where)})
        else:
            # Anthropic's wording: clients (Claude Code) match it to retry without the message
            raise _bad(f"messages.{i}: Unexpected role {json.dumps(m.role)}. Allowed input "
                       'message role values are "user", "assistant" and "system"',
                       f"messages[{i}].role")
    prefill = ""
    last = msgs[-1]
    if last["role"] == "assistant":
        if last.get("tool_calls"):
            raise _bad("the last message is an assistant tool_use; send its tool_result in a "
                       "user message after it", f"messages[{len(req.messages) - 1}]")
        msgs.pop()
        prefill = last["content"].rstrip()
    return msgs, prefill


def _user(content, where: str) -> list[dict]:
    """A user turn: text blocks -> user messages, tool_result blocks -> tool messages, in order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, text = [], []
    for i, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else type(b).__name__
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_result":
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(f"{where}[{i}].tool_use_id is required (the id of the tool_use it "
                           "answers)", f"{where}[{i}].tool_use_id")
            result = _text_of(b.get("content"), f"{where}[{i}].content", "text")
            if b.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
        else:
            raise _unsupported(kind, f"{where}[{i}]", "text and tool_result blocks")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(content, where: str) -> dict:
    """An assistant turn: text, thinking -> reasoning_content, tool_use -> tool_calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, thinking, calls = [], [], []
    for i, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else type(b).__name__
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "thinking":
            thinking.append(str(b.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise _bad(f"{where}[{i}] needs a name and an object input",
                           f"{where}[{i}]")
            calls.append({"id": str(b.get("id", "")), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        else:
            raise _unsupported(kind, f"{where}[{i}]", "text, thinking and tool_use blocks")
    msg: dict = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def forced_tool(req: MessagesRequest) -> tuple[bool, str | None]:
    """tool_choice any -> a tool call of the model's choosing; tool -> that tool (checked by
    tools_for_template); auto / none -> nothing forced."""
    choice = req.tool_choice or ToolChoice(type="auto")
    if choice.type == "any":
        return True, None
    if choice.type == "tool":
        return True, choice.name
    return False, None


def tools_for_template(req: MessagesRequest) -> list[dict] | None:
    """The request's tools as function tools (None when there are none or tool_choice is
    none); `forced_tool` says whether the reply must call one."""
    choice = req.tool_choice or ToolChoice(type="auto")
    kind = choice.type
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad(f"tool_choice.type={json.dumps(kind)}: give auto, any, tool or none",
                   "tool_choice")
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise _bad(f"tools[{i}] is a {t.type} tool; this server runs client tools only "
                       "(name, description, input_schema)", f"tools[{i}].type")
        tools.append({"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.input_schema or {"type": "object", "properties": {}}}})
    if kind == "tool" and choice.name not in {t.name for t in req.tools or []}:
        raise _bad(f"tool_choice.name={json.dumps(choice.name)} is not among the tools; "
                   "name one of them", "tool_choice.name")
    if kind == "none" or not tools:
        return None
    return tools


THINKING = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}


def enable_thinking(req: MessagesRequest) -> bool:
    """thinking {type: enabled | adaptive | between_tools | disabled} -> the template's
    enable_thinking; no `thinking` field means none, as on Anthropic's API (a client reading
    content[0].text gets the text). budget_tokens and display are accepted; the reply's
    length is bounded by max_tokens only."""
    if req.thinking is None:
        return False
    kind = req.thinking.type
    if kind not in THINKING:
        raise _bad(f"thinking.type={json.dumps(kind)}: give {', '.join(THINKING)}",
                   "thinking.type")
    return THINKING[kind]


# ---- reply ---------------------------------------------------------------------------------------

def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def stop_reason(done_reason: str, tool_calls: bool) -> str:
    if done_reason in ("length", "context"):
        return "max_tokens"
    if done_reason == "stop":
        return "stop_sequence"
    return "tool_use" if tool_calls else "end_turn"


def matched_stop(text: str, stops: list[str]) -> str | None:
    """Which stop sequence ended `text` (the reply's whole decoded text): the one found first."""
    hits = [(text.find(s), len(s), s) for s in stops if s and s in text]
    return min(hits)[2] if hits else None


def usage(n_prompt: int, n_cached: int, n_output: int) -> dict:
    """Anthropic's usage: input_tokens are those not read from the cache."""
    return {"input_tokens": n_prompt - n_cached, "output_tokens": n_output,
            "cache_read_input_tokens": n_cached, "cache_creation_input_tokens": 0}


def _tool_input(arguments: str) -> dict:
    try:
        obj = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return obj if isinstance(obj, dict) else {"arguments": obj}


class Blocks:
    """Parser parts -> content blocks: `content` (the non-streamed reply) and, from `events`,
    the SSE events that stream the same blocks (start, deltas, stop per block)."""

    def __init__(self, thinking: bool = True):
        self.content: list[dict] = []
        self.open: str | None = None      # the kind of the block being streamed
        self.thinking = thinking          # False: reasoning the model wrote anyway is dropped

    def events(self, parts) -> list[str]:
        out: list[str] = []
        for kind, val in parts:
            if kind == "reasoning" and not self.thinking:
                continue
            if kind == "tool_call":
                self._close(out)
                block = {"type": "tool_use", "id": "toolu_" + val["id"].removeprefix("call_"),
                         "name": val["name"], "input": _tool_input(val["arguments"])}
                i = len(self.content)
                self.content.append(block)
                out.append(event("content_block_start", {"index": i, "content_block": {
                    **block, "input": {}}}))
                out.append(event("content_block_delta", {"index": i, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
                out.append(event("content_block_stop", {"index": i}))
                continue
            kind, field, delta = (("thinking", "thinking", "thinking_delta")
                                  if kind == "reasoning" else ("text", "text", "text_delta"))
            if self.open != kind:
                self._close(out)
                start = {"type": kind, field: ""}
                if kind == "thinking":
                    start["signature"] = ""
                self.content.append(dict(start))
                self.open = kind
                out.append(event("content_block_start", {"index": len(self.content) - 1,
                                                         "content_block": start}))
            self.content[-1][field] += val
            out.append(event("content_block_delta", {"index": len(self.content) - 1,
                                                     "delta": {"type": delta, field: val}}))
        return out

    def finish(self) -> list[str]:
        out: list[str] = []
        self._close(out)
        return out

    def _close(self, out: list[str]) -> None:
        if self.open is not None:
            out.append(event("content_block_stop", {"index": len(self.content) - 1}))
            self.open = None

    @property
    def has_tool_use(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.content)


def event(name: str, data: dict) -> str:
    """One named server-sent event; `type` is the event's name, as Anthropic sends it."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


def error_body(status: int, message: str, code: str | None = None) -> dict:
    kind = "overloaded_error" if code == "queue_full" else ERROR_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_status(status: int, code: str | None) -> int:
    """Anthropic's status for an error: a full queue is 529 (overloaded), as its API says."""
    return 529 if code == "queue_full" else status
