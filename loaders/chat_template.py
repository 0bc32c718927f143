"""Chat templates: a GGUF's `tokenizer.chat_template` (Jinja2) rendered in a sandbox.

The template is code from a downloaded file, so it runs in Jinja2's immutable sandbox (no
attribute tricks, no mutating lists or dicts). Real templates are written for the conventions
of Hugging Face's renderer, so those hold here too: trim_blocks and lstrip_blocks on, `break` and
`continue`, `raise_exception(msg)`, a `tojson` that keeps non-ASCII text and takes `indent`, and
`strftime_now(fmt)`. A file without a template gets ChatML.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import GGUFError
from .vocab import CHATML_TEMPLATE


class _TemplateRaised(Exception):
    """A template called raise_exception(msg): it refuses this conversation."""


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts want the plain JSON
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class ChatTemplate:
    """A compiled chat template; `render(messages, ...)` gives the prompt text."""

    def __init__(self, source: str | None = None, where: str = "tokenizer.chat_template"):
        self.is_default = not source
        self.source = source or CHATML_TEMPLATE
        self.where = where
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise GGUFError(f"{where}: syntax error at template line {e.lineno}: "
                            f"{_one_line(e.message or e)}") from None

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], where: str = "model") -> "ChatTemplate":
        """The template of a GGUF metadata table (ChatML when it has none)."""
        return cls(md.get("tokenizer.chat_template"), f"{where}: tokenizer.chat_template")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "ChatTemplate":
        """The template stored in the GGUF at `path` (ChatML when it has none)."""
        from .gguf_file import open_gguf
        with open_gguf(path) as f:
            return cls.from_metadata(f.metadata, str(f.path))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, bos_token: str = "", eos_token: str = "",
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt for `messages` ([{role, content}, ...]). enable_thinking=None leaves it
        undefined, so the template's own default applies; `extra` reaches the template as is."""
        context = dict(extra, messages=_checked(messages), tools=tools,
                       add_generation_prompt=bool(add_generation_prompt),
                       bos_token=bos_token, eos_token=eos_token)
        if enable_thinking is not None:
            context["enable_thinking"] = bool(enable_thinking)
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise GGUFError(f"{self.where} refused the conversation: {_one_line(e)}") from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError,
                ArithmeticError) as e:
            line = _template_line(e)
            at = f" at template line {line}" if line else ""
            raise GGUFError(f"{self.where} failed{at}: {type(e).__name__}: "
                            f"{_one_line(e)}") from None


def render_chat(template: str | None, messages: Sequence[Mapping[str, Any]],
                **kwargs: Any) -> str:
    """Compile `template` (None: ChatML) and render `messages`; see ChatTemplate.render."""
    return ChatTemplate(template).render(messages, **kwargs)


def _checked(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise GGUFError("chat messages must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise GGUFError(f"chat message {i} must be an object with a string 'role', "
                            f"got {m!r:.80}")
        out.append(dict(m))
    return out


def _template_line(e: BaseException) -> int | None:
    # Jinja rewrites tracebacks so the template's own frames carry template line numbers
    line, tb = None, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
