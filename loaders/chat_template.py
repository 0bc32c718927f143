"""Chat templates: a GGUF's `tokenizer.chat_template` (Jinja2) turned into a prompt.

`ChatTemplate.render(messages, ...)` gives the prompt's text; `ChatTemplate.render_prompt(messages,
tokenizer, ...)` gives its text and token ids, which is what a chat should feed the model (see
there: client text never becomes control tokens). A file without a template gets ChatML.

Where it runs: a template that came from outside (a model file, --chat-template FILE) renders in
a separate worker process under hard OS limits (template_worker), with the sandbox's own checks
(template_sandbox) inside it as the fast path; our built-in ChatML renders in this process. Both
raise ChatTemplateError, one line that names the limit or failure and `--chat-template FILE`.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from . import template_worker
from .errors import ChatTemplateError
from .template_sandbox import (DEFAULT_LIMITS, OVERRIDE_HINT, TemplateLimits, check_source,
                               compile_template, render_compiled)
from .vocab import CHATML_TEMPLATE

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

__all__ = ["ChatTemplate", "RenderedPrompt", "render_chat", "TemplateLimits", "DEFAULT_LIMITS",
           "OVERRIDE_HINT", "ChatTemplateError"]


class ChatTemplate:
    """A compiled chat template; `render(messages, ...)` gives the prompt text,
    `render_prompt(messages, tokenizer, ...)` its text and ids.

    isolate: render in a worker process under OS limits (template_worker). None (the default)
    means yes for any template given as text (a model file's, a --chat-template file's) and no
    for the built-in ChatML; False is for templates you trust (tests, your own code), which then
    render in this process under the sandbox's checks alone. FTPATCH_TEMPLATE_WORKER=0 in the
    environment makes None mean no (for a system that cannot start the worker process)."""

    def __init__(self, source: str | None = None, where: str = "tokenizer.chat_template",
                 limits: TemplateLimits = DEFAULT_LIMITS, *, isolate: bool | None = None):
        if source is not None:
            check_source(source, where, limits)
        self.is_default = not source
        self.source = source or CHATML_TEMPLATE
        self.where = where
        self.limits = limits
        if isolate is None:
            isolate = not self.is_default and os.environ.get("FTPATCH_TEMPLATE_WORKER") != "0"
        self.isolate = bool(isolate)
        check_source(self.source, where, limits)
        self._key = hashlib.sha256(self.source.encode("utf-8", "surrogatepass")).hexdigest()
        self._template = None
        if self.isolate:   # compiled there, so a syntax error shows now, as in this process
            template_worker.run("compile", self._key, self.source, where, limits)
        else:
            self._template = compile_template(self.source, where, limits)
        self._source_pua = frozenset(_PUA.findall(self.source))

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], where: str = "model",
                      limits: TemplateLimits = DEFAULT_LIMITS) -> "ChatTemplate":
        """The template of a GGUF metadata table (ChatML when it has none)."""
        return cls(md.get("tokenizer.chat_template"), f"{where}: tokenizer.chat_template", limits)

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
        undefined, so the template's own default applies; `extra` reaches the template as is.
        Raises ChatTemplateError (a GGUFError) when the template fails or passes a limit.

        This is text only: tokenizing it with parse_special=True turns control-token text in
        the messages into control tokens. A chat's prompt comes from render_prompt."""
        return self._render(_context(messages, tools, add_generation_prompt, enable_thinking,
                                     bos_token, eos_token, extra))

    def render_prompt(self, messages: Sequence[Mapping[str, Any]], tokenizer: "Tokenizer", *,
                      tools: Sequence[Mapping[str, Any]] | None = None,
                      add_generation_prompt: bool = True, enable_thinking: bool | None = None,
                      allow_special_in_content: bool = False, bos_token: str | None = None,
                      eos_token: str | None = None, **extra: Any) -> "RenderedPrompt":
        """The prompt for `messages` as the model reads it: RenderedPrompt(text, ids).

        Only the template's own markup becomes control tokens. Every string the caller passes
        in `messages`, `tools` and `extra` (contents, tool arguments and names, keys, any value;
        all of it may come from a client) is text: where such a string spells a control token
        of `tokenizer` (e.g. "<|im_end|>\\n<|im_start|>system"), it is tokenized as the
        characters it is made of, never as the token, so a user cannot forge a turn.

        How: before rendering, each control token's text in those strings is replaced by a
        private-use character that occurs in none of them (nor in the template), and so does
        a string's first or last few characters where they could join a neighbour into a
        control token (a proper suffix, a proper prefix of one: "<|im_" + "end|>"). The
        template renders that; its output is split at the special tokens it spells (the
        template's markup), and the text between them is tokenized as plain text with the
        placeholders turned back into the characters they stand for. A template's string
        tests on client text see a placeholder there instead of the control token's text.
        User-defined tokens (type 4: "<think>", "<tool_call>" in Qwen's vocabularies) stay as
        they are: they are the content's own markup, which the model writes and clients send
        back, and templates look for them in it (`content.split('</think>')`).

        allow_special_in_content=True: the text is rendered as given and tokenized with
        parse_special=True, so control-token text anywhere becomes control tokens (what
        llama.cpp, HF and vLLM do; `--allow-special-in-content`). bos_token / eos_token
        default to the tokenizer's; they are the template's own, not client text."""
        if bos_token is None:
            bos_token = tokenizer.bos_token
        if eos_token is None:
            eos_token = tokenizer.eos_token
        if allow_special_in_content or not tokenizer.control_texts:
            text = self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               enable_thinking=enable_thinking, bos_token=bos_token,
                               eos_token=eos_token, **extra)
            return RenderedPrompt._build(tokenizer, text, {}, protect=False)
        guard = _guard(tokenizer)
        avoid = set(self._source_pua)
        for _ in range(4):
            marker = _Marker(guard, avoid)
            context = _context(marker.walk(_checked(messages)), marker.walk(tools),
                               add_generation_prompt, enable_thinking, bos_token, eos_token,
                               {k: marker.walk(v) for k, v in extra.items()})
            if not marker.collided():
                break
            avoid |= marker.seen    # a placeholder taken before its character showed up
        else:
            raise ChatTemplateError("the messages use too many private-use characters to "
                                    "keep control tokens out of them")
        return RenderedPrompt._build(tokenizer, self._render(context), marker.literals,
                                     protect=True)

    def _render(self, context: dict[str, Any]) -> str:
        if self.isolate:
            return template_worker.run("render", self._key, self.source, self.where,
                                       self.limits, context)
        try:
            return render_compiled(self._template, self.where, self.limits, context)
        except MemoryError:
            raise ChatTemplateError(f"{self.where}: rendering ran out of memory; "
                                    f"{OVERRIDE_HINT}") from None


def render_chat(template: str | None, messages: Sequence[Mapping[str, Any]],
                **kwargs: Any) -> str:
    """Compile `template` (None: ChatML) and render `messages`; see ChatTemplate.render."""
    return ChatTemplate(template).render(messages, **kwargs)


def _context(messages: Any, tools: Any, add_generation_prompt: bool,
             enable_thinking: bool | None, bos_token: str, eos_token: str,
             extra: dict[str, Any]) -> dict[str, Any]:
    context = dict(extra, messages=_checked(messages), tools=tools,
                   add_generation_prompt=bool(add_generation_prompt),
                   bos_token=bos_token, eos_token=eos_token)
    if enable_thinking is not None:
        context["enable_thinking"] = bool(enable_thinking)
    return context


def _checked(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("chat messages must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"chat message {i} must be an object with a string 'role', "
                                    f"got {m!r:.80}")
        out.append(dict(m))
    return out


# -- keeping control tokens out of client text ---------------------------------------------------

# Unicode's private-use areas: characters no tokenizer gives a meaning of its own
_PUA_RANGES = ((0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))
_PUA = re.compile("[" + "".join(f"{chr(a)}-{chr(b)}" for a, b in _PUA_RANGES) + "]")


class _Guard:
    """What marking needs to know of a tokenizer's control tokens (built once per tokenizer)."""

    def __init__(self, tokenizer: "Tokenizer"):
        from .tokenizer import _SpecialFinder
        names = tokenizer.control_texts
        self.finder = _SpecialFinder(names)
        self.longest = max(map(len, names))
        self.prefixes = {n[:k] for n in names for k in range(1, len(n))}
        self.suffixes = {n[k:] for n in names for k in range(1, len(n))}
        # a string with none of these characters needs nothing: a control token (or a proper
        # prefix of one) starts with a first character, a proper suffix ends with a last one
        edges = {n[0] for n in names} | {n[-1] for n in names}
        self.quick = re.compile("[" + "".join(map(re.escape, sorted(edges))) +
                                _PUA.pattern[1:-1] + "]")


_guards: "weakref.WeakKeyDictionary[Any, _Guard]" = weakref.WeakKeyDictionary()
_guards_lock = threading.Lock()


def _guard(tokenizer: "Tokenizer") -> _Guard:
    with _guards_lock:
        g = _guards.get(tokenizer)
        if g is None:
            g = _guards[tokenizer] = _Guard(tokenizer)
        return g


class _Marker:
    """One pass over the client's data: copies with control tokens (and the edges that could
    make one) replaced by placeholders; `literals` maps each placeholder back to its text."""

    def __init__(self, guard: _Guard, avoid: set[str]):
        self.g = guard
        self.avoid = avoid                  # characters placeholders must not be
        self.seen: set[str] = set()         # private-use characters in the data
        self.literals: dict[str, str] = {}  # placeholder -> text
        self._by_text: dict[str, str] = {}
        self._next = _pua_chars()

    def collided(self) -> bool:
        return not self.seen.isdisjoint(self.literals)

    def walk(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.mark(value) if self.g.quick.search(value) else value
        if isinstance(value, Mapping):
            return {self.walk(k): self.walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.walk(v) for v in value)
        return value

    def placeholder(self, text: str) -> str:
        p = self._by_text.get(text)
        if p is None:
            for p in self._next:
                if p not in self.avoid and p not in self.seen:
                    break
            else:
                raise ChatTemplateError("the messages use too many private-use characters to "
                                        "keep control tokens out of them")
            self._by_text[text] = p
            self.literals[p] = text
        return p

    def mark(self, s: str) -> str:
        g = self.g
        self.seen.update(_PUA.findall(s))
        spans = list(g.finder.finditer(s))
        first = spans[0][0] if spans else len(s)
        last = spans[-1][1] if spans else 0
        head = next((q for q in range(min(first, g.longest - 1), 0, -1)
                     if s[:q] in g.suffixes), 0)
        tail = next((p for p in range(max(last, head, len(s) - g.longest + 1), len(s))
                     if s[p:] in g.prefixes), len(s))
        if not spans and head == 0 and tail == len(s):
            return s
        out, pos = [], head
        if head:
            out.append(self.placeholder(s[:head]))
        for start, end, name in spans:
            out.append(s[pos:start])
            out.append(self.placeholder(name))
            pos = end
        out.append(s[pos:tail])
        if tail < len(s):
            out.append(self.placeholder(s[tail:]))
        return "".join(out)


def _pua_chars():
    for a, b in _PUA_RANGES:
        for c in range(a, b + 1):
            yield chr(c)


# -- the result ----------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class RenderedPrompt:
    """A chat prompt: `text` as the template wrote it (client strings as given) and `ids`, its
    tokens (the template's markup as special tokens, client strings as text).

    encode_suffix(s) tokenizes the end of `text` the same way (a chat that keeps the cached ids
    of an earlier turn's text tokenizes only what is new: `continue_ids(tokens, cached_text,
    p.text, p.encode_suffix)`); append(s) adds text after the prompt (a prefilled reply, a
    forced tool call's opening)."""

    text: str
    ids: list[int]
    _tokenizer: Any = field(repr=False)
    _marked: str = field(repr=False)                     # text with placeholders
    _literals: dict[str, str] = field(repr=False)        # placeholder -> its text
    _specials: tuple = field(repr=False)                 # (start, end, ids so far) in _marked
    _protect: bool = field(repr=False)                   # client text kept out of control ids

    @classmethod
    def _build(cls, tokenizer: "Tokenizer", marked: str, literals: dict[str, str], *,
               protect: bool) -> "RenderedPrompt":
        ids, specials = _encode_marked(tokenizer, marked, literals)
        return cls(_unmark(marked, literals), ids, tokenizer, marked, literals, specials,
                   protect)

    def encode_suffix(self, suffix: str) -> list[int]:
        """The ids of the last len(suffix) characters of `text` (which must end with
        `suffix`), tokenized as in `ids`: as if the prompt started there."""
        if not self.text.endswith(suffix):
            raise ValueError("encode_suffix: the prompt's text does not end with this text")
        if not suffix:
            return []
        start, marked, literals = len(self.text) - len(suffix), self._marked, self._literals
        if not literals:
            return _encode_marked(self._tokenizer, marked[start:], literals)[0]
        # literal offset -> marked offset: each placeholder stands for len(literal) characters
        mpos, lpos = 0, 0
        for m in _placeholders(literals).finditer(marked):
            n = len(literals[m.group()])
            if lpos + (m.start() - mpos) + n > start:
                if lpos + (m.start() - mpos) <= start:   # starts inside this placeholder's text
                    cut = start - lpos - (m.start() - mpos)
                    rest = literals[m.group()][cut:]
                    q = next(c for c in _pua_chars() if c not in literals and c not in marked)
                    tail = q + marked[m.end():]
                    return _encode_marked(self._tokenizer, tail, {**literals, q: rest})[0]
                break
            lpos += (m.start() - mpos) + n
            mpos = m.end()
        return _encode_marked(self._tokenizer, marked[mpos + (start - lpos):], literals)[0]

    def append(self, text: str, *, client: bool = True) -> "RenderedPrompt":
        """This prompt followed by `text`. client=True: `text` is client text (a prefilled
        reply), kept out of control tokens as render_prompt keeps messages; False: it is
        markup of the template's kind, whose special tokens count."""
        if not isinstance(text, str):
            raise TypeError(f"append() takes text, not {type(text).__name__}")
        tok, literals, new = self._tokenizer, dict(self._literals), text
        if client and self._protect and tok.control_texts:
            avoid = set(literals) | set(_PUA.findall(self._marked))
            while True:
                marker = _Marker(_guard(tok), avoid)
                new = marker.walk(text)
                if not marker.collided():
                    break
                avoid |= marker.seen
            literals.update(marker.literals)
        # a character of `text` that is one of our placeholders stands for itself
        for c in set(_PUA.findall(text)) & set(self._literals):
            q = next(p for p in _pua_chars() if p not in literals and p not in self._marked
                     and p not in new)
            literals[q] = c
            new = new.replace(c, q)
        marked = self._marked + new
        # special tokens that end far enough from the join cannot change: keep their ids
        keep = len(self._marked) - tok.longest_special
        cut = next((i for i in range(len(self._specials) - 1, -1, -1)
                    if self._specials[i][1] <= keep), -1)
        start, n_ids = (self._specials[cut][1], self._specials[cut][2]) if cut >= 0 else (0, 0)
        ids, specials = _encode_marked(tok, marked[start:], literals)
        specials = self._specials[:cut + 1] + tuple((a + start, b + start, k + n_ids)
                                                    for a, b, k in specials)
        return RenderedPrompt(_unmark(marked, literals), self.ids[:n_ids] + ids, tok, marked,
                              literals, specials, self._protect)


def _placeholders(literals: Mapping[str, str]) -> re.Pattern:
    return re.compile("[" + "".join(map(re.escape, literals)) + "]")


def _unmark(marked: str, literals: Mapping[str, str]) -> str:
    if not literals:
        return marked
    return _placeholders(literals).sub(lambda m: literals[m.group()], marked)


def _encode_marked(tok: "Tokenizer", marked: str, literals: Mapping[str, str]
                   ) -> tuple[list[int], tuple]:
    """ids of `marked`: its special tokens as their ids, the text between them (placeholders
    turned back into their text) as plain text; and (start, end, ids so far) per special."""
    ids: list[int] = []
    specials = []
    pos = 0
    plain = tok.encode_plain_into
    if literals:
        sub, back = _placeholders(literals).sub, (lambda m: literals[m.group()])
        unmark = lambda t: sub(back, t)   # noqa: E731
    else:
        unmark = str
    for start, end, tid in tok.find_specials(marked):
        if start > pos:
            plain(unmark(marked[pos:start]), ids)
        ids.append(tid)
        specials.append((start, end, len(ids)))
        pos = end
    if pos < len(marked):
        plain(unmark(marked[pos:]), ids)
    return ids, tuple(specials)
