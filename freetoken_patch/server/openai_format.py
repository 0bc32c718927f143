"""The OpenAI wire format around the engine's token stream: error objects, message content,
the reasoning block (`<think>...</think>` -> reasoning_content) and tool calls (Qwen3.5's XML
`<function=NAME><parameter=ARG>` blocks and the JSON blocks of Qwen2.5/3, both inside
`<tool_call>...</tool_call>`), split incrementally so streaming and non-streaming agree."""
from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any, Iterable


class ApiError(Exception):
    """An OpenAI-style error: HTTP status and the `error` object's fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


# ---- messages in --------------------------------------------------------------------------------

def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or an array of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{i}] is a {kind or type(part).__name__!s} part; this "
                                "server reads only text parts ({\"type\": \"text\", \"text\": "
                                "...})", param=where, code="unsupported_content")
        out.append(part["text"])
    return "".join(out)


def template_messages(messages: Iterable[dict]) -> list[dict]:
    """OpenAI messages -> what chat templates expect: content as text, tool-call arguments as
    objects (templates iterate them), other fields (name, tool_call_id, reasoning_content) kept."""
    out = []
    for i, m in enumerate(messages):
        d = {k: v for k, v in m.items() if v is not None}
        d["content"] = content_text(m.get("content"), f"messages[{i}].content")
        calls = []
        for call in m.get("tool_calls") or []:
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    parsed = json.loads(args) if args.strip() else {}
                    fn["arguments"] = parsed if isinstance(parsed, dict) else args
                except ValueError:
                    pass
            calls.append({**call, "function": fn, **fn})   # both spellings templates use
        if calls:
            d["tool_calls"] = calls
        out.append(d)
    return out


# ---- the reasoning block ------------------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back until it resolves)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Text -> [("reasoning" | "content", text)]. Starts inside the block when the prompt already
    opened it (templates that end the generation prompt with `<think>`), else looks for
    `<think>` at the start of the output. Whitespace around the block is trimmed."""

    def __init__(self, prompt_text: str = ""):
        tail = prompt_text.rstrip()
        self.mode = "reasoning" if tail.endswith(THINK_OPEN) else "detect"
        self.buf = ""
        self.trim = True          # drop whitespace at the start of the current part

    def push(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self.mode == "detect":
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buf, self.mode, self.trim = head[len(THINK_OPEN):], "reasoning", True
                    continue
                if THINK_OPEN.startswith(head):
                    return out                       # maybe the tag's beginning: wait
                self.mode = "content"
            if self.mode == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    self._emit(out, "reasoning", self.buf[:i].rstrip())
                    self.buf = self.buf[i + len(THINK_CLOSE):]
                    self.mode, self.trim = "content", True
                    continue
                body = self.buf[:len(self.buf) - _partial_suffix(self.buf, THINK_CLOSE)]
                keep = len(body) - len(body.rstrip())            # trailing blanks may end it
                cut = len(body) - keep
                self._emit(out, "reasoning", self.buf[:cut])
                self.buf = self.buf[cut:]
                return out
            self._emit(out, "content", self.buf)
            self.buf = ""
            return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        kind = "reasoning" if self.mode == "reasoning" else "content"
        self._emit(out, kind, self.buf.rstrip() if kind == "reasoning" else self.buf)
        self.buf = ""
        return out

    def _emit(self, out: list, kind: str, text: str) -> None:
        if self.trim:
            text = text.lstrip()
        if text:
            self.trim = False
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + text)
            else:
                out.append((kind, text))


# ---- tool calls ----------------------------------------------------------------------------------

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.S)


def _param_types(tools: Iterable[dict] | None) -> dict[str, dict[str, str]]:
    """function name -> {parameter: JSON-schema type} from the request's tools."""
    out: dict[str, dict[str, str]] = {}
    for t in tools or ():
        fn = t.get("function") or {}
        props = ((fn.get("parameters") or {}).get("properties") or {})
        out[str(fn.get("name"))] = {k: (v.get("type") if isinstance(v, dict) else None)
                                    for k, v in props.items()}
    return out


def parse_tool_block(block: str, types: dict[str, dict[str, str]] | None = None) -> list[dict]:
    """The inside of one <tool_call> block -> [{name, arguments (JSON text)}], [] if unreadable."""
    body = block.strip()
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except ValueError:
            return []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        args = obj.get("arguments", obj.get("parameters", {}))
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return [{"name": obj["name"], "arguments": text}]
    calls = []
    for fm in _FUNCTION.finditer(body):
        name = fm.group(1).strip()
        declared = (types or {}).get(name, {})
        args = {}
        for pm in _PARAMETER.finditer(fm.group(2)):
            key, raw = pm.group(1).strip(), pm.group(2)
            args[key] = raw if declared.get(key) == "string" else _json_or_text(raw)
        calls.append({"name": name, "arguments": json.dumps(args, ensure_ascii=False)})
    return calls


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class ToolCallParser:
    """Content text -> [("content", text) | ("tool_call", {id, name, arguments})]: text from
    `<tool_call>` is buffered until the block closes (or the stream ends), then parsed; a block
    that does not parse is passed on as content."""

    def __init__(self, tools: Iterable[dict] | None = None):
        self.types = _param_types(tools)
        self.buf = ""
        self.inside = False
        self.calls = 0

    def push(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if not self.inside:
                i = self.buf.find(CALL_OPEN)
                if i < 0:
                    cut = len(self.buf) - _partial_suffix(self.buf, CALL_OPEN)
                    self._text(out, self.buf[:cut])
                    self.buf = self.buf[cut:]
                    return out
                self._text(out, self.buf[:i])
                self.buf, self.inside = self.buf[i:], True
            j = self.buf.find(CALL_CLOSE)
            if j < 0:
                return out
            self._block(out, self.buf[:j + len(CALL_CLOSE)])
            self.buf, self.inside = self.buf[j + len(CALL_CLOSE):], False

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.inside:
            self._block(out, self.buf)        # a block the end of the stream cut: try it
        else:
            self._text(out, self.buf)
        self.buf, self.inside = "", False
        return out

    def _text(self, out: list, text: str) -> None:
        if self.calls and not text.strip():
            return                             # blanks between calls are not content
        if text:
            out.append(("content", text))

    def _block(self, out: list, block: str) -> None:
        inner = block[len(CALL_OPEN):]
        if inner.endswith(CALL_CLOSE):
            inner = inner[:-len(CALL_CLOSE)]
        calls = parse_tool_block(inner, self.types)
        if not calls:
            out.append(("content", block))
            return
        for c in calls:
            self.calls += 1
            out.append(("tool_call", {"id": "call_" + secrets.token_hex(12), **c}))


def xml_tool_calls(template_source: str) -> bool:
    """Whether the template writes a tool call as Qwen3.5's XML block (`<function=NAME>`),
    else as Hermes-style JSON (`{"name": NAME, "arguments": ...}`)."""
    return "<function=" in template_source


def forced_call_prefix(template_source: str, name: str | None) -> str:
    """The start of the assistant's reply that makes the model call a tool (tool_choice
    required / any), or the named one: Qwen3.5's templates write a call as an XML block
    (`<function=NAME>`), Hermes-style ones as JSON (`{"name": NAME, "arguments": ...}`), told
    apart by the template's own text."""
    head = CALL_OPEN + "\n"
    if name is None:
        return head
    if xml_tool_calls(template_source):
        return head + f"<function={name}>\n"
    return head + '{"name": ' + json.dumps(name) + ', "arguments": '


class OutputParser:
    """The whole chain for one reply: reasoning split, then tool calls in the content.
    `output_prefix`: text the prompt already put at the start of the reply (a forced tool
    call's opening), parsed as the reply's own first text."""

    def __init__(self, prompt_text: str = "", tools: Iterable[dict] | None = None,
                 parse_tools: bool = False, split_reasoning: bool = True,
                 output_prefix: str = ""):
        self.reasoning = ReasoningSplitter(prompt_text) if split_reasoning else None
        self.tools = ToolCallParser(tools) if parse_tools else None
        self._carry: list[tuple[str, Any]] = []
        if output_prefix:
            self._carry = self.push(output_prefix)

    def push(self, text: str) -> list[tuple[str, Any]]:
        parts = self.reasoning.push(text) if self.reasoning else [("content", text)]
        return self._with_carry(self._tools(parts, final=False))

    def finish(self) -> list[tuple[str, Any]]:
        parts = self.reasoning.finish() if self.reasoning else []
        return self._with_carry(self._tools(parts, final=True))

    def _with_carry(self, out: list) -> list:
        if self._carry:
            out, self._carry = self._carry + out, []
        return out

    def _tools(self, parts, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for kind, text in parts:
            if kind == "content" and self.tools is not None:
                out += self.tools.push(text)
            elif text:
                out.append((kind, text))
        if final and self.tools is not None:
            out += self.tools.finish()
        return out


def collect(parts: Iterable[tuple[str, Any]]) -> tuple[str, str, list[dict]]:
    """Parts -> (reasoning, content, tool calls) for a non-streamed reply."""
    reasoning, content, calls = [], [], []
    for kind, val in parts:
        if kind == "reasoning":
            reasoning.append(val)
        elif kind == "content":
            content.append(val)
        else:
            calls.append(val)
    return "".join(reasoning), "".join(content), calls


def tool_call_object(call: dict, index: int | None = None) -> dict:
    d = {"id": call["id"], "type": "function",
         "function": {"name": call["name"], "arguments": call["arguments"]}}
    return d if index is None else {"index": index, **d}


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as JSON (or the literal [DONE])."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n"


# ---- logprobs ---------------------------------------------------------------------------------

def _piece(tokenizer, token: int) -> str:
    """A token's text as logprobs show it (a piece of a character: U+FFFD)."""
    return tokenizer.token_bytes(token).decode("utf-8", "replace")


def _entry(tokenizer, token: int, logprob: float) -> dict:
    return {"token": _piece(tokenizer, token), "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token))}


def chat_logprobs(tokenizer, lps: Iterable) -> dict:
    """OpenAI chat's choice.logprobs: {content: [{token, logprob, bytes, top_logprobs}]}."""
    return {"content": [{**_entry(tokenizer, lp.token, lp.logprob),
                         "top_logprobs": [_entry(tokenizer, i, v) for i, v in lp.top]}
                        for lp in lps], "refusal": None}


def completion_logprobs(tokenizer, lps: list, offset: int = 0) -> dict:
    """OpenAI completions' choice.logprobs: tokens, token_logprobs, top_logprobs (token ->
    logprob), text_offset (characters into the choice's text). An entry of `lps` may be a bare
    token id: a prompt's first token, which has no logprob (None, as OpenAI gives it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        tid = lp if isinstance(lp, int) else lp.token
        text = _piece(tokenizer, tid)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if isinstance(lp, int):
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(lp.logprob)
            top: dict = {}
            for i, v in lp.top:
                top.setdefault(_piece(tokenizer, i), v)
            out["top_logprobs"].append(top)
    return out
