"""What a request may ask for: the OpenAI routes' pydantic request and response models, and the
checks that turn a bad field into one 400 naming it and the fix (sampling ranges, tool_choice,
unsupported options, the served model's name, pydantic's own errors in the client's spelling).
Anthropic's request model is anthropic_format's; its sampling is checked here too."""
from __future__ import annotations

import json
import math
import sys
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict

from moe_offload import SamplingParams

from .openai_format import ApiError

# ---- request models ---------------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1.0 is not an integer; unknown fields are ignored
    model_config = ConfigDict(strict=True, extra="allow")


class FunctionCall(_Strict):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCall(_Strict):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int | None = None
    logprobs: Union[bool, int, None] = None
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Sampling):
    messages: list[Message]
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[str, NamedToolChoice, None] = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int]]
    echo: bool = False
    suffix: str | None = None


# ---- response models ----------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] = {}


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str
    logprobs: dict[str, Any] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None


class _Reply(BaseModel):
    # a subclass's choices keep their place here, before usage, in the JSON
    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Usage


class ChatCompletion(_Reply):
    object: str = "chat.completion"
    choices: list[ChatChoice]


class Completion(_Reply):
    object: str = "text_completion"
    choices: list[CompletionChoice]


# ---- checks -------------------------------------------------------------------------------------

def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """Pydantic's errors -> (one message naming the field and the fix, the field or None)."""
    # the deepest error names the most specific field (stop[0], not stop, for [1])
    e = max(errors, key=lambda x: len(x.get("loc", ())), default={"msg": "invalid", "loc": ()})
    if e.get("type") == "json_invalid":
        return (f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])}); "
                "send a JSON object", None)
    where = _field(e)
    if where == "body":
        return ("the request body must be a JSON object, sent with the header 'Content-Type: "
                "application/json'"), None
    if e.get("type") == "missing":
        return f"{where} is required; add it to the request", where
    got = e.get("input")
    shown = json.dumps(got)[:60] if isinstance(got, (str, int, float, bool, type(None))) \
        else type(got).__name__
    if sum(_field(x) == where for x in errors) > 1:      # a union: no member accepted it
        return f"{where} has the wrong type (got {shown}); see the OpenAI API for its types", where
    return f"{where}: {e.get('msg', 'invalid')} (got {shown}); fix its value", where


def _field(e: dict) -> str:
    """An error's location as the client spells it (messages[0].role), union tags dropped."""
    loc = [p for p in e.get("loc", ()) if p != "body"   # union tags: a type's or a model's name
           and not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or p[:1].isupper()))]
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "body"


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def check_model(name: str | None, served_id: str, anthropic: bool = False) -> None:
    """The request's model field names the served model (or "default", or nothing)."""
    if name not in (None, "", "default", served_id):
        how = (" (Claude Code: set ANTHROPIC_MODEL and ANTHROPIC_SMALL_FAST_MODEL to it)"
               if anthropic else " (\"default\" or no model field also work)")
        raise ApiError(404, f"model {name!r} is not served here; this server serves "
                            f"{served_id!r}, or \"default\"" + how,
                       param="model", code="model_not_found")


def bad_value(param: str, value: Any, fix: str) -> ApiError:
    """The 400 for a field whose value is out of range: `param=value: fix`."""
    shown = (f"{value:g}" if isinstance(value, float)      # 0, not 0.0, as the client wrote it
             else json.dumps(value) if _jsonable(value) else repr(value))
    return ApiError(400, f"{param}={shown}: {fix}", param=param, code="invalid_value")


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


def logprobs_of(req: _Sampling) -> int | None:
    """How many likeliest tokens each token's logprobs list (None: no logprobs): chat's
    logprobs (a bool) with top_logprobs, completions' logprobs (a count)."""
    top = getattr(req, "top_logprobs", None)
    if isinstance(req, ChatRequest):
        if req.logprobs not in (None, True, False):
            raise bad_value("logprobs", req.logprobs, "give true or false (top_logprobs sets "
                                                      "how many alternatives)")
        if top is not None and not 0 <= top <= 20:
            raise bad_value("top_logprobs", top, "give 0 to 20")
        if top is not None and not req.logprobs:
            raise bad_value("top_logprobs", top, "needs logprobs: true")
        return (top or 0) if req.logprobs else None
    lp = req.logprobs
    if lp is None or lp is False:
        return None
    if lp is True or not 0 <= lp <= 20:
        raise bad_value("logprobs", lp, "give the number of likeliest tokens to list, 0 to 20")
    return int(lp)


def sampling_params(req: _Sampling, max_completion_tokens: int | None,
                    n_vocab: int | None = None) -> SamplingParams:
    """The request's sampling fields, each range-checked, as SamplingParams; n_vocab: the ids
    logit_bias may name."""
    if req.n not in (None, 1):
        raise bad_value("n", req.n, "this server returns one choice per request; leave n out or "
                                    "send 1 (send several requests for several answers)")
    n_max = max_completion_tokens if max_completion_tokens is not None else req.max_tokens
    which = "max_completion_tokens" if max_completion_tokens is not None else "max_tokens"
    if n_max is not None and not 1 <= n_max <= 1 << 31:
        raise bad_value(which, n_max, "give 1 or more (leave it out to generate until the end "
                                      "of the text or a full context)")
    t = req.temperature
    if t is not None and not (_finite(t) and 0 <= t <= 2):
        raise bad_value("temperature", t, "give a number from 0 (greedy) to 2")
    if req.top_p is not None and not (_finite(req.top_p) and 0 < req.top_p <= 1):
        raise bad_value("top_p", req.top_p, "give a number above 0 and at most 1 (1 = off)")
    if req.top_k is not None and req.top_k < 0:
        raise bad_value("top_k", req.top_k, "give 0 (off) or more")
    if req.min_p is not None and not (_finite(req.min_p) and 0 <= req.min_p <= 1):
        raise bad_value("min_p", req.min_p, "give a number from 0 (off) to 1")
    if req.repeat_penalty is not None and not (_finite(req.repeat_penalty)
                                               and 0 < req.repeat_penalty <= 10):
        raise bad_value("repeat_penalty", req.repeat_penalty, "give a number above 0 (1 = off)")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not (_finite(v) and -2 <= v <= 2):
            raise bad_value(name, v, "give a number from -2 to 2 (0 = off)")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > 16 or any(len(s) > 1000 for s in stop):
        raise bad_value("stop", f"{len(stop)} strings", "give at most 16 stop strings of at "
                                                        "most 1000 characters")
    if req.seed is not None and not -(1 << 63) <= req.seed < 1 << 64:
        raise bad_value("seed", req.seed, "give an integer that fits 64 bits")
    d = SamplingParams()
    return SamplingParams(
        logit_bias=_logit_bias(req.logit_bias, n_vocab),
        temperature=d.temperature if t is None else t,
        top_k=d.top_k if req.top_k is None else req.top_k,
        top_p=d.top_p if req.top_p is None else req.top_p,
        min_p=d.min_p if req.min_p is None else req.min_p,
        repeat_penalty=d.repeat_penalty if req.repeat_penalty is None else req.repeat_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=None if req.seed is None else req.seed % (1 << 64),
        max_tokens=sys.maxsize if n_max is None else n_max,
        stop=tuple(s for s in stop if s), logprobs=logprobs_of(req))


def _logit_bias(bias: dict[str, float] | None, n_vocab: int | None) -> tuple:
    """OpenAI's logit_bias ({"token id": bias}) as ((id, bias), ...), each entry checked."""
    if not bias:
        return ()
    if len(bias) > 1024:
        raise bad_value("logit_bias", f"{len(bias)} entries", "give at most 1024 token ids")
    out = []
    for key, value in bias.items():
        i = int(key) if key.isascii() and key.isdigit() and len(key) < 12 else -1
        if i < 0 or (n_vocab is not None and i >= n_vocab):
            top = "the vocabulary size - 1" if n_vocab is None else n_vocab - 1
            raise bad_value(f"logit_bias.{key[:40]}", value, f"keys are token ids from 0 to "
                            f"{top} (POST /tokenize gives a text's ids)")
        if not (_finite(value) and -100 <= value <= 100):
            raise bad_value(f"logit_bias.{key[:40]}", value, "give a bias from -100 to 100")
        out.append((i, float(value)))
    return tuple(out)


def anthropic_sampling_params(req) -> SamplingParams:
    """An Anthropic MessagesRequest's sampling fields, checked, as SamplingParams."""
    if req.max_tokens < 1:
        raise bad_value("max_tokens", req.max_tokens, "give 1 or more")
    stops = req.stop_sequences or []
    if len(stops) > 16 or any(len(s) > 1000 for s in stops):
        raise bad_value("stop_sequences", f"{len(stops)} strings",
                        "give at most 16 stop sequences of at most 1000 characters")
    return sampling_params(_Sampling(max_tokens=req.max_tokens, temperature=req.temperature,
                                     top_p=req.top_p, top_k=req.top_k, stop=stops), None)


def check_text(value: Any, where: str = "") -> None:
    """Every string in a request is Unicode text: JSON can spell a lone surrogate (\\ud800),
    which no UTF-8 encoder takes; one is a 400 naming its field, not a failure further on."""
    if isinstance(value, str):
        if any("\ud800" <= ch <= "\udfff" for ch in value):
            raise ApiError(400, f"{where or 'a string'}: holds a lone UTF-16 surrogate, which is "
                                "not Unicode text; send valid text", param=where or None,
                           code="invalid_value")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, where)
            check_text(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(v, f"{where}[{i}]")


def check_no_suffix(req: CompletionRequest) -> None:
    if req.suffix:
        raise ApiError(400, "suffix (fill in the middle) is not supported; leave it out",
                       param="suffix", code="unsupported")


def forced_tool(choice, tools: list[dict]) -> tuple[bool, str | None]:
    """tool_choice -> (whether the reply must be a tool call, the tool it must call or None)."""
    if choice is None or choice in ("auto", "none"):
        return False, None
    names = {t.get("function", {}).get("name") for t in tools}
    if choice == "required":
        if not tools:
            raise bad_value("tool_choice", choice, "required needs tools; send some, or use auto")
        return True, None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad_value("tool_choice.function.name", name, "name one of the request's tools")
        return True, name
    raise bad_value("tool_choice", choice, 'give "none", "auto", "required" or '
                                           '{"type": "function", "function": {"name": ...}}')
