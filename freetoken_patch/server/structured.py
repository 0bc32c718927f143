"""Structured output and forced tool calls, enforced by a token mask (moe_offload's
GrammarConstraint, llguidance underneath): a request's response_format or forced tool_choice
becomes a grammar over what the reply may say, so the reply parses whatever the weights are.

  response_format {"type": "json_object"}         any JSON object
  response_format {"type": "json_schema", ...}    that schema (strict or not: it is enforced)
  tool_choice required / any (a call of some tool), a named function / {"type": "tool"}: the
    reply is one call, its arguments valid for the tool's parameters (input_schema), in the
    template's own format: Qwen3.5's XML (<function=NAME><parameter=P>...), or Hermes-style
    JSON ({"name": NAME, "arguments": {...}}), after the opening the prompt already holds.
  tools with tool_choice auto (or none given): no mask until the reply writes the <tool_call>
    token; from there to </tool_call> one call of some tool, as above (a lazy grammar, as
    llama-server's for tool calls). A reply that calls no tool is not masked at all.

The library is optional (pip install 'ftpatch[structured]'); without it these requests get a
400 naming the extra."""
from __future__ import annotations

import json
import re

from .openai_format import ApiError

EXTRA = "pip install 'ftpatch[structured]'"
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
# JSON as one line with ", " and ": ": whitespace a model could repeat without end is not
# allowed (a reply that never closes its object would run to max_tokens)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _options(schema, lenient: bool) -> dict:
    """`schema` with llguidance's compile options (its x-guidance key)."""
    out = dict(schema) if isinstance(schema, dict) else {}
    out["x-guidance"] = {**JSON_OPTIONS, "lenient": lenient, **out.get("x-guidance", {})}
    return out


def response_format_schema(response_format: dict | None) -> dict | None:
    """The JSON schema a response_format asks for (None: plain text), with the compile
    options: strict schemas must compile whole, others may carry keywords the library skips."""
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _options({"type": "object"}, False)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ApiError(400, "response_format.json_schema must be an object with a `schema` "
                                "object (and a name)", param="response_format.json_schema",
                           code="invalid_value")
        return _options(spec.get("schema") or {"type": "object"}, not spec.get("strict"))
    raise ApiError(400, f"response_format.type={json.dumps(kind)}: give text, json_object or "
                        "json_schema", param="response_format.type", code="invalid_value")


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text)


def _json(schema) -> str:
    """A Lark %json block: a tool's schema is a hint, keywords the library lacks are skipped."""
    return "%json " + json.dumps(_options(schema, True))


def _close(tags) -> str:
    """</tool_call> in a grammar: the vocabulary's own token where it has one (special to
    llguidance, named bare), else its text."""
    return "</tool_call>" if "</tool_call>" in tags else _lit("</tool_call>")


def _xml_function(i: int, name: str, params: dict, close: str) -> list[str]:
    """Lark rules for one call in Qwen3.5's XML form, from <function=NAME> to </tool_call>:
    the schema's properties in its order, the required ones always, string values as raw
    text (no "</" inside), the others as JSON."""
    props = params.get("properties") if isinstance(params, dict) else None
    required = set(params.get("required") or []) if isinstance(params, dict) else set()
    rules, parts = [], []
    if isinstance(props, dict) and props:
        for j, (key, sub) in enumerate(props.items()):
            if not _NAME.match(str(key)):
                raise ApiError(400, f"tool {name!r}: parameter name {str(key)[:60]!r} cannot be "
                                    "written as an XML parameter; use letters, digits and _.:-",
                               param="tools", code="invalid_value")
            r = f"p{i}_{j}"
            open_ = _lit(f"<parameter={key}>\n")
            end = _lit("\n</parameter>\n")
            if isinstance(sub, dict) and sub.get("type") == "string" and sub.get("enum"):
                alts = " | ".join(_lit(str(v)) for v in sub["enum"])
                rules.append(f"{r}: {open_} ({alts}) {end}")
            elif isinstance(sub, dict) and sub.get("type") == "string":
                # raw text, as the parser reads it (no "</" inside); maxLength kept where small
                n = sub.get("maxLength")
                if isinstance(n, int) and 0 <= n <= 1000:
                    rules.append(f"{r}: {open_} /([^<]|<[^\\/]){{0,{n}}}\\n<\\/parameter>\\n/")
                else:
                    rules.append(f"{r}: {open_} STRING_PARAM")
            else:
                rules.append(f"{r}: {open_} {_json(sub)} {end}")
            parts.append(r if key in required else f"{r}?")
    else:   # no declared parameters: any named ones, any text
        rules.append(f"p{i}_any: \"<parameter=\" /[A-Za-z0-9_.:-]+/ \">\\n\" STRING_PARAM")
        parts.append(f"p{i}_any*")
    head = _lit(f"<function={name}>\n")
    rules.insert(0, f"call{i}: {head} {' '.join(parts)} {_lit('</function>' + chr(10))} {close}")
    return rules


def tool_call_grammar(tools: list[dict], name: str | None, xml: bool,
                      after_open: bool = False, tags=frozenset()) -> str:
    """The Lark grammar of the reply after forced_call_prefix(template, name): one call of
    `name` (or of any of `tools` when None), closed by </tool_call>; after_open: of what
    follows the <tool_call> token itself (the newline, then the call); tags: the
    vocabulary's tag tokens (Tokenizer.markup_texts), written as themselves."""
    from moe_offload import GrammarConstraint  # noqa: F401 -- the library is there
    fns = [(t.get("function") or {}) for t in tools]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
    if not fns:
        raise ApiError(400, "tool_choice names no tool of the request", param="tool_choice",
                       code="invalid_value")
    for f in fns:
        if not _NAME.match(str(f.get("name", ""))):
            raise ApiError(400, f"tool name {str(f.get('name'))[:60]!r}: a forced call needs a "
                                "name of letters, digits and _.:-", param="tools",
                           code="invalid_value")
    rules: list[str] = []
    if xml:
        for i, f in enumerate(fns):
            rules += _xml_function(i, f["name"], f.get("parameters") or {}, _close(tags))
        calls = [f"call{i}" for i in range(len(fns))]
        if name is not None:   # the prompt holds <function=NAME> already: start at its body
            rules[0] = rules[0].replace(_lit(f"<function={name}>\n"), "", 1)
        rules.append(r"STRING_PARAM: /([^<]|<[^\/])*\n<\/parameter>\n/")
    else:
        close = _lit("}\n") + " " + _close(tags)
        if name is not None:   # the prompt holds {"name": NAME, "arguments": already
            rules.append(f"call0: {_json(fns[0].get('parameters') or {'type': 'object'})} {close}")
            calls = ["call0"]
        else:
            calls = []
            for i, f in enumerate(fns):
                head = _lit('{"name": ' + json.dumps(f["name"]) + ', "arguments": ')
                rules.append(f"call{i}: {head} "
                             f"{_json(f.get('parameters') or {'type': 'object'})} {close}")
                calls.append(f"call{i}")
    lead = '"\\n" ' if after_open else ""
    return f"start: {lead}(" + " | ".join(calls) + ")\n" + "\n".join(rules) + "\n"


def call_grammar(served, tools: list[dict], name: str | None, after_open: bool = False) -> str:
    """tool_call_grammar in the served template's call form, closed with its vocabulary's
    </tool_call> token where it has one."""
    from .openai_format import xml_tool_calls
    return tool_call_grammar(tools, name, xml=xml_tool_calls(served.template.source),
                             after_open=after_open, tags=served.tokenizer.markup_texts)


def constraint_for(served, grammar: str | None = None, schema: dict | None = None):
    """A GrammarConstraint for this request (a Lark grammar, or a JSON schema), or a 400 that
    names the extra when the library is missing, or the grammar's problem."""
    from moe_offload import ConstraintUnavailable, GrammarConstraint, OffloadError
    try:
        import llguidance
    except ImportError:
        raise ApiError(400, f"structured output and forced tool calls need constrained decoding, "
                            f"which this server lacks: {EXTRA}, then restart it",
                       param="response_format" if schema is not None else "tool_choice",
                       code="unsupported") from None
    if schema is not None:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"response_format's schema is not usable: {e}"[:300],
                           param="response_format", code="invalid_value") from None
    try:
        return GrammarConstraint(grammar, served.tokenizer, served.n_logits)
    except ConstraintUnavailable as e:
        raise ApiError(400, str(e), code="unsupported") from None
    except OffloadError as e:
        raise ApiError(400, f"{'response_format' if schema is not None else 'the tools'}: "
                            f"{e}"[:400], param="response_format" if schema is not None
                       else "tools", code="invalid_value") from None


def lazy_tool_calls(served, tools: list[dict], prompt_text: str = ""):
    """tool_choice auto: a TriggeredConstraint that holds a call the reply begins (its
    <tool_call> token) to the form and the tools' parameters, or None where that cannot be
    had -- the constrained-decoding library is missing, the vocabulary has no <tool_call>
    token, a tool's name cannot be written in the grammar, speculative decoding (--draft)
    draws without a mask: the reply is then free, as it always is for auto. Inside a
    reasoning block (from <think>, or from the start where the prompt opened one, to </think>)
    the <tool_call> token opens nothing."""
    from moe_offload import OffloadError, TriggeredConstraint
    from .openai_format import CALL_OPEN, THINK_CLOSE, THINK_OPEN
    if not tools or served.engine.draft is not None:
        return None
    trigger = served.tokenizer.token_id(CALL_OPEN)
    if trigger is None:
        return None
    try:
        import llguidance  # noqa: F401
        grammar = call_grammar(served, tools, None, after_open=True)
        first = constraint_for(served, grammar=grammar)   # compiles it: errors show here
    except (ImportError, ApiError, OffloadError):
        return None
    pending = [first]

    def start():
        return pending.pop() if pending else constraint_for(served, grammar=grammar)
    tok = served.tokenizer
    ids = lambda text: [i for i in [tok.token_id(text)] if i is not None]  # noqa: E731
    return TriggeredConstraint([trigger], start, pause_ids=ids(THINK_OPEN),
                               resume_ids=ids(THINK_CLOSE),
                               paused=prompt_text.rstrip().endswith(THINK_OPEN))
